"""An op call as the perf models read it (its recorded shapes, types and scalar inputs) and what a model gives
(``Work``): FLOPs and bytes moved per call, the precision and the unit (matrix or vector) that runs it.

The element sizes and precisions follow TraceLens (``PerfModel/utils.py``: ``name2bpe``, ``torch_dtype_map``).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

__all__ = ["Op", "Work", "bpe", "broadcast", "nelems", "precision", "shape"]

_BPE = {**dict.fromkeys(("double", "long int"), 8), **dict.fromkeys(("float", "scalar", "int"), 4),
        **dict.fromkeys(("c10::half", "c10::bfloat16"), 2),
        **dict.fromkeys(("c10::float8_e4m3fnuz", "c10::float8_e4m3fn", "c10::float8_e5m2", "c10::float8_e8m0fnu",
                         "unsigned char", "signed char", "fp8", "c10::float4_e2m1fn_x2", "fp4"), 1)}
_PRECISION = {"float": "fp32", "double": "fp64", "c10::half": "fp16", "c10::bfloat16": "bf16",
              "c10::float8_e4m3fnuz": "fp8", "c10::float8_e4m3fn": "fp8", "c10::float8_e5m2": "fp8",
              "unsigned char": "fp8", "fp8": "fp8", "fp4": "fp4", "mxfp4": "fp4", "c10::float4_e2m1fn_x2": "fp4"}


@dataclass(frozen=True)
class Op:
    """One op call's ``Input Dims``, ``Input type`` and ``Concrete Inputs``, as parsed from the trace, and the
    context some models need (``vllm``)."""

    name: str
    dims: list[Any]
    types: list[Any]
    concrete: list[Any]
    context: str = ""  # an annotation around the op that its model reads (vLLM's batch), else ""

    def type(self, i: int) -> str | None:
        t = self.types[i] if i < len(self.types) else None
        return t if isinstance(t, str) else None

    def scalar(self, i: int) -> str:
        """The i-th concrete input as its text ("" when absent)."""
        v = self.concrete[i] if i < len(self.concrete) else ""
        return v if isinstance(v, str) else ""


@dataclass(frozen=True)
class Work:
    """What an op call does: FLOPs, bytes moved (None when a type has no known size), the compute precision
    (``fp32``, ``bf16``, ...; None when unknown) and the unit that runs it (``matrix`` or ``vector``)."""

    flops: float
    bytes: float | None
    precision: str | None
    unit: str


def bpe(dtype: str | None) -> int | None:
    """Bytes per element of a recorded type (``c10::BFloat16``: 2), None when unknown."""
    return _BPE.get(dtype.lower()) if isinstance(dtype, str) else None


def precision(dtype: str | None) -> str | None:
    """The precision a recorded type computes in (``c10::BFloat16``: ``bf16``), None when unknown."""
    return _PRECISION.get(dtype.lower()) if isinstance(dtype, str) else None


def shape(value: Any) -> tuple[int, ...]:
    """A recorded shape as a tuple of ints; ValueError when it is not one."""
    if not isinstance(value, list) or not all(type(d) is int for d in value):
        raise ValueError(f"not a shape: {value!r}")
    return tuple(value)


def nelems(dims: tuple[int, ...]) -> int:
    return prod(dims)


def broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy's broadcast of two shapes; ValueError when they do not broadcast."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            raise ValueError(f"shapes {a} and {b} do not broadcast")
        out.append(max(x, y))
    return tuple(out)
