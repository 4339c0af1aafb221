"""Elementwise ops, unary and binary with broadcasting (TraceLens ``UnaryElementwise``, ``BinaryElementwise``).

One FLOP per output element. Unary bytes: the input and the output (the output at the input's size unless a second
operand, the ``out=``, gives its type). Binary bytes: both inputs as recorded (a 0-d scalar counts one element)
and the broadcast output, at the larger input size when both are tensors, else at the first input's.

Resampling copies (TraceLens ``aten_upsample_nearest``, ``aten_replication_pad``): one FLOP per output element,
the input read and the output written at the input's size. Nearest upsampling's output takes its spatial size from
``output_size``; where a trace gives ``scale_factors`` instead (the ``.vec`` overload, on which TraceLens's model
fails), each spatial size is the input's times its factor, rounded down, as PyTorch computes it. Replication
padding adds its pairs to the last dimensions, innermost first.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from math import floor

from .op import Op, Work, bpe, broadcast, nelems, precision, shape

__all__ = ["MODELS"]

UNARY = ("aten::copy", "aten::copy_", "aten::clamp_min", "aten::clamp_min_", "aten::clamp_max", "aten::clamp_max_",
         "aten::sigmoid", "aten::rsqrt", "aten::silu", "aten::neg", "aten::pow")
BINARY = ("aten::div", "aten::div_", "aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::sigmoid_backward",
          "aten::threshold_backward")


def unary(op: Op) -> Work:
    n = nelems(shape(op.dims[0]))
    size_in = bpe(op.type(0))
    size_out = bpe(op.type(1)) if len(op.dims) > 1 and op.dims[1] else size_in
    moved = None if size_in is None or size_out is None else n * (size_in + size_out)
    return Work(n, moved, precision(op.type(0)), "vector")


def binary(op: Op) -> Work:
    a, b = shape(op.dims[0]), shape(op.dims[1])
    n = nelems(broadcast(a, b))
    size_a, size_b = bpe(op.type(0)), bpe(op.type(1))
    if len(op.dims) > 2 and op.dims[2]:
        size_out = bpe(op.type(2))
    elif size_a is None or size_b is None:
        size_out = None
    else:
        size_out = max(size_a, size_b) if a and b else size_a
    moved = None if None in (size_a, size_b, size_out) else nelems(a) * size_a + nelems(b) * size_b + n * size_out
    return Work(n, moved, precision(op.type(0)), "vector")


def _numbers(text: str) -> list[float]:
    value = json.loads(text) if text.strip() not in ("", "None") else []
    value = value if isinstance(value, list) else [value]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"not a list of numbers: {text!r}")
    return value


def _copy(op: Op, out: tuple[int, ...]) -> Work:
    size = bpe(op.type(0))
    n_out = nelems(out)
    return Work(n_out, None if size is None else (nelems(shape(op.dims[0])) + n_out) * size, precision(op.type(0)),
                "vector")


def upsample_nearest(op: Op) -> Work:  # input, output_size, scales... (or input, output_size, scale_factors)
    x = shape(op.dims[0])
    spatial = _numbers(op.scalar(1))
    if not spatial:
        factors = _numbers(op.scalar(2))
        if len(factors) != len(x) - 2:
            raise ValueError("neither an output size nor a scale factor per spatial dimension")
        spatial = [floor(d * f) for d, f in zip(x[2:], factors)]
    if len(spatial) != len(x) - 2 or not all(type(d) is int for d in spatial):
        raise ValueError(f"an output size {spatial} for an input of shape {x}")
    return _copy(op, (*x[:2], *spatial))


def replication_pad(op: Op) -> Work:  # input, padding (left, right of the last dimension, then the one before...)
    x = list(shape(op.dims[0]))
    pad = _numbers(op.scalar(1))
    if len(pad) % 2 or len(pad) // 2 > len(x) or not all(type(p) is int for p in pad):
        raise ValueError(f"a padding {pad} for an input of shape {tuple(x)}")
    for i in range(len(pad) // 2):
        x[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    return _copy(op, tuple(x))


MODELS: dict[str, Callable[[Op], Work]] = {
    **dict.fromkeys(UNARY, unary), **dict.fromkeys(BINARY, binary), "LigerSiLUMulFunction": binary,
    **{f"aten::upsample_nearest{n}d": upsample_nearest for n in (1, 2, 3)},
    **{f"aten::replication_pad{n}d": replication_pad for n in (1, 2, 3)},
}
