"""Op performance models: an op call's FLOPs and bytes from its recorded shapes (``Input Dims``, ``Input type``,
``Concrete Inputs``, traces taken with ``record_shapes=True``), by TraceLens's rules, and the devices' peaks
(``devices``) for a roofline.

One module per family (``gemm``, ``attention``, ``conv``, ``norm``, ``softmax``, ``elementwise``, ``reduce``),
each a ``MODELS`` dict from op name to model, Inductor's Triton kernels by name pattern (``triton``) and vLLM's
attention with its batch annotation (``vllm``); ``work`` looks an op up. An op without a model still gets a
category (``category``), as TraceLens gives one.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable

import orjson

from . import attention, conv, elementwise, gemm, norm, reduce, softmax, triton, vllm
from .op import Op, Work

__all__ = ["Op", "Work", "category", "has_model", "needs_context", "work"]

_FAMILIES = ((gemm.MODELS, "GEMM", "GEMM"), (attention.MODELS, "SDPA_fwd", "SDPA_bwd"), (vllm.MODELS, "SDPA_fwd", ""),
             (conv.MODELS, "CONV_fwd", "CONV_bwd"), (norm.MODELS, "NORM_fwd", "NORM_bwd"),
             (softmax.MODELS, "softmax_fwd", "softmax_bwd"), (elementwise.MODELS, "elementwise", "elementwise"),
             (reduce.MODELS, "reduce", "reduce"))
_MODELS = {name: (bwd if "backward" in name.lower() else fwd, model)
           for models, fwd, bwd in _FAMILIES for name, model in models.items()}
# ops TraceLens puts in a category without a model (``CATEGORY_ONLY_OP_MAPPING``, the core ones)
_CATEGORY_ONLY = {
    "aten::miopen_convolution": "CONV_fwd", "aten::cudnn_convolution": "CONV_fwd",
    "FlashAttnFuncBackward": "SDPA_bwd", "FusedAttnFuncBackward": "SDPA_bwd",
    "aten::_efficient_attention_forward": "SDPA_fwd", "aten::_efficient_attention_backward": "SDPA_bwd",
}
_PATTERNS = ((re.compile(r"^triton"), "triton"), (re.compile(r"^record_param_comms"), "record_param_comms"))
_KERNEL_FALLBACK = (("elementwise", "elementwise"), ("reduce", "reduce"), ("multi_tensor_apply", "multi_tensor_apply"))


def category(name: str, first_kernel: str = "") -> str:
    """An op's category: its model's (``GEMM``, ``SDPA_fwd``, ...), TraceLens's for ops it names without a model,
    ``triton`` or ``record_param_comms`` by name, ``elementwise``, ``reduce`` or ``multi_tensor_apply`` by the
    name of its first kernel when that is one of ATen's own, else ``other``."""
    if name in _MODELS:
        return _MODELS[name][0]
    if name in _CATEGORY_ONLY:
        return _CATEGORY_ONLY[name]
    for pattern, cat in _PATTERNS:
        if pattern.match(name):
            return cat
    if first_kernel.startswith("void at::native"):
        for needle, cat in _KERNEL_FALLBACK:
            if needle in first_kernel:
                return cat
    return "other"


def _model(name: str) -> tuple[str, Callable[[Op], Work]] | None:
    if name in _MODELS:
        return _MODELS[name]
    return ("triton", triton.triton) if triton.PATTERN.match(name) else None


def has_model(name: str) -> bool:
    """True for the ops a model covers."""
    return _model(name) is not None


def needs_context(name: str) -> bool:
    """True for the ops whose model reads an annotation around them (``Op.context``): vLLM's attention."""
    return name in vllm.MODELS


@functools.lru_cache(maxsize=1 << 14)
def work(name: str, dims: str, types: str, concrete: str, context: str = "") -> Work | None:
    """The work of one call of the op ``name`` whose args are the given compact JSON texts (``""`` when absent)
    and whose context (``needs_context``) is ``context``, or None when no model covers it or its args do not fit
    the model (a shape it does not take)."""
    entry = _model(name)
    if entry is None:
        return None
    try:
        op = Op(name, *(orjson.loads(t) if t else [] for t in (dims, types, concrete)), context=context)
        return entry[1](op)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, orjson.JSONDecodeError):
        return None
