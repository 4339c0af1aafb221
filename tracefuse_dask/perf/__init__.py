"""Op performance models: an op call's FLOPs and bytes from its recorded shapes (``Input Dims``, ``Input type``,
``Concrete Inputs``, traces taken with ``record_shapes=True``), by TraceLens's rules, and the devices' peaks
(``devices``) for a roofline.

One module per family (``gemm``, ``attention``, ``conv``, ``norm``, ``softmax``, ``elementwise``, ``reduce``),
each a ``MODELS`` dict from op name to model (``norm.RMS_MODELS``: the fused RMS norms of aiter and vLLM, category
``RMSNorm`` as TraceLens's extensions give it), Inductor's Triton kernels by name pattern (``triton``) and vLLM's
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

__all__ = ["Op", "Work", "backward_category", "backward_work", "category", "has_backward", "has_model",
           "needs_context", "work"]

_FAMILIES = ((gemm.MODELS, "GEMM", "GEMM"), (attention.MODELS, "SDPA_fwd", "SDPA_bwd"), (vllm.MODELS, "SDPA_fwd", ""),
             (conv.MODELS, "CONV_fwd", "CONV_bwd"), (norm.MODELS, "NORM_fwd", "NORM_bwd"),
             (norm.RMS_MODELS, "RMSNorm", ""), (softmax.MODELS, "softmax_fwd", "softmax_bwd"),
             (elementwise.MODELS, "elementwise", "elementwise"), (reduce.MODELS, "reduce", "reduce"))
_MODELS = {name: (bwd if "backward" in name.lower() or name.endswith("_bwd") else fwd, model)
           for models, fwd, bwd in _FAMILIES for name, model in models.items()}
# the forward ops whose model has a backward (TraceLens's ``bwd_category`` and ``flops_bwd``), by category
_BACKWARD = {name: (cat, model) for models, cat in ((attention.BACKWARD, "SDPA_bwd"), (conv.BACKWARD, "CONV_bwd"))
             for name, model in models.items()}
# ops TraceLens puts in a category without a model (``CATEGORY_ONLY_OP_MAPPING``)
_CATEGORY_ONLY = {
    "aten::miopen_convolution": "CONV_fwd", "aten::cudnn_convolution": "CONV_fwd",
    "FlashAttnFuncBackward": "SDPA_bwd", "FusedAttnFuncBackward": "SDPA_bwd",
    "aten::_efficient_attention_forward": "SDPA_fwd", "aten::_efficient_attention_backward": "SDPA_bwd",
    "MambaSplitConv1dScanCombinedFnBackward": "SSM_bwd", "DaoAILab::_causal_conv1d_bwd_cpp": "SSM_bwd",
    "TokenPermuteMaskMap": "MoE_comm_fwd", "_OperationFuserAutogradFunction": "MoE_comm_fwd",
    **dict.fromkeys(("MoEDispatchBackward", "MoECombineBackward", "TokenPermuteMaskMapBackward",
                     "_OperationFuserAutogradFunctionBackward"), "MoE_comm_bwd"),
    "FusedRoPEFuncBackward": "RoPE_bwd", "CrossEntropyFunctionBackward": "CrossEntropy_bwd",
    **dict.fromkeys(("aiter::moe_sorting_opus_fwd", "aiter::moe_align_block_size", "_moe_C::moe_align_block_size",
                     "aiter::moe_sum", "aiter::topk_softmax", "aiter::topk_softmax_asm", "aiter::topk_sigmoid",
                     "aiter::grouped_topk", "aiter::moe_fused_gate"), "MoE_aux"),
    **dict.fromkeys(("_C_cache_ops::reshape_and_cache_flash", "_C_cache_ops::concat_and_cache_mla",
                     "aiter::get_mla_metadata_v1", "aiter::indexer_score_topk"), "InferenceAttention"),
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


def has_backward(forward: str) -> bool:
    """True for the forward ops whose model also gives their backward (attention, convolution), for a backward op
    that the trace links to its forward (TraceLens's autograd link) and that has no model of its own."""
    return forward in _BACKWARD


def backward_category(forward: str) -> str:
    """The category of the backward of ``forward`` (``has_backward``): ``SDPA_bwd`` or ``CONV_bwd``."""
    return _BACKWARD[forward][0]


@functools.lru_cache(maxsize=1 << 12)
def backward_work(forward: str, dims: str, types: str, concrete: str) -> Work | None:
    """The work of the backward of one call of the forward op ``forward`` (``has_backward``) whose args are given,
    as for ``work``; None when they do not fit its model."""
    return _call(_BACKWARD[forward][1], forward, dims, types, concrete)


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
    return None if entry is None else _call(entry[1], name, dims, types, concrete, context)


def _call(model: Callable[[Op], Work], name: str, dims: str, types: str, concrete: str, context: str = ""
          ) -> Work | None:
    try:
        return model(Op(name, *(orjson.loads(t) if t else [] for t in (dims, types, concrete)), context=context))
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, orjson.JSONDecodeError):
        return None
