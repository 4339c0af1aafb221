"""GEMMs: ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm`` and the vendor ops that take the same
arguments (TraceLens ``PerfModel/perf_model.py`` ``GEMM`` and its subclasses).

FLOPs ``2·M·N·K`` (plus ``M·N`` for a bias), times the batch; bytes ``(M·K + K·N + M·N) · bpe`` plus ``N · bpe``
for a bias (TraceLens takes a bias as one row), every operand at the element size of A, except ``_scaled_mm``'s fp8
output (2 bytes).
"""
from __future__ import annotations

from collections.abc import Callable

from .op import Op, Work, bpe, precision, shape

__all__ = ["MODELS"]


def _gemm(b: int, m: int, n: int, k: int, bias: bool, dtype: str | None, out_bpe: int | None = None) -> Work:
    size = bpe(dtype)
    out = size if out_bpe is None else out_bpe
    flops = b * (2 * m * n * k + (m * n if bias else 0))
    if size is None or out is None:
        return Work(flops, None, precision(dtype), "matrix")
    moved = b * ((m * k + k * n) * size + m * n * out + (n * size if bias else 0))
    return Work(flops, moved, precision(dtype), "matrix")


def mm(op: Op) -> Work:
    (m, k), (_, n) = shape(op.dims[0]), shape(op.dims[1])
    return _gemm(1, m, n, k, False, op.type(0))


def addmm(op: Op) -> Work:
    (m, k), (_, n) = shape(op.dims[1]), shape(op.dims[2])
    return _gemm(1, m, n, k, True, op.type(1))


def bmm(op: Op) -> Work:
    (b, m, k), (_, _, n) = shape(op.dims[0]), shape(op.dims[1])
    return _gemm(b, m, n, k, False, op.type(0))


def baddbmm(op: Op) -> Work:
    (b, m, k), (_, _, n) = shape(op.dims[1]), shape(op.dims[2])
    return _gemm(b, m, n, k, True, op.type(1))


def linear_gemm(op: Op) -> Work:
    """A GEMM that takes ``F.linear``'s arguments, ``(x[M, K], weight[N, K], bias[N])``: vLLM's ROCm
    ``rocm_unquantized_gemm`` (TraceLens's extension ``vllm_rocm_unquantized_gemm``)."""
    (m, k), (n, _) = shape(op.dims[0]), shape(op.dims[1])
    return _gemm(1, m, n, k, len(op.dims) > 2 and bool(op.dims[2]), op.type(0))


def scaled_mm(op: Op) -> Work:
    (m, k), (_, n) = shape(op.dims[0]), shape(op.dims[1])
    size = bpe(op.type(0))
    return _gemm(1, m, n, k, len(op.dims) == 3, op.type(0), 2 if size == 1 else size)


MODELS: dict[str, Callable[[Op], Work]] = {
    "aten::mm": mm,
    "aten::addmm": addmm,
    "aten::bmm": bmm,
    "aten::baddbmm": baddbmm,
    "aten::_scaled_mm": scaled_mm,
    "trtllm::cublas_scaled_mm": scaled_mm,
    "bitsandbytes::int8_linear_matmul": scaled_mm,
    "vllm::rocm_unquantized_gemm": linear_gemm,
}
