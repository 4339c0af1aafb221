"""Reductions (TraceLens ``Reduce``): ``aten::sum``, ``mean``, ``max``, ``min``, norms, ``std``, ``var``,
``logsumexp``, ``cumsum``, ``cumprod``, ``amin``, ``amax``.

One FLOP per input element; bytes the input and the output at the input's element size. The output's size comes
from the ``dim`` and ``keepdim`` concrete inputs, read at the op's own positions (a cumulative op keeps the
input's). TraceLens reads those only
when they are not text, and a trace records them as text, so it always counts one output element: for a
reduction over the last dimension of a large tensor the two differ by one part in the reduced length.
"""
from __future__ import annotations

import json
from collections.abc import Callable

from .op import Op, Work, bpe, nelems, precision, shape

__all__ = ["MODELS"]

OPS = ("aten::sum", "aten::mean", "aten::max", "aten::min", "aten::norm", "aten::linalg_norm", "aten::std",
       "aten::var", "aten::logsumexp", "aten::cumsum", "aten::cumprod", "aten::amin", "aten::amax")


_DIM_AT = {"aten::norm": 2, "aten::linalg_norm": 2}  # after p / ord; every other op's dim is its 2nd argument
_INT_DIM = ("aten::max", "aten::min")  # a single int dim (their other overloads take a list or none)


def _dims_keepdim(op: Op) -> tuple[list[int] | None, bool]:
    """The ``dim`` (a list of ints; an int only where the op takes one, as ``max``'s; else None: all of them)
    and ``keepdim`` (the first ``True``/``False`` after it)."""
    at = _DIM_AT.get(op.name, 1)
    try:
        value = json.loads(op.scalar(at)) if op.scalar(at).strip() else None
    except ValueError:
        value = None
    if isinstance(value, list) and value and all(type(d) is int for d in value):
        dims: list[int] | None = value
    elif type(value) is int and op.name in _INT_DIM:
        dims = [value]
    else:
        return None, False
    for i in range(at + 1, len(op.concrete)):
        if op.scalar(i).strip() in ("True", "False"):
            return dims, op.scalar(i).strip() == "True"
    return dims, False


def reduction(op: Op) -> Work:
    dims_in = shape(op.dims[0])
    n_in = nelems(dims_in)
    if "cumsum" in op.name or "cumprod" in op.name:
        n_out = n_in
    else:
        dims, keepdim = _dims_keepdim(op)
        if not dims:
            n_out = 1
        else:
            axes = {d % len(dims_in) for d in dims} if dims_in else set()
            n_out = nelems(tuple(1 if k in axes else s for k, s in enumerate(dims_in)) if keepdim
                           else tuple(s for k, s in enumerate(dims_in) if k not in axes))
    size = bpe(op.type(0))
    return Work(n_in, None if size is None else (n_in + n_out) * size, precision(op.type(0)), "vector")


MODELS: dict[str, Callable[[Op], Work]] = dict.fromkeys(OPS, reduction)
