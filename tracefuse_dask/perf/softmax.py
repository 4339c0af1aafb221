"""Softmax, forward and backward (TraceLens ``Softmax``, which its attention models use; TraceLens maps no aten
op to it, so ``aten::_softmax`` and ``aten::_softmax_backward_data`` are modelled here with its rule).

Forward: 3 FLOPs per element (exponent, sum, division) and the input and output moved; backward twice both (the
forward is recomputed).
"""
from __future__ import annotations

from collections.abc import Callable

from .op import Op, Work, bpe, nelems, precision, shape

__all__ = ["MODELS"]


def _softmax(op: Op, times: int) -> Work:
    n = nelems(shape(op.dims[0]))
    size = bpe(op.type(0))
    return Work(times * 3 * n, None if size is None else times * 2 * n * size, precision(op.type(0)), "vector")


MODELS: dict[str, Callable[[Op], Work]] = {
    "aten::_softmax": lambda op: _softmax(op, 1),
    "aten::_log_softmax": lambda op: _softmax(op, 1),
    "aten::_softmax_backward_data": lambda op: _softmax(op, 2),
    "aten::_log_softmax_backward_data": lambda op: _softmax(op, 2),
}
