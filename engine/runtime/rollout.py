"""The `hf` rollout in verl's registries: its replica in `RolloutReplicaRegistry` and its worker adapter
in the `(name, mode)` rollout registry, both loaded lazily from `engine.runtime.hf_rollout` (torch)."""

from __future__ import annotations

ROLLOUT_NAME = "hf"
ADAPTER_PATH = "engine.runtime.hf_rollout.HFServerAdapter"


def _load_replica() -> type:
    from engine.runtime.hf_rollout import HFReplica

    return HFReplica


def register_rollout() -> None:
    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_PATH
    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)


def registrations_present() -> list[str]:
    """What is missing from verl's registries (empty when this module's registrations are in place)."""
    from verl.plugin.platform import PlatformRegistry
    from verl.workers.rollout import base, replica

    missing = []
    if PlatformRegistry.get("cpu") is None:
        missing.append("platform 'cpu'")
    if base._ROLLOUT_REGISTRY.get((ROLLOUT_NAME, "async")) != ADAPTER_PATH:
        missing.append("rollout adapter 'hf'")
    if ROLLOUT_NAME not in replica.RolloutReplicaRegistry._registry:
        missing.append("rollout replica 'hf'")
    return missing
