"""Elementwise ops, unary and binary with broadcasting (TraceLens ``UnaryElementwise``, ``BinaryElementwise``).

One FLOP per output element. Unary bytes: the input and the output (the output at the input's size unless a second
operand, the ``out=``, gives its type). Binary bytes: both inputs as recorded (a 0-d scalar counts one element)
and the broadcast output, at the larger input size when both are tensors, else at the first input's.
"""
from __future__ import annotations

from collections.abc import Callable

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


MODELS: dict[str, Callable[[Op], Work]] = {**dict.fromkeys(UNARY, unary), **dict.fromkeys(BINARY, binary),
                                           "LigerSiLUMulFunction": binary}
