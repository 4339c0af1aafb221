"""Convolutions, forward and backward, of 1 to 3 spatial dimensions, transposed too (TraceLens ``CONV``,
``aten_conv``, ``aten_conv_bwd``).

Forward FLOPs ``2·prod(w[1:])`` per output element (per input element when transposed), plus one per output
element for a bias; bytes the input, the weight, the bias and the output at the input's element size. Backward:
the input gradient and the weight gradient, each a convolution of its own, and the bias gradient.

Two differences from TraceLens, which takes a bias only when ``Input Dims`` has exactly three entries (a trace
records all nine arguments, so never): here the bias counts when its shape is not empty; and the bias gradient's
elements count as bytes at the element size (TraceLens adds them to the bytes as elements).
"""
from __future__ import annotations

from collections.abc import Callable
from math import prod

from .op import Op, Work, bpe, precision, shape

__all__ = ["BACKWARD", "MODELS"]


def _tuple(text: str, n: int, default: int) -> tuple[int, ...]:
    if not text.strip():
        return (default,) * n
    values = tuple(int(v) for v in text.strip("[]() ").split(",") if v.strip())
    return values * n if len(values) == 1 else values


def _out_shape(x: tuple[int, ...], w: tuple[int, ...], stride: tuple[int, ...], pad: tuple[int, ...],
               dil: tuple[int, ...], transposed: bool, out_pad: tuple[int, ...]) -> tuple[int, ...]:
    if transposed:
        spatial = [(x[i + 2] - 1) * stride[i] - 2 * pad[i] + dil[i] * (w[i + 2] - 1) + out_pad[i] + 1
                   for i in range(len(x) - 2)]
        return (x[0], w[1], *spatial)
    spatial = [int((x[i + 2] + 2 * pad[i] - dil[i] * (w[i + 2] - 1) - 1) / stride[i] + 1) for i in range(len(x) - 2)]
    return (x[0], w[0], *spatial)


def _flops(x: tuple[int, ...], w: tuple[int, ...], out: tuple[int, ...], bias: bool, transposed: bool) -> int:
    return (prod(x) if transposed else prod(out)) * 2 * prod(w[1:]) + (prod(out) if bias else 0)


def _t(s: tuple[int, ...]) -> tuple[int, ...]:
    return (s[1], s[0], *s[2:])


def _conv(op: Op, first: int, backward: bool) -> Work:
    x, w = shape(op.dims[first]), shape(op.dims[first + 1])
    if not 3 <= len(x) <= 5:
        raise ValueError(f"a convolution of {len(x) - 2} spatial dimensions")
    n = len(x) - 2
    at = first + 2  # the concrete inputs after the bias: stride, padding, dilation, transposed, output_padding
    if len(op.concrete) <= at + 5:  # a trace without them (before 2022) does not say the stride: no model
        raise ValueError("the convolution's stride, padding and dilation are not in the trace")
    bias = bool(op.dims[first + 2]) if len(op.dims) > first + 2 else False
    stride, pad, dil = _tuple(op.scalar(at + 1), n, 1), _tuple(op.scalar(at + 2), n, 0), _tuple(op.scalar(at + 3), n, 1)
    transposed = op.scalar(at + 4).strip() == "True"
    out = _out_shape(x, w, stride, pad, dil, transposed, _tuple(op.scalar(at + 5), n, 0))
    size = bpe(op.type(first))
    if not backward:
        flops = _flops(x, w, out, bias, transposed)
        elems = prod(x) + prod(w) + (out[1] if bias else 0) + prod(out)
    else:
        weight_grad = (_flops(_t(x), _t(out), _t(w), False, False) if not transposed
                       else _flops(_t(out), _t(x), _t(w), False, False))
        flops = _flops(out, w, x, False, not transposed) + weight_grad + (prod(out) if bias else 0)
        elems = (prod(out) + prod(w) + prod(x)) * 2 + (prod(out) + out[1] if bias else 0)
    return Work(flops, None if size is None else elems * size, precision(op.type(first)), "matrix")


MODELS: dict[str, Callable[[Op], Work]] = {
    # input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    "aten::convolution": lambda op: _conv(op, 0, False),
    "aten::_convolution": lambda op: _conv(op, 0, False),
    # grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask
    "aten::convolution_backward": lambda op: _conv(op, 1, True),
}
# A forward convolution's backward from its own args, for a backward op without a model of its own
BACKWARD: dict[str, Callable[[Op], Work]] = {"aten::convolution": lambda op: _conv(op, 0, True),
                                             "aten::_convolution": lambda op: _conv(op, 0, True)}
