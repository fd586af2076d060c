"""Parameter counts of Qwen3.5 / Qwen3.5-MoE text models from their config: what preflight's memory
estimate and the throughput benchmark's FLOPs need, without torch or a model instance."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParamCount:
    """Text-model parameters of a Qwen3.5 / Qwen3.5-MoE config, counted from its shapes."""

    total: int  # every text parameter (the input embedding once when tied to the head)
    active: int  # used per token: attention, router, shared expert, top-k routed experts, embedding, head
    embedding: int  # the input embedding when untied: a table lookup, no matrix product

    @property
    def matmul(self) -> int:
        """The N of the 6 x N x tokens training FLOPs: active parameters that enter a matrix product."""
        return self.active - self.embedding


def count_text_params(config: Mapping[str, Any]) -> ParamCount:
    """Exact parameter count of a Qwen3.5 text config (Hugging Face keys), norms included.

    The same count as instantiating the model (tests compare with transformers on the meta device),
    without torch: preflight and the throughput benchmark use it.
    """
    h, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    kd = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    vd = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    nv = config["linear_num_value_heads"]
    # full attention: q_proj carries the output gate (2x), q/k norms per head dim
    full = h * heads * hd * 2 + 2 * h * kv * hd + heads * hd * h + 2 * hd
    # gated delta net: qkv, z, b, a, out projections, depthwise conv, dt_bias, A_log, gated norm
    linear = h * (2 * kd + vd) + h * vd + 2 * h * nv + vd * h
    linear += (2 * kd + vd) * config["linear_conv_kernel_dim"] + 2 * nv + config["linear_value_head_dim"]
    experts = config.get("num_experts", 0)
    if experts:
        routed = 3 * h * config["moe_intermediate_size"]  # one expert's gate, up and down projections
        # the router, the shared expert and its gate run for every token
        always = experts * h + 3 * h * config["shared_expert_intermediate_size"] + h
        mlp_total = always + experts * routed
        mlp_active = always + config["num_experts_per_tok"] * routed
    else:
        mlp_total = mlp_active = 3 * h * config["intermediate_size"]
    kinds = list(config["layer_types"])[: config["num_hidden_layers"]]
    attention = sum(full if kind == "full_attention" else linear for kind in kinds) + 2 * h * len(kinds)
    tied = config.get("tie_word_embeddings", False)
    embed = vocab * h
    head = 0 if tied else vocab * h
    total = attention + len(kinds) * mlp_total + embed + head + h  # + the final norm
    active = attention + len(kinds) * mlp_active + embed + head + h
    return ParamCount(total=total, active=active, embedding=0 if tied else embed)
