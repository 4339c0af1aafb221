"""Attention (SDPA), forward and backward: PyTorch's flash, efficient and cuDNN kernels and FlashAttention's
autograd functions and ops (TraceLens ``PerfModel/perf_model.py`` ``SDPA`` and its subclasses).

Forward FLOPs ``4·B·H_q·N_q·N_kv·d`` (QKᵀ and PV; the softmax is left out), halved when causal; bytes Q, K, V
read and O written, at 2 bytes each as TraceLens counts them. Backward (flash: QKᵀ recomputed) adds the four
gradient GEMMs and the GQA reductions; bytes Q, K, V, dO read and dQ, dK, dV written, at the element size of Q.
TraceLens gives PyTorch's SDPA backward ops a category and no model; here they get the backward model.
FlashAttention's varlen ops pack the batch's sequences along one axis (``(total, heads, head dim)``, with the
cumulative lengths ``cu_seqlens``): as TraceLens counts them, one sequence of the longest length and the others of
the mean length of the rest. ROCm's aiter ops (``aiter::mha_fwd``, ``aiter::fmha_v3_fwd``, ...) and FlashAttention
3's ``flash_attn_3::fwd`` are read as TraceLens reads them. vLLM's attention is in ``vllm``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .op import Op, Work, bpe, precision, shape

__all__ = ["BACKWARD", "MODELS"]

_BHND = (0, 1, 2, 3)  # PyTorch's SDPA: (batch, heads, length, head dim)
_BNHD = (0, 2, 1, 3)  # FlashAttention's: (batch, length, heads, head dim)


class _Cfg(NamedTuple):
    b: int
    n_q: int
    h_q: int
    n_kv: int
    h_kv: int
    d_qk: int
    d_v: int


def _cfg(op: Op, first: int, layout: tuple[int, int, int, int]) -> _Cfg:
    q, k, v = (shape(op.dims[first + i]) for i in range(3))
    (bq, hq, nq, dq), (bk, hk, nk, dk), (bv, hv, nv, dv) = ([s[i] for i in layout] for s in (q, k, v))
    if not (bq == bk == bv and hk == hv and nk == nv and dq == dk):
        raise ValueError(f"q, k, v do not match: {q}, {k}, {v}")
    return _Cfg(bq, nq, hq, nk, hk, dq, dv)


def _causal(op: Op, i: int, default: bool | None = None) -> bool:
    """The concrete input ``i`` as is_causal; ``default`` when it is absent or empty, and without a default an
    error (a trace that does not say cannot be modelled)."""
    text = op.scalar(i).strip().lower()
    if text in ("", "none"):
        if default is None and i >= len(op.concrete):
            raise ValueError("is_causal is not in the trace")
        return bool(default)
    return text == "true"


def _halve(flops: float, causal: bool, c: _Cfg) -> float:
    if not causal:
        return flops
    if c.n_q != c.n_kv:
        raise ValueError(f"causal attention with N_q {c.n_q} != N_kv {c.n_kv}")
    return flops / 2


def _forward(c: _Cfg, causal: bool, dtype: str | None) -> Work:
    flops = c.b * c.h_q * (2 * c.n_q * c.n_kv * c.d_qk) + c.b * c.h_q * (2 * c.n_q * c.d_v * c.n_kv)
    elems = c.b * (c.n_q * c.h_q * c.d_qk + c.n_kv * c.h_kv * (c.d_qk + c.d_v) + c.n_q * c.h_q * c.d_v)
    return Work(_halve(flops, causal, c), elems * 2, precision(dtype), "matrix")


def _backward(c: _Cfg, causal: bool, dtype: str | None, flash: bool) -> Work:
    b, hq, nq, nkv, dqk, dv = c.b, c.h_q, c.n_q, c.n_kv, c.d_qk, c.d_v
    gqa = hq // c.h_kv - 1
    flops = (b * hq * 2 * nq * nkv * dqk if flash else 0)  # QKᵀ recomputed
    flops += b * hq * 2 * nkv * nq * dv + b * nkv * dv * gqa  # dV, reduced over the query heads of a KV head
    flops += b * hq * 2 * nq * nkv * dv  # dP
    flops += b * hq * 2 * nq * nkv * dqk  # dQ
    flops += b * hq * 2 * nkv * nq * dqk + b * nkv * dqk * gqa  # dK
    elems = b * (2 * nq * hq * dqk + 2 * nkv * c.h_kv * (dqk + dv) + nq * hq * dv)
    size = bpe(dtype)
    return Work(_halve(flops, causal, c), None if size is None else elems * size, precision(dtype), "matrix")


def _fwd(first: int, layout: tuple[int, int, int, int], causal_at: int, default: bool | None = None
         ) -> Callable[[Op], Work]:
    return lambda op: _forward(_cfg(op, first, layout), _causal(op, causal_at, default), op.type(first))


def _bwd(first: int, layout: tuple[int, int, int, int], causal_at: int, flash: bool, default: bool | None = None
         ) -> Callable[[Op], Work]:
    return lambda op: _backward(_cfg(op, first, layout), _causal(op, causal_at, default), op.type(first), flash)


def _varlen(op: Op, first: int, at: int, backward: bool) -> Work:
    """FlashAttention's varlen forward (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p, softmax_scale, causal, ...) or backward (dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
    ...), q at ``first`` and cu_seqlens_q at ``at``: the FLOPs of the longest sequence and of the others at their
    mean length; the bytes of the whole packed q, k, v and o (and of the gradients, backward)."""
    q, k, v = (shape(op.dims[first + i]) for i in range(3))
    (nq, hq, dq), (nk, hk, dk), (nv, hv, dv) = q, k, v
    if not (hk == hv and nk == nv and dq == dk):
        raise ValueError(f"q, k, v do not match: {q}, {k}, {v}")
    seqs_q, seqs_k = shape(op.dims[at])[0] - 1, shape(op.dims[at + 1])[0] - 1
    max_q, max_k = int(float(op.scalar(at + 2))), int(float(op.scalar(at + 3)))
    causal = _causal(op, at + 6)
    total = _Cfg(1, nq, hq, nk, hk, dq, dv)
    one = total._replace(n_q=max_q, n_kv=max_k)
    rest = total._replace(n_q=(nq - max_q) // max(seqs_q - 1, 1), n_kv=(nk - max_k) // max(seqs_k - 1, 1))
    model = (lambda c: _backward(c, causal, op.type(first), True)) if backward else (
        lambda c: _forward(c, causal, op.type(first)))
    flops = model(one).flops + ((seqs_q - 1) * model(rest).flops if seqs_q > 1 else 0)
    moved = (_backward(total, False, op.type(first), True) if backward else _forward(total, False, None)).bytes
    return Work(flops, moved, precision(op.type(first)), "matrix")


MODELS: dict[str, Callable[[Op], Work]] = {
    # query, key, value, dropout_p, is_causal, ...
    "aten::_scaled_dot_product_flash_attention": _fwd(0, _BHND, 4),
    "aten::_scaled_dot_product_flash_attention_for_cpu": _fwd(0, _BHND, 4),
    # query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, ...
    "aten::_scaled_dot_product_efficient_attention": _fwd(0, _BHND, 6),
    "aten::_scaled_dot_product_cudnn_attention": _fwd(0, _BHND, 6),
    # grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, ...
    "aten::_scaled_dot_product_flash_attention_backward": _bwd(1, _BHND, 11, True),
    # grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
    # grad_input_mask, is_causal, ...
    "aten::_scaled_dot_product_efficient_attention_backward": _bwd(1, _BHND, 11, False),
    # grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
    # max_q, max_k, dropout_p, is_causal, ...
    "aten::_scaled_dot_product_cudnn_attention_backward": _bwd(1, _BHND, 14, False),
    # FlashAttention: q, k, v, dropout_p, softmax_scale, causal, ...
    "FlashAttnFunc": _fwd(0, _BNHD, 5),
    "flash_attn::_flash_attn_forward": _fwd(0, _BNHD, 5),
    # dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, ... (causal when absent).
    # TraceLens reads causal at index 10, the softmax scale, whose text is always true: it halves every call
    "flash_attn::_flash_attn_backward": _bwd(1, _BNHD, 11, True, default=True),
    "flash_attn::_flash_attn_varlen_forward": lambda op: _varlen(op, 0, 3, False),
    "flash_attn::_flash_attn_varlen_backward": lambda op: _varlen(op, 1, 9, True),
    # ROCm's aiter and FlashAttention 3, (batch, length, heads, head dim); not causal when the trace does not say.
    # q, k, v, dropout_p, softmax_scale, causal, ...
    **dict.fromkeys(("aiter::_flash_attn_forward", "aiter::mha_fwd", "aiter::fmha_v3_fwd"), _fwd(0, _BNHD, 5, False)),
    "aiter::wrapper_fmha_v3_fwd": _fwd(1, _BNHD, 6, False),  # out, q, k, v, dropout_p, softmax_scale, causal
    "flash_attn_3::fwd": _fwd(0, _BNHD, 24, False),
    # dout, q, k, v, ...: TraceLens reads aiter::_flash_attn_backward's dout, q, k as q, k, v (the same shapes
    # unless K and V have fewer heads than Q)
    "aiter::_flash_attn_backward": _bwd(1, _BNHD, 12, True, False),
    "aiter::mha_bwd": _bwd(1, _BNHD, 8, True, False),
    "aiter::wrapper_fmha_v3_bwd": _bwd(1, _BNHD, 9, True, False),
}
# A forward op's backward from the forward's own args (TraceLens's ``flops_bwd``, ``bytes_bwd``), for a backward op
# that has no model of its own (CPU's ``aten::_scaled_dot_product_flash_attention_for_cpu_backward``)
BACKWARD: dict[str, Callable[[Op], Work]] = {
    "aten::_scaled_dot_product_flash_attention": _bwd(0, _BHND, 4, True),
    "aten::_scaled_dot_product_flash_attention_for_cpu": _bwd(0, _BHND, 4, True),
    "aten::_scaled_dot_product_efficient_attention": _bwd(0, _BHND, 6, False),
    "aten::_scaled_dot_product_cudnn_attention": _bwd(0, _BHND, 6, False),
    "FlashAttnFunc": _bwd(0, _BNHD, 5, True),
    "flash_attn::_flash_attn_forward": _bwd(0, _BNHD, 5, True),
    "flash_attn::_flash_attn_varlen_forward": lambda op: _varlen(op, 0, 3, True),
    **dict.fromkeys(("aiter::_flash_attn_forward", "aiter::mha_fwd", "aiter::fmha_v3_fwd"),
                    _bwd(0, _BNHD, 5, True, False)),
    "aiter::wrapper_fmha_v3_fwd": _bwd(1, _BNHD, 6, True, False),
    "flash_attn_3::fwd": _bwd(0, _BNHD, 24, True, False),
}
