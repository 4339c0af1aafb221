"""Inductor's Triton kernels as the trace records their launches (``triton_poi_*``, ``triton_red_*``,
``triton_per_*`` with ``Input Dims``, ``Input type`` and ``Concrete Inputs``, PyTorch 2.4+), as TraceLens's
``TritonCompiledPerfModel`` reads them from the trace alone (its "V2"; its fallback reads Inductor's cache
directory, which a trace does not carry).

The element count is the last integer concrete input (``xnumel``), times the one before for a reduction
(``rnumel``); FLOPs per element are those of the fused ops the kernel's name lists, as far as they are single
words TraceLens counts (``add``, ``mul``, ``silu``, ...). Bytes: every tensor argument once, plus one more write of
the first for a pointwise kernel (its output reuses an input buffer). Element sizes are read for the types as a
trace records them (``float``, ``long int``, ``c10::BFloat16``); TraceLens knows only the ``c10::`` spellings, so it
counts 0 bytes for fp32 and integer tensors.
"""
from __future__ import annotations

import re
from math import prod

from .op import Op, Work, bpe, precision

__all__ = ["PATTERN", "triton"]

PATTERN = re.compile(r"^triton_(poi|red|per)_")
_FUSED = re.compile(r"triton_(?:poi|red|per)_fused_(.+)_(\d+)$")
_FLOPS_PER_ELEM = {"add": 1, "sub": 1, "mul": 1, "div": 1, "pow": 2, "sqrt": 2, "rsqrt": 2, "exp": 4, "log": 4,
                   "sigmoid": 4, "tanh": 4, "relu": 1, "silu": 4, "gelu": 8, "mean": 1, "sum": 1, "var": 2, "abs": 1,
                   "neg": 1, "reciprocal": 2, "ne": 1, "eq": 1, "lt": 1, "gt": 1}
_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "c10::Float": 4, "c10::Double": 8, "c10::Byte": 1, "c10::Char": 1,
          "c10::Int": 4, "c10::Long": 8}
_PRECISION = {"c10::BFloat16": "c10::bfloat16", "c10::Half": "c10::half", "c10::Float": "float",
              "c10::Double": "double"}


def triton(op: Op) -> Work:
    ints = []
    for i in range(len(op.concrete)):
        try:
            ints.append(int(op.scalar(i)))
        except ValueError:
            continue
    reduction = not op.name.startswith("triton_poi_")
    if reduction and len(ints) >= 2:
        elems = ints[-2] * ints[-1]
    elif ints:
        elems, reduction = ints[-1], False
    else:
        raise ValueError("no element count among the concrete inputs")
    m = _FUSED.match(op.name)
    flops = elems * sum(_FLOPS_PER_ELEM.get(t, 0) for t in (m.group(1).split("_") if m else []))
    sizes, shapes, dtype = [], [], None
    for dims, t in zip(op.dims, op.types):
        if t == "Scalar" or not dims:
            continue
        size = _BYTES.get(t) or bpe(t) or 0
        sizes.append(size)
        shapes.append(dims)
        if dtype is None and size:
            dtype = t
    moved = float(sum(prod(s) * b for s, b in zip(shapes, sizes)))
    if op.name.startswith("triton_poi_") and sizes:
        moved += sizes[0] * ints[-1]
    return Work(flops, moved, precision(_PRECISION.get(dtype, dtype)), "vector")
