"""The Kineto vocabulary: every category, flow, collective and kernel name that the merge and the analysis read.

One place, so that the merge, the analysis and the collective matching read a trace the same way whatever
its Kineto vintage or accelerator:

- categories match case-insensitively: 2021-era Kineto wrote ``Kernel``, ``Memcpy``, ``Memset``, ``Runtime``
  and ``Operator``, and ``async`` for the launch flow that later became ``ac2g``;
- device work is what runs on a device stream: the GPU categories, and any event of a category that is not a
  host category and carries an integer ``args.stream`` (MTIA's ``mtia_ccp_events``), as HTA counts it;
- collective kernels go by every name in use (``ncclKernel_*``, ``ncclDevKernel_*``, RCCL's ``rccl*``) or by
  the ``Collective name`` that newer Kineto copies onto them;
- PyTorch's symmetric-memory collectives (``symm_mem::multimem_all_reduce_``, ``symm_mem::one_shot_all_reduce``,
  ...; not its helpers, ``symm_mem::memset32_``) are collective calls, and their kernels
  (``multimem_all_reduce_kernel``, ``multimem_one_shot_reduce_kernel``, ``one_shot_all_reduce_kernel``, ...) are
  communication, in the breakdown too: HTA 0.5.0 and TraceLens count those kernels as computation.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any, Literal

__all__ = [
    "BLOCKING_CALLS",
    "BLOCKING_COPIES",
    "COLLECTIVE_CALL_PREFIXES",
    "COLLECTIVE_OP_PREFIXES",
    "KERNEL_CATEGORIES",
    "KERNEL_WAIT_NS",
    "LAUNCH_CALLS",
    "QUEUE_CALLS",
    "KnownCategory",
    "KnownPhase",
    "STEP",
    "STREAM_SYNC",
    "STREAM_WAIT",
    "SYNC_CALLS",
    "device_kind",
    "host_category",
    "is_collective_call",
    "is_comm_kernel",
    "is_correlation_flow",
    "is_cpu_op_category",
    "is_graph_launch",
    "is_op_category",
    "kernel_category",
    "kernel_label",
    "kernel_type",
    "on_device",
]

# The Trace Event Format's phases and the categories Kineto writes (its activity types, as its versions spelled
# them, flows, the Trace span). The fast path and the analysis decode ph and cat as these Literals, so that an
# event's ph and cat are the Literal's own string objects (docs/performance.md).
KnownPhase = Literal["B", "E", "X", "i", "I", "C", "b", "n", "e", "S", "T", "p", "F", "s", "t", "f", "P", "N", "O",
                     "D", "M", "V", "v", "R", "c", "(", ")"]
KnownCategory = Literal["cpu_op", "user_annotation", "gpu_user_annotation", "gpu_user_Annotation", "gpu_memcpy",
                        "gpu_memset", "kernel", "external_correlation", "cuda_runtime", "cuda_driver",
                        "cpu_instant_event", "python_function", "overhead", "cuda_sync", "cuda_profiler_range",
                        "glow_runtime", "mtia_runtime", "mtia_ccp_events", "hpu_op", "xpu_runtime", "xpu_driver",
                        "privateuse1_runtime", "privateuse1_driver", "collective_comm", "ac2g", "fwdbwd", "Trace",
                        "gpu_mem", "Operator", "Runtime", "Kernel", "Memcpy", "Memset", "async"]

STEP = re.compile(r"ProfilerStep#(\d+)$")

# Device work by category (lower-cased), as the analysis names its kinds. A stream wait (cuda_sync "Stream Sync",
# "Stream Wait Event") blocks the stream it names, so HTA counts it as GPU activity.
_DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy", "gpu_memset": "memset",
                 "memset": "memset", "cuda_sync": "sync"}
# Categories that live on a device's timeline but are not its work: annotations and counters.
_DEVICE_OTHER = ("gpu_",)
# Host categories: never device work, whatever their args say (Inductor's Triton launcher is a cpu_op with a
# stream; ROCm's runtime calls carry the stream they target).
_HOST = frozenset({"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "operator",
                   "runtime", "cpu_instant_event", "overhead", "external_correlation", "cuda_profiler_range",
                   "glow_runtime", "mtia_runtime", "hpu_op", "xpu_runtime", "xpu_driver", "privateuse1_runtime",
                   "privateuse1_driver", "collective_comm", "trace", "ac2g", "fwdbwd", "async",
                   "async_cpu_to_gpu"})
_OP = frozenset({"cpu_op", "user_annotation", "operator"})
_CPU_OP = frozenset({"cpu_op", "operator"})  # the ops that launch device work (2021's traces: Operator)
_CORRELATION_FLOWS = frozenset({"ac2g", "async", "async_cpu_to_gpu"})

# The names a collective op goes by (``c10d::allreduce_``, ``nccl:all_reduce``); a call is a chain of those and
# ``record_param_comms``.
COLLECTIVE_OP_PREFIXES = ("c10d::", "nccl:", "rccl:", "gloo:", "symm_mem::")
COLLECTIVE_CALL_PREFIXES = (*COLLECTIVE_OP_PREFIXES, "record_param_comms")
# of the ``symm_mem::`` ops, the collectives (``multimem_all_reduce_``, ``one_shot_all_reduce_out``,
# ``multimem_one_shot_reduce_out``, ``reduce_scatter_out``, ``all_to_all_vdev``), not the helpers (``memset32_``,
# ``_async_input_mm``, ``fused_all_gather_matmul``)
_SYMM_MEM_CALL = re.compile(r"symm_mem::(multimem_)?(one_shot_|two_shot_)?(all_reduce|all_gather|reduce_scatter|"
                            r"all_to_all|reduce)")
# symmetric memory's collective kernels (torch/csrc/distributed/c10d/symm_mem): multimem_*, one_shot_*, two_shot_*
_SYMM_MEM_KERNEL = r"(multimem|one_shot|two_shot)_\w*?(all_reduce|all_gather|reduce_scatter|reduce)\w*_kernel"
_COMM_KERNEL = re.compile(r"nccl|rccl|" + _SYMM_MEM_KERNEL, re.IGNORECASE)
_GRAPH_LAUNCH = re.compile(r"^(cuda|hip)GraphLaunch")
# The runtime calls whose device work HTA 0.5.0's launch statistics count (``cuda_kernel_launch_stats``: kernel,
# copy and set launches, MTIA's), and their ROCm counterparts, which it does not count.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync",
                          "runFunction - job_prep_and_submit_for_execution", "hipLaunchKernel",
                          "hipExtModuleLaunchKernel", "hipGraphLaunch", "hipMemcpyAsync", "hipMemsetAsync"})
# The runtime calls that enqueue work on a stream for HTA 0.5.0's queue length
# (``TraceSymbolTable.get_runtime_launch_events_query``), ROCm's included.
QUEUE_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync",
                         "cudaMemsetAsync", "runFunction - job_prep_and_submit_for_execution", "hipLaunchKernel",
                         "hipExtModuleLaunchKernel", "hipMemcpyAsync", "hipMemsetAsync", "hipMemcpyWithStream"})
# Host calls that block until the device has done something: the device work they wait for owns the time they
# block, not the call (the critical path). The synchronisations, CUDA's and ROCm's (HTA 0.5.0's
# ``CPGraph.BLOCKING_SYNC_CALLS`` less ``cudaEventQuery``, which returns at once)...
SYNC_CALLS = frozenset(f"{api}{call}" for api in ("cuda", "hip")
                       for call in ("DeviceSynchronize", "StreamSynchronize", "EventSynchronize"))
# ... and the copies that return once their copy is done: ``cudaMemcpy``, and ``cudaMemcpyAsync`` to pageable memory
# (``aten::item``, ``.cpu()``, ``.tolist()``), which HTA lists as blocking too; ROCm's ``hipMemcpyWithStream`` is
# what ``aten::_local_scalar_dense`` calls there. A copy that returned before its work ended did not block.
BLOCKING_COPIES = frozenset({"cudaMemcpy", "cudaMemcpyAsync", "hipMemcpy", "hipMemcpyAsync", "hipMemcpyWithStream"})
BLOCKING_CALLS = SYNC_CALLS | BLOCKING_COPIES  # a call that blocks the host until device work ends
# Kineto's ``cuda_sync`` events, which PyTorch writes only when its CUDA sync events are turned on: the device side
# of a synchronisation, with the stream it waits on and the correlation of its runtime call.
# "Stream Sync" names the stream its call waits on; "Stream Wait Event" makes a stream wait for another's work.
STREAM_SYNC, STREAM_WAIT = "Stream Sync", "Stream Wait Event"

# The finer kernel categories of the kernel summary; first match wins, names lower-cased.
_CATEGORY_RULES = [
    ("communication", re.compile(r"nccl|rccl|gloo|all_?reduce|all_?gather|reduce_?scatter|alltoall|broadcast")),
    ("memory", re.compile(r"^memcpy|^memset|memcpy|memset|^dma")),
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa|mha_")),
    ("GEMM", re.compile(r"gemm|matmul|cutlass|cublas|xmma|wgmma|nvjet|cijk_|triton_tem|_mm_|^mm_|bmm")),
    ("reduce", re.compile(r"reduce|reduction|softmax|norm|triton_red|triton_per|argmax|argmin|scan|sum_")),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_poi|fill|copy|cat_|index|"
                               r"scatter|gather|where|add|mul|div|sub|relu|gelu|silu|sigmoid|tanh|exp|neg")),
]
KERNEL_CATEGORIES = (*(name for name, _ in _CATEGORY_RULES), "other")  # every value of ``kernel_category``
# HTA 0.5.0's kernel classes (hta/utils/utils.py), by name alone: where parity with HTA's breakdowns needs them.
_HTA_COMM = re.compile(r"^nccl.*Kernel")
_SYMM_MEM_COMM = re.compile(_SYMM_MEM_KERNEL)
_HTA_MEMORY = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
# HTA's consecutive_kernel_delay=30, compared with µs timestamps (its docstring says ns): shorter gaps between
# kernels of a stream are launch overhead.
KERNEL_WAIT_NS = 30_000
_NAMESPACES = re.compile(r"\b(?:at::native::|at::|c10::|std::|\(anonymous namespace\)::)")


@functools.lru_cache(maxsize=1024)
def host_category(cat: Any) -> bool | None:
    """True for a host category, False for a device one, None for one whose events are device work only
    when they carry an integer ``args.stream`` (a category this list does not know, such as MTIA's)."""
    if not isinstance(cat, str):
        return True
    low = cat.lower()
    if low in _DEVICE_KINDS or low.startswith(_DEVICE_OTHER):
        return False
    return True if low in _HOST else None


def _stream(args: Any) -> Any:
    return args.get("stream") if isinstance(args, Mapping) else getattr(args, "stream", None)


def on_device(cat: Any, args: Any = None) -> bool:
    """True for an event that lives on a device's timeline: a GPU category (work or annotation), or an event of
    a category this list does not know that carries an integer ``args.stream`` (MTIA's ``mtia_ccp_events``)."""
    host = host_category(cat)
    return host is False or (host is None and type(_stream(args)) is int)


def device_kind(cat: Any, name: Any = "", args: Any = None) -> str | None:
    """The kind of device work an event is (``kernel``, ``memcpy``, ``memset``, ``sync``), or None.

    A GPU category gives its kind; an event of another non-host category is device work when it carries an
    integer ``args.stream``, and then it is memory when its name starts with ``dma`` (HTA's rule), else a
    kernel. GPU annotations live on a device's timeline but are not its work: None.
    """
    host = host_category(cat)
    if host is None:
        if type(_stream(args)) is not int:
            return None
        return "memcpy" if isinstance(name, str) and name.startswith("dma") else "kernel"
    return None if host else _DEVICE_KINDS.get(cat.lower())


def is_op_category(cat: Any) -> bool:
    """True for the categories of the host ops the call tree reports: CPU ops and user annotations."""
    return isinstance(cat, str) and cat.lower() in _OP


def is_cpu_op_category(cat: Any) -> bool:
    """True for the categories of CPU ops, the ops that launch device work: ``cpu_op``, 2021's ``Operator``."""
    return isinstance(cat, str) and cat.lower() in _CPU_OP


def is_correlation_flow(cat: Any) -> bool:
    """True for the flow categories that link a launch to its device work (``ac2g``; 2021's ``async``)."""
    return isinstance(cat, str) and cat.lower() in _CORRELATION_FLOWS


def is_collective_call(name: str) -> bool:
    """True for the names of the host events that make up a collective call."""
    if name.startswith("symm_mem::"):
        return _SYMM_MEM_CALL.match(name) is not None
    return name.startswith(COLLECTIVE_CALL_PREFIXES)


@functools.lru_cache(maxsize=1 << 14)
def _comm_name(name: str) -> bool:
    """``_COMM_KERNEL`` searched once per kernel name (a rank has thousands of kernels of a few dozen names)."""
    return _COMM_KERNEL.search(name) is not None


def is_comm_kernel(name: str, args: Any = None) -> bool:
    """True for a collective's device work: NCCL and RCCL kernels by any of their names, or device work whose
    args carry ``Collective name`` (a mapping's key, or the ``collective`` field of the analysis's args)."""
    if _comm_name(name):
        return True
    if isinstance(args, Mapping):
        return "Collective name" in args
    return getattr(args, "collective", None) is not None


def is_graph_launch(name: Any) -> bool:
    """True for a CUDA or HIP graph launch: one runtime call whose correlation id all the graph's kernels share."""
    return isinstance(name, str) and _GRAPH_LAUNCH.match(name) is not None


def kernel_type(name: str) -> str:
    """HTA's kernel type of a device event's name: COMMUNICATION, MEMORY, COMPUTATION or OTHER; symmetric memory's
    collective kernels are COMMUNICATION here (HTA makes them COMPUTATION)."""
    if _HTA_COMM.match(name) or _SYMM_MEM_COMM.search(name):
        return "COMMUNICATION"
    if _HTA_MEMORY.match(name):
        return "MEMORY"
    if not _HTA_NOT_COMPUTE.match(name):
        return "COMPUTATION"
    return "OTHER"


def kernel_category(name: str, kind: str) -> str:
    """The finer category of the kernel summary: GEMM, attention, elementwise, reduce, communication, memory, other."""
    if kind in ("memcpy", "memset"):
        return "memory"
    if kind == "sync":
        return "other"
    low = name.lower()
    for category, rule in _CATEGORY_RULES:
        if rule.search(low):
            return category
    return "other"


def kernel_label(name: str, length: int = 120) -> str:
    """A kernel name shortened for reading (the verdict, the page): no ``void``, no namespaces such as
    ``at::native::``, no trailing parameter list, at most ``length`` characters (cut in the middle)."""
    text = _NAMESPACES.sub("", str(name).removeprefix("void "))
    if "<" in text and text.endswith(")"):  # a template's parameter list repeats its arguments
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                text = f"{text[:i]}(…)"
                break
    if len(text) > length:
        half = (length - 1) // 2
        text = f"{text[:half]}…{text[-half:]}"
    return text
