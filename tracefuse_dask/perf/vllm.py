"""vLLM's ``vllm::unified_attention_with_output`` (TraceLens ``vllm_unified_attention_with_output``).

Its shapes say nothing of the batch: vLLM's own annotation around the step does, ``execute_context_C(T_S)_
generation_G(N)`` (C prefill requests of T tokens whose squares sum to S, G decode requests of N tokens), which the
analysis hands in as the op's context. FLOPs ``2·H_q·(S + N)·(d_qk + d_v)`` (QKᵀ and PV of the prefill's causal
squares and of one query per decoded token, as TraceLens counts them); bytes Q, K, V read and O written for the
prefill tokens, at 2 bytes each. A step of decoding only has no model, as in TraceLens.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from .op import Op, Work, precision, shape

__all__ = ["CONTEXT", "MODELS", "unified_attention"]

CONTEXT = re.compile(r"^execute_context_\d+\((\d+)_(\d+)\)_generation_\d+\((\d+)\)$")


def unified_attention(op: Op) -> Work:
    m = CONTEXT.match(op.context)
    if m is None:
        raise ValueError("no vLLM execute_context annotation around the op")
    ctx, ctx_squared, gen = map(int, m.groups())
    if ctx == 0:
        raise ValueError("a decode-only step: no model")
    (_, h_q, d_qk), (_, h_kv, d_v) = shape(op.dims[0]), shape(op.dims[1])
    flops = h_q * 2 * (ctx_squared + gen) * (d_qk + d_v)
    moved = ctx * (h_q * d_qk + h_kv * d_qk + h_kv * d_v + h_q * d_v) * 2
    return Work(flops, moved, precision(op.type(0)), "matrix")


MODELS: dict[str, Callable[[Op], Work]] = {"vllm::unified_attention_with_output": unified_attention}
