"""The `hf` rollout: a Ray-actor server running `transformers` sampling, and its worker-side adapter.

verl 0.9.1 only reaches rollouts through its server path (a `RolloutReplica` that launches server actors,
plus a `BaseRollout` adapter inside each trainer worker). vLLM, SGLang and TRT-LLM need accelerators, so
this module supplies the smallest server verl's agent loop can talk to:

- `HFRolloutServer` (Ray actor): loads the model once, answers `generate(prompt_ids, sampling_params)`
  with sampled token ids and their log-probabilities (log-softmax of logits / temperature, the quantity
  verl's actor recomputes), and receives full weights from the trainer via `load_weights`.
- `HFReplica` (driver side): creates one server per replica with a stable actor name.
- `HFServerAdapter` (inside each FSDP worker): drains verl's per-tensor weight generator on every rank
  (the generator runs collectives) and the replica's leader pushes the tensors to its server.

Sampling is seeded per request from (rollout seed, trainer step of the weights, prompt tokens, how many
times this prompt was seen since that sync), so outputs do not depend on the order in which concurrent
requests arrive, and a resumed run samples the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import Counter
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from engine.checkpoint.experts import fuse_experts
from engine.runtime import mutations

SERVER_PREFIX = "hf_rollout_server"


def server_name(replica_rank: int) -> str:
    return f"{SERVER_PREFIX}_{replica_rank}"


def _model_path(model_config: Any) -> str:
    for key in ("local_path", "path"):
        value = getattr(model_config, key, None)
        if value is None and hasattr(model_config, "get"):
            value = model_config.get(key)
        if value:
            return str(value)
    raise ValueError("hf rollout: model config has neither local_path nor path")


def _read(config: Any, key: str, default: Any) -> Any:
    value = getattr(config, key, None)
    if value is None and hasattr(config, "get"):
        value = config.get(key, None)
    return default if value is None else value


def load_model(path: str, trust_remote_code: bool = False) -> torch.nn.Module:
    """Load with the class named in config.json (the VL layout stays VL), float32, eval mode, sdpa."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    arch = (config.architectures or ["AutoModelForCausalLM"])[0]
    model_cls = getattr(transformers, arch, transformers.AutoModelForCausalLM)
    model = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


class HFRolloutServer:
    """Token-in/token-out server verl's LLMServerClient calls (`generate`) plus lifecycle no-ops."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        torch.set_num_threads(max(1, int(os.environ.get("HF_ROLLOUT_THREADS", "1"))))
        self.config = config
        self.replica_rank = replica_rank
        self.model = load_model(
            _model_path(model_config), bool(_read(model_config, "trust_remote_code", False))
        )
        gen = self.model.generation_config
        eos = (
            gen.eos_token_id
            if gen.eos_token_id is not None
            else self.model.config.get_text_config().eos_token_id
        )
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.seed = int(_read(config, "seed", 0))
        self.response_length = int(_read(config, "response_length", 512))
        self.lock = asyncio.Lock()
        self.seen: Counter[str] = Counter()
        self.weight_version = 0
        self.global_steps: int | None = None

    def ready(self) -> bool:
        return True

    def load_weights(self, weights: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Copy a full state dict in; every name must exist in the model (a silent no-op sync is the bug)."""
        own = self.model.state_dict()
        weights = fuse_experts(weights, own)
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise KeyError(f"hf rollout: {len(unknown)} synced tensors not in the model, e.g. {unknown[:3]}")
        if not mutations.active(mutations.NO_WEIGHT_SYNC):  # test-only breakage: keep initial weights
            with torch.no_grad():
                for name, tensor in weights.items():
                    own[name].copy_(tensor.to(own[name].dtype))
        self.weight_version += 1
        self.global_steps = global_steps
        self.seen.clear()
        return len(weights)

    def _request_seed(self, prompt_ids: list[int]) -> int:
        key = hashlib.sha256(str(prompt_ids).encode()).hexdigest()
        occurrence = self.seen[key]
        self.seen[key] += 1
        # the trainer step of the weights, not a count of syncs: a resumed run samples what an
        # uninterrupted one samples at the same step
        version = self.weight_version if self.global_steps is None else self.global_steps
        text = f"{self.seed}:{version}:{key}:{occurrence}"
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)

    @torch.no_grad()
    def _sample(
        self, prompt_ids: list[int], params: dict[str, Any], seed: int
    ) -> tuple[list[int], list[float]]:
        temperature = float(params.get("temperature", 1.0) or 0.0)
        top_k = int(params.get("top_k", -1) or -1)
        top_p = float(params.get("top_p", 1.0) or 1.0)
        max_tokens = int(params.get("max_tokens", params.get("max_new_tokens", self.response_length)))
        max_tokens = max(1, min(max_tokens, self.response_length))
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        past = None
        tokens: list[int] = []
        logprobs: list[float] = []
        for _ in range(max_tokens):
            out = self.model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            scaled = logits / temperature if temperature > 0 else logits
            logp = torch.log_softmax(scaled, dim=-1)
            if temperature <= 0:
                token = int(torch.argmax(logits))
            else:
                probs = logp.exp()
                if top_k > 0:
                    kth = torch.topk(probs, min(top_k, probs.numel())).values[-1]
                    probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
                if top_p < 1.0:
                    sorted_probs, order = torch.sort(probs, descending=True)
                    drop = torch.cumsum(sorted_probs, 0) - sorted_probs > top_p * sorted_probs.sum()
                    probs = probs.scatter(0, order[drop], 0.0)
                token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
            tokens.append(token)
            logprobs.append(float(logp[token]))
            if token in self.eos_ids and not params.get("ignore_eos", False):
                break
            input_ids = torch.tensor([[token]], dtype=torch.long)
        return tokens, logprobs

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str | None = None, **_: Any
    ) -> TokenOutput:
        async with self.lock:
            seed = self._request_seed(list(prompt_ids))
            tokens, logprobs = await asyncio.to_thread(
                self._sample, list(prompt_ids), dict(sampling_params), seed
            )
        want_logprobs = sampling_params.get("logprobs", True) not in (False, None)
        finished = len(tokens) > 0 and tokens[-1] in self.eos_ids
        return TokenOutput(
            token_ids=tokens,
            log_probs=logprobs if want_logprobs else None,
            stop_reason="completed" if finished else None,
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps},
        )

    # Lifecycle calls verl makes on every server; the model lives in host memory, so they are no-ops.
    async def wake_up(self) -> None: ...
    async def sleep(self) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def resume_generation(self) -> None: ...
    async def start_profile(self, **_: Any) -> None: ...
    async def stop_profile(self) -> None: ...

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}


class HFReplica(RolloutReplica):
    """One `HFRolloutServer` per replica; verl's router reaches it through `server_handle`."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        name = server_name(self.replica_rank) + self.name_suffix
        server = (
            ray.remote(HFRolloutServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name


class HFServerAdapter(BaseRollout):
    """Worker-side end of the naive weight sync: collect full tensors, the replica leader sends them."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        per_replica = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // per_replica if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % per_replica == 0
        self.sleep_level = 2
        self._server: Any = None

    def _server_handle(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None: ...

    async def release(self) -> None: ...

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout: wire_format {wire_format!r} is not supported")
        collected: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.is_leader_rank:
                collected[name] = full.detach().to("cpu", copy=True)
        if self.is_leader_rank:
            await self._server_handle().load_weights.remote(collected, kwargs.get("global_steps"))
