"""Normalisations, forward and backward: layer, RMS, batch and group norm (TraceLens ``Normalization`` and its
subclasses).

Forward FLOPs: ``2·n`` to scale and shift, ``6·C`` for the per-channel parameters and ``3·n`` more for the
statistics in training; bytes: the input and the output, plus the per-channel tensors (mean and variance; weight
and bias when affine; the running statistics written in training). RMS norm: ``rows·(2·C + 2)`` for the rms,
``n`` or ``2·n`` to apply it (and the weight). Backward: the gradient of the input and, when affine, of the
weight (and bias). ``n`` counts the input's elements and ``C`` the elements a statistic spans.

The fused RMS norms of ROCm's aiter and of vLLM (TraceLens's RMSNorm extensions, category ``RMSNorm``) take
the RMS norm's formula over their input and weight: one with a residual add adds ``n`` FLOPs, reads the residual
and writes the sum (``4·n`` elements moved with the input and the output); one with dynamic FP8 quantisation adds
``2·n`` FLOPs and writes one byte per element and a 4-byte scale per row. vLLM's ``_C::rms_norm`` and
``_C::fused_add_rms_norm`` are not in TraceLens; they take aiter's formulas on vLLM's argument order. aiter's
``_groupnorm_run`` is a group norm on either of aiter's argument orders (``input, num_groups, weight, bias, eps``;
since 2026 ``y, workspace, input, ...``); TraceLens reads its first argument as the input, the same shape.

Where TraceLens tells an affine norm by ``Input Dims[i] is not None``, a trace records an absent tensor as
``[]``: here an empty shape means no weight, so a norm without one is not counted as affine. TraceLens reads batch
norm's ``training`` and instance norm's ``use_input_stats`` as ``bool`` of their text, true for "False" too; here
"True" is training. cuDNN's and MIOpen's batch norm backward take inference statistics, as TraceLens takes them.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from math import prod

from .op import Op, Work, bpe, nelems, precision, shape

__all__ = ["MODELS", "RMS_MODELS"]


def _ints(text: str) -> list[int]:
    value = json.loads(text)
    value = value if isinstance(value, list) else [value]
    if not all(type(v) is int for v in value):
        raise ValueError(f"not a list of ints: {text!r}")
    return value


def _bools(text: str) -> list[bool]:
    return [v.strip() == "True" for v in text.strip("[]").split(",")]


def _has(op: Op, i: int) -> bool:
    return i < len(op.dims) and bool(op.dims[i])


def _forward(n: int, channels: int, training: bool, affine: bool, bias: bool, dtype: str | None) -> Work:
    flops = channels * 3 + (n * 3 if training else 0) + channels * 3 + 2 * n
    tensors = 2 + (1 + bias if affine else 0) + (2 if training else 0)
    size = bpe(dtype)
    moved = None if size is None else 2 * n * size + tensors * channels * size
    return Work(flops, moved, precision(dtype), "vector")


def _backward(n: int, channels: float, training: bool, affine: bool, bias: bool, grad_input: bool,
              dtype: str | None) -> Work:
    per_channel = n / channels
    grad = (5 * per_channel if training else 0) if grad_input else 2 * per_channel
    flops = channels * ((0 if training else 3) + 4 * per_channel + grad)
    size = bpe(dtype)
    if size is None:
        return Work(flops, None, precision(dtype), "vector")
    moved = n * size + n * size * (2 if grad_input and training else 1) + (channels * size if training else 0)
    if affine:
        moved += channels * size + (channels * size * (2 if bias else 1) if training else 0)
    return Work(flops, moved, precision(dtype), "vector")


def layer_norm(op: Op) -> Work:  # input, normalized_shape, weight, bias, eps
    return _forward(nelems(shape(op.dims[0])), prod(_ints(op.scalar(1))), True, _has(op, 2), _has(op, 3), op.type(0))


def layer_norm_backward(op: Op) -> Work:  # grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
    mask = _bools(op.scalar(7))
    return _backward(nelems(shape(op.dims[1])), prod(_ints(op.scalar(2))), True, mask[1], mask[2], mask[0],
                     op.type(1))


def batch_norm(op: Op) -> Work:  # input, weight, bias, running_mean, running_var, training, momentum, eps
    dims = shape(op.dims[0])
    return _forward(nelems(dims), dims[1], op.scalar(5) == "True", _has(op, 1), True, op.type(0))


def batch_norm_backward(op: Op) -> Work:
    # native: grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
    dims = shape(op.dims[1])
    return _backward(nelems(dims), dims[1], op.scalar(7) == "True", _has(op, 2), True, True, op.type(1))


def vendor_batch_norm_backward(op: Op) -> Work:
    # cuDNN's and MIOpen's: input, grad_output, weight, running_mean, running_var, save_mean, save_var, epsilon, ...;
    # inference statistics, as TraceLens takes them (the vendor kernels assert it)
    dims = shape(op.dims[0])
    return _backward(nelems(dims), dims[1], False, _has(op, 2), True, True, op.type(0))


def native_group_norm(op: Op) -> Work:  # input, weight, bias, N, C, HxW, group, eps
    dims = shape(op.dims[0])
    return _forward(nelems(dims), dims[1], True, _has(op, 1), True, op.type(0))


def group_norm(op: Op) -> Work:  # input, num_groups, weight, bias, eps, cudnn_enabled
    dims = shape(op.dims[0])
    return _forward(nelems(dims), dims[1], True, _has(op, 2), True, op.type(0))


def group_norm_backward(op: Op) -> Work:  # grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask
    dims = shape(op.dims[1])
    return _backward(nelems(dims), dims[1] / int(op.scalar(8)), True, _has(op, 4), True, _bools(op.scalar(9))[0],
                     op.type(1))


def rms_norm(op: Op) -> Work:  # input, normalized_shape, weight, eps
    n, channels, affine = nelems(shape(op.dims[0])), prod(_ints(op.scalar(1))), _has(op, 2)
    size = bpe(op.type(0))
    flops = n / channels * (2 * channels + 2) + n * (2 if affine else 1)
    moved = None if size is None else 2 * n * size + (channels * size if affine else 0)
    return Work(flops, moved, precision(op.type(0)), "vector")


def _rms(n: int, channels: int, dtype: str | None, extra: str = "") -> Work:
    """An affine RMS norm of ``n`` elements over ``channels``; ``extra``: "add" (a fused residual add) or "quant"
    (a fused dynamic FP8 quantisation)."""
    flops = n / channels * (2 * channels + 2) + 2 * n
    size = bpe(dtype)
    moved = None if size is None else 2 * n * size + channels * size
    if extra == "add":
        flops += n
        moved = None if moved is None else moved + 2 * n * size
    elif extra == "quant":
        flops += 2 * n
        moved = None if moved is None else n * size + channels * size + n + n // channels * 4
    return Work(flops, moved, precision(dtype), "vector")


def _fused_rms(x: int, weight: int, extra: str = "") -> Callable[[Op], Work]:
    """A fused RMS norm whose input is argument ``x`` and weight argument ``weight``."""
    return lambda op: _rms(nelems(shape(op.dims[x])), shape(op.dims[weight])[0], op.type(x), extra)


def rms_norm_backward(op: Op) -> Work:  # grad_out, input, normalized_shape, rstd, weight, output_mask
    n, channels, affine = nelems(shape(op.dims[1])), prod(_ints(op.scalar(2))), _has(op, 4)
    mask = _bools(op.scalar(5))
    flops = (n if affine else 0) + n + (6 * n if mask[0] else 0)
    if mask[1] and affine:
        flops += n + (n if n / channels > 1 else 0)
    size = bpe(op.type(1))
    moved = None if size is None else 3 * n * size + (2 * channels * size if affine else 0)
    return Work(flops, moved, precision(op.type(1)), "vector")


def aiter_group_norm(op: Op) -> Work:  # [y, workspace,] input, num_groups, weight, bias, eps
    at = 2 if len(op.dims) >= 7 else 0
    dims = shape(op.dims[at])
    return _forward(nelems(dims), dims[1], True, _has(op, at + 2), True, op.type(at))


def instance_norm(op: Op) -> Work:  # input, weight, bias, running_mean, running_var, use_input_stats, ...
    dims = shape(op.dims[0])
    return _forward(nelems(dims), dims[1], op.scalar(5) == "True", _has(op, 1), True, op.type(0))


_FAMILIES = {"batch_norm": (batch_norm, batch_norm_backward), "layer_norm": (layer_norm, layer_norm_backward),
             "group_norm": (native_group_norm, group_norm_backward)}
MODELS: dict[str, Callable[[Op], Work]] = {
    **{f"aten::{p}{family}": fwd for family, (fwd, _) in _FAMILIES.items() for p in ("", "native_")},
    **{f"aten::{p}{family}_backward": bwd for family, (_, bwd) in _FAMILIES.items() for p in ("", "native_")},
    "aten::group_norm": group_norm,
    # input, weight, bias, running_mean, running_var, training, momentum, epsilon: as native_batch_norm
    "aten::cudnn_batch_norm": batch_norm,
    "aten::miopen_batch_norm": batch_norm,
    "aten::cudnn_batch_norm_backward": vendor_batch_norm_backward,
    "aten::miopen_batch_norm_backward": vendor_batch_norm_backward,
    "aten::_fused_rms_norm": rms_norm,
    **{f"aten::{p}rms_norm_backward": rms_norm_backward for p in ("", "_fused_", "native_", "miopen_", "cudnn_")},
    # TraceLens's vendor variants (no such ops in PyTorch today), read as the op they stand for
    **{f"aten::{p}layer_norm": layer_norm for p in ("miopen_", "cudnn_")},
    **{f"aten::{p}layer_norm_backward": layer_norm_backward for p in ("miopen_", "cudnn_")},
    **{f"aten::{p}group_norm": group_norm for p in ("miopen_", "cudnn_")},
    **{f"aten::{p}group_norm_backward": group_norm_backward for p in ("miopen_", "cudnn_")},
    **{f"aten::{p}instance_norm": instance_norm for p in ("", "native_", "miopen_", "cudnn_")},
    "aiter::_groupnorm_run": aiter_group_norm,
}
# TraceLens's RMSNorm extensions (category RMSNorm): each one's input and weight arguments
RMS_MODELS: dict[str, Callable[[Op], Work]] = {
    "aiter::rms_norm": _fused_rms(0, 1),  # input, weight, epsilon, ...
    "aiter::rmsnorm2d_fwd_ck": _fused_rms(0, 1),
    "aiter::rmsnorm": _fused_rms(1, 2),  # out, input, weight, epsilon
    # out, input, residual_in, residual_out, weight, epsilon, ...
    "aiter::rmsnorm2d_fwd_with_add_ck": _fused_rms(1, 4, "add"),
    "aiter::add_rmsnorm": _fused_rms(1, 4, "add"),
    # out, input, yscale, weight, epsilon, ...
    "aiter::rmsnorm2d_fwd_with_dynamicquant_ck": _fused_rms(1, 3, "quant"),
    "_C::rms_norm": _fused_rms(1, 2),  # vLLM: result, input, weight, epsilon
    "_C::fused_add_rms_norm": _fused_rms(0, 2, "add"),  # vLLM: input, residual, weight, epsilon (in place)
}
