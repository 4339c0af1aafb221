"""Deterministic generator of realistic multi-rank Kineto (PyTorch profiler) traces.

Each rank runs the same training steps: forward layers (python stack, ``aten::*`` ops,
kernel launches with ``ac2g`` flows), backward on the autograd thread (``fwdbwd`` flows), an
NCCL all-reduce whose kernels end together on all ranks, then an optimizer step and ``.item()``.
"""
from __future__ import annotations

import functools
import gzip as _gzip
import os
import random
from typing import Any

import orjson

__all__ = ["make_rank_trace", "write_example"]

_MASK = (1 << 64) - 1
_T0_NS = 4_462_667_600_000_000  # relative start (~4.46e12 us) as in real torch >= 2.4 files; < 2**43 us
_FWD_SLOT, _BWD_SLOT, _PRE, _POST = 40_000, 80_000, 60_000, 40_000
_OPT_BUDGET, _STRAGGLE, _RPC_LAUNCH, _NCCL_LAT = 1_500_000, 5_000_000, 14_000, 6_000
_NELEMS = 26_214_400
_PAIR_BYTES, _STEP_BYTES, _FIXED_BYTES, _MAX_LAYERS = 5_400, 6_000, 11_300, 160

_DEVICE = {"name": "NVIDIA B200", "totalGlobalMem": 191503138816, "computeMajor": 10, "computeMinor": 0,
           "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536,
           "warpSize": 32, "sharedMemPerBlock": 49152, "numSms": 148, "regsPerMultiprocessor": 65536,
           "sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472}
_GEMM = "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN"
_EW = "void at::native::vectorized_elementwise_kernel<4, at::native::{}, std::array<char*, {}ul> >(int, at::native::{})"
_LN = ("void at::native::(anonymous namespace)::{}<float, float>(float const*, float const*, float const*, "
       "float const*, float const*, float*, float*, float*)")


def _shapes(*args: tuple[Any, str, str]) -> dict[str, list[Any]]:
    """``Input Dims``, ``Input type`` and ``Concrete Inputs`` as ``record_shapes`` writes them, one (dims, type,
    concrete) per argument."""
    return {"Input Dims": [a[0] for a in args], "Input type": [a[1] for a in args],
            "Concrete Inputs": [a[2] for a in args]}


_X, _W, _B = ([8, 4096], "float", ""), ([4096, 4096], "float", ""), ([4096], "float", "")
# module, forward frame, op, inner op, kernel, the ops' shapes, backward node, backward op, backward kernel, its shapes
_LAYERS = [
    ("Linear", "torch/nn/modules/linear.py(125): forward", "aten::linear", "aten::addmm", _GEMM,
     (_shapes(_X, _W, _B), _shapes(_B, _X, _W, ([], "Scalar", "1"), ([], "Scalar", "1"))),
     "AddmmBackward0", "aten::mm", _GEMM, _shapes(_X, _W)),
    ("LayerNorm", "torch/nn/modules/normalization.py(217): forward", "aten::layer_norm",
     "aten::native_layer_norm", _LN.format("vectorized_layer_norm_kernel"),
     (_shapes(_X, ([], "ScalarList", "[4096]"), _B, _B, ([], "Scalar", "1e-05"), ([], "Scalar", "True")),
      _shapes(_X, ([], "ScalarList", "[4096]"), _B, _B, ([], "Scalar", "1e-05"))),
     "NativeLayerNormBackward0", "aten::native_layer_norm_backward", _LN.format("layer_norm_grad_input_kernel"),
     _shapes(_X, _X, ([], "ScalarList", "[4096]"), ([8, 1], "float", ""), ([8, 1], "float", ""), _B, _B,
             ([], "ScalarList", "[True, True, True]"))),
    ("GELU", "torch/nn/modules/activation.py(734): forward", "aten::gelu", None,
     _EW.format("GeluCUDAKernelImpl", 2, "GeluCUDAKernelImpl"), (_shapes(_X, ([], "", "none")), None),
     "GeluBackward0", "aten::gelu_backward", _EW.format("GeluBackwardCUDAKernelImpl", 3, "GeluBackwardCUDAKernelImpl"),
     _shapes(_X, _X, ([], "", "none"))),
]
_CHAIN = ("torch/nn/modules/module.py(1762): _wrapped_call_impl", "torch/nn/modules/module.py(1773): _call_impl")
_LEAVES = ["torch/nn/modules/module.py(1940): __getattr__", "torch/_jit_internal.py(1196): is_scripting",
           "torch/nn/modules/module.py(1924): _get_backward_hooks", "<built-in method dim of Tensor object>",
           "torch/utils/_contextlib.py(117): decorate_context", "<built-in method _has_torch_function_unary>"]
_NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
_FOREACH = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, "
            "std::plus<float>, float>(T1, T2, T3, T4)")


def _mix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _shared(seed: int, *keys: int) -> float:
    """A uniform [0, 1) value that every rank can compute for any (step, rank)."""
    h = _mix(seed & _MASK)
    for k in keys:
        h = _mix(h ^ (k & _MASK))
    return h / 2.0**64


def _plan(target_bytes: int, world_size: int) -> tuple[int, int]:
    """(layers per step, steps) whose encoding is about ``target_bytes``; the same on every rank."""
    ranks_len = len(", ".join(map(str, range(world_size)))) + 2
    body, step = target_bytes - _FIXED_BYTES - ranks_len, _STEP_BYTES + 2 * ranks_len
    steps = max(2, -(-body // (_MAX_LAYERS * _PAIR_BYTES + step)))
    return max(1, round((body / steps - step) / _PAIR_BYTES)), steps


def _timing(seed: int, step: int, rank: int, layers: int, straggler: int | None) -> tuple[int, int]:
    """(start jitter, start-to-all-reduce time) of ``rank`` in ``step``."""
    busy = _PRE + int(layers * (_FWD_SLOT + _BWD_SLOT) * (1.0 + 0.03 * _shared(seed, step, rank, 1))) + _POST
    return int(20_000 * _shared(seed, step, rank, 2)), busy + (_STRAGGLE if rank == straggler else 0)


@functools.lru_cache(maxsize=8)
def _last_arrivals(seed: int, steps: int, layers: int, straggler: int | None, world_size: int) -> tuple[int, ...]:
    """Per step, the latest start-to-all-reduce time over all ranks (cached: each rank needs all of it)."""
    return tuple(max(sum(_timing(seed, s, r, layers, straggler)) for r in range(world_size)) for s in range(steps))


def _m(name: str, ts: float, pid: Any, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "ts": ts, "pid": pid, "tid": tid, "args": args}


class _Timeline:
    """Event writer for one rank: CPU ops, Python frames, flows, launches with their GPU work, and metadata.
    Times are integer ns relative to the base, before the clock shift."""

    def __init__(self, rank: int, seed: int, shift: int, straggling: bool) -> None:
        self.rng = random.Random(seed * 1_000_003 + rank)
        self.rank, self.pid, self.dev, self.shift = rank, 10000 + rank * 7, rank % 8, shift
        self.straggling = straggling
        self.tid, self.tid2 = self.pid, self.pid + 3
        self.ev: list[dict[str, Any]] = []
        self.gpu: list[dict[str, Any]] = []
        self.ext = self.ev_idx = self.seq = self.flow_id = self.s7_first = self.s7_end = 0
        self.corr = 1000 + self.rng.randint(0, 999)
        self.py_id = 1_000_000 + self.rng.randint(0, 10_000)

    def us(self, ns: int) -> float:
        return (ns + self.shift) / 1000

    def op(self, cat: str, name: str, t: int, end: int, tid: int, args: dict[str, Any] | None = None) -> int:
        self.ext += 1
        self.ev_idx += 1
        a = {"External id": self.ext, "Record function id": 0, **(args or {}), "Ev Idx": self.ev_idx}
        self.ev.append({"ph": "X", "cat": cat, "name": name, "pid": self.pid, "tid": tid, "ts": self.us(t),
                        "dur": (end - t) / 1000, "args": a})
        return self.ext

    def py(self, name: str, t: int, end: int, parent: int) -> int:
        self.py_id += 1
        self.ev.append({"ph": "X", "cat": "python_function", "name": name, "pid": self.pid, "tid": self.tid,
                        "ts": self.us(t), "dur": (end - t) / 1000,
                        "args": {"Python parent id": parent, "Python id": self.py_id,
                                 "Ev Idx": 30_000_000 + self.py_id}})
        return self.py_id

    def flow(self, ph: str, fid: int, cat: str, pid: int, tid: int, t: int) -> None:
        e = {"ph": ph, "id": fid, "pid": pid, "tid": tid, "ts": self.us(t), "cat": cat, "name": cat}
        if ph == "f":
            e["bp"] = "e"
        (self.gpu if cat == "ac2g" and ph == "f" else self.ev).append(e)

    def launch(self, api: str, ext: int, t: int, end: int, tid: int, cat: str, name: str, dur: int,
               gpu_t: int = 0, stream: int = 7, extra: dict[str, Any] | None = None) -> int:
        """A runtime call at ``t`` and its GPU activity (at ``gpu_t`` or a launch latency of 2-6 µs after the call
        returns, as on an idle A100: never before it); returns its end."""
        self.corr += self.rng.randint(1, 3)
        c = self.corr
        gpu_t = gpu_t or end + 2_000 + self.rng.randint(0, 4_000)
        if stream == 7:
            gpu_t = max(gpu_t, self.s7_end + 1_000)
            self.s7_first, self.s7_end = self.s7_first or gpu_t, gpu_t + dur
        cbid = {"cudaLaunchKernel": 211, "cudaMemcpyAsync": 41, "cudaMemsetAsync": 51}[api]
        self.ev.append({"ph": "X", "cat": "cuda_runtime", "name": api, "pid": self.pid, "tid": tid, "ts": self.us(t),
                        "dur": (end - t) / 1000, "args": {"External id": ext, "cbid": cbid, "correlation": c}})
        self.flow("s", c, "ac2g", self.pid, tid, t)
        a: dict[str, Any] = {"External id": ext}
        if cat == "kernel":
            a.update({"queued": 0, "device": self.dev, "context": 1, "stream": stream, "correlation": c,
                      "registers per thread": 64, "shared memory": 0, "blocks per SM": 0.864865,
                      "warps per SM": 13.837838, "grid": [128, 1, 1], "block": [512, 1, 1],
                      "est. achieved occupancy %": 0})
        else:
            a.update({"device": self.dev, "context": 1, "stream": stream, "correlation": c})
        self.gpu.append({"ph": "X", "cat": cat, "name": name, "pid": self.dev, "tid": stream, "ts": self.us(gpu_t),
                         "dur": dur / 1000, "args": {**a, **(extra or {})}})
        self.flow("f", c, "ac2g", self.dev, stream, gpu_t)
        return gpu_t + dur

    def metadata(self, ts: float) -> list[dict[str, Any]]:
        """The rank's process and thread metadata, as Kineto writes it: 16 GPUs are listed whatever is used."""
        pid = self.pid
        meta = [_m("process_name", ts, pid, 0, {"name": "python"}), _m("process_labels", ts, pid, 0, {"labels": "CPU"}),
                _m("process_sort_index", ts, pid, 0, {"sort_index": pid})]
        for th, label in ((self.tid, "python"), (self.tid2, "pt_autograd_0")):
            meta += [_m("thread_name", ts, pid, th, {"name": f"thread {th} ({label})"}),
                     _m("thread_sort_index", ts, pid, th, {"sort_index": th})]
        for d in range(16):
            meta += [_m("process_name", ts, d, 0, {"name": "python"}),
                     _m("process_labels", ts, d, 0, {"labels": f"GPU {d}"}),
                     _m("process_sort_index", ts, d, 0, {"sort_index": 5_000_000 + d})]
        for st in (7, 20):
            meta += [_m("thread_name", ts, self.dev, st, {"name": f"stream {st} "}),
                     _m("thread_sort_index", ts, self.dev, st, {"sort_index": st})]
        return meta


class _Rank(_Timeline):
    """One rank's training steps, written as its profiler would: inputs, forward layers, backward, all-reduce and
    optimizer, with the straggler's extra work where it straggles."""

    def step(self, n: int, t0: int, arrive: int, coll_end: int, layers: int, comm: dict[str, Any]) -> int:
        """One ``ProfilerStep#n`` from ``t0``; the all-reduce starts at ``arrive``; returns the step's end."""
        self.gpu, self.s7_first = [], 0
        k = (arrive - t0 - _PRE - _POST - (_STRAGGLE if self.straggling else 0)) / (layers * (_FWD_SLOT + _BWD_SLOT))
        fslot, bslot = int(_FWD_SLOT * k), int(_BWD_SLOT * k)
        step_ext = self.op("user_annotation", f"ProfilerStep#{n}", t0, t0, self.tid)
        step_ev = self.ev[-1]
        root = self.py("train.py(57): train_step", t0 + 2_000, t0 + 2_000, 0)
        root_ev = self.ev[-1]
        self._inputs(t0)
        fwd = [self._forward_layer(i, t0 + _PRE + i * fslot, fslot, root) for i in range(layers)]
        self._backward(t0 + _PRE + layers * fslot + 20_000, bslot, fwd, root)
        if self.straggling:
            self.op("user_annotation", "straggler_sleep", arrive - _STRAGGLE - 10_000, arrive - 20_000, self.tid)
        end = self._all_reduce_and_optimizer(arrive, coll_end, comm)
        step_ev["dur"] = (end + 15_000 - t0) / 1000
        root_ev["dur"] = (end + 11_000 - t0) / 1000
        self.gpu.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{n}", "pid": self.dev,
                         "tid": 7, "ts": self.us(self.s7_first - 1), "dur": (self.s7_end - self.s7_first + 2) / 1000,
                         "args": {"External id": step_ext}})
        self.ev.extend(self.gpu)
        return end + 15_000

    def _inputs(self, t0: int) -> None:
        """The step's first ops: zero a buffer and copy the batch to the GPU."""
        e = self.op("cpu_op", "aten::zero_", t0 + 5_000, t0 + 18_000, self.tid,
                    {"Input Dims": [[4096, 4096]], "Input type": ["float"]})
        self.launch("cudaMemsetAsync", e, t0 + 8_000, t0 + 15_000, self.tid, "gpu_memset", "Memset (Device)", 3_104,
                    extra={"bytes": 67108864, "memory bandwidth (GB/s)": 21620.1})
        e = self.op("cpu_op", "aten::copy_", t0 + 22_000, t0 + 50_000, self.tid,
                    {"Input Dims": [[8, 4096], [8, 4096], []], "Input type": ["float", "float", "Scalar"]})
        self.launch("cudaMemcpyAsync", e, t0 + 30_000, t0 + 45_000, self.tid, "gpu_memcpy",
                    "Memcpy HtoD (Pinned -> Device)", 2_080, extra={"bytes": 131072, "memory bandwidth (GB/s)": 63.01})

    def _forward_layer(self, i: int, a: int, fslot: int, root: int) -> tuple[int, tuple[Any, ...], int]:
        """Layer ``i``'s forward op from ``a``: its Python stack, the op, its fwdbwd flow start and its kernel."""
        rng, tid, layer = self.rng, self.tid, _LAYERS[i % 3]
        p = root
        for depth, name in enumerate((*_CHAIN, f"nn.Module: {layer[0]}_{i // 3}", layer[1]), 1):
            p = self.py(name, a + 200 * depth, a + fslot - 200 * depth, p)
        b = a + 1_200
        for _ in range(rng.randint(3, 7)):
            self.py(rng.choice(_LEAVES), b, b + 600 + rng.randint(0, 600), p)
            b += 1_400 + rng.randint(0, 400)
        op_t, op_end = b + 500, a + fslot - 1_500
        self.seq += 1
        self.flow_id += 1
        outer, inner = layer[5]
        fargs = {**outer, "Sequence number": self.seq, "Fwd thread id": 0}
        self.py(f"<built-in method {layer[2][6:]} of type object at 0x7f3c2a8e1f40>", b, a + fslot - 1_000, p)
        e = self.op("cpu_op", layer[2], op_t, op_end, tid, fargs)
        self.flow("s", self.flow_id, "fwdbwd", self.pid, tid, op_t)
        if layer[3]:
            e = self.op("cpu_op", layer[3], op_t + 2_000, op_end - 1_000, tid, {**fargs, **inner})
        lt = op_end - 10_000 - rng.randint(0, 3_000)
        self.launch("cudaLaunchKernel", e, lt, lt + 6_000 + rng.randint(0, 2_000), tid, "kernel", layer[4],
                    int(fslot * (0.2 + 0.25 * rng.random())))
        return self.flow_id, layer, self.seq

    def _backward(self, bw0: int, bslot: int, fwd: list[tuple[int, tuple[Any, ...], int]], root: int) -> None:
        """The backward pass from ``bw0`` on the autograd thread, one op and kernel per forward layer, reversed."""
        rng = self.rng
        p = self.py("torch/_tensor.py(648): backward", bw0 - 10_000, bw0 + len(fwd) * bslot + 5_000, root)
        self.py("torch/autograd/graph.py(829): _engine_run_backward", bw0 - 5_000, bw0 + len(fwd) * bslot + 2_000, p)
        for i, (fid, layer, seq) in enumerate(reversed(fwd)):
            a = bw0 + i * bslot
            bargs = {"Input Dims": [[8, 4096]], "Input type": ["float"], "Sequence number": seq, "Fwd thread id": 1}
            self.op("cpu_op", f"autograd::engine::evaluate_function: {layer[6]}", a + 500, a + bslot - 500,
                    self.tid2, bargs)
            self.flow("f", fid, "fwdbwd", self.pid, self.tid2, a + 500)
            self.op("cpu_op", layer[6], a + 2_000, a + bslot - 3_000, self.tid2, bargs)
            e = self.op("cpu_op", layer[7], a + 4_000, a + bslot - 5_000, self.tid2, {**bargs, **layer[9]})
            lt = a + bslot - 15_000 - rng.randint(0, 4_000)
            self.launch("cudaLaunchKernel", e, lt, lt + 7_000, self.tid2, "kernel", layer[8],
                        int(bslot * (0.25 + 0.2 * rng.random())))

    def _all_reduce_and_optimizer(self, arrive: int, coll_end: int, comm: dict[str, Any]) -> int:
        """The gradient all-reduce from ``arrive``, the optimizer step and the ``.item()`` that ends the step."""
        tid = self.tid
        dims = {"Input Dims": [[_NELEMS]], "Input type": ["float"]}
        e = self.op("cpu_op", "record_param_comms", arrive, arrive + 60_000, tid,
                    {**comm, "Global rank start": 0, "Global rank stride": 1, "Rank": self.rank, **dims})
        self.op("user_annotation", "nccl:all_reduce", arrive + 6_000, arrive + 50_000, tid, dims)
        t = arrive + _RPC_LAUNCH
        self.launch("cudaLaunchKernel", e, t, t + 8_000, tid, "kernel", _NCCL, coll_end - t - _NCCL_LAT,
                    t + _NCCL_LAT, 20, comm)
        self.op("user_annotation", "Optimizer.step#SGD.step", arrive + 70_000, arrive + 130_000, tid)
        e = self.op("cpu_op", "aten::_foreach_add_", arrive + 80_000, arrive + 125_000, tid,
                    {"Input Dims": [[], []], "Input type": ["TensorList", "TensorList"]})
        end = self.launch("cudaLaunchKernel", e, arrive + 95_000, arrive + 110_000, tid, "kernel", _FOREACH,
                          150_000 + self.rng.randint(0, 100_000), coll_end + 2_000)
        # .item() blocks the CPU until the GPU is done, which ends the step on every rank alike.
        e = self.op("cpu_op", "aten::_local_scalar_dense", arrive + 140_000, arrive + 140_000, tid,
                    {"Input Dims": [[]], "Input type": ["float"]})
        item_ev = self.ev[-1]
        end = self.launch("cudaMemcpyAsync", e, arrive + 145_000, end + 6_000, tid, "gpu_memcpy",
                          "Memcpy DtoH (Device -> Pageable)", 1_952, end + 1_000,
                          extra={"bytes": 4, "memory bandwidth (GB/s)": 0.002})
        item_ev["dur"] = (end + 9_000 - arrive - 140_000) / 1000
        return end


def make_rank_trace(rank: int, world_size: int, *, target_bytes: int = 2_000_000, seed: int = 0,
                    base_time_ns: int = 1790857026000000000, clock_shift_ns: int = 0,
                    straggler: int | None = None) -> dict[str, Any]:
    """Build one rank's synthetic Kineto trace of CUDA training steps with an NCCL all-reduce.

    Parameters
    ----------
    rank, world_size
        This rank and the number of ranks (``distributedInfo``).
    target_bytes
        Approximate size of the compact JSON encoding (within a few % above about 100 kB;
        the fixed part is about 35 kB).
    seed
        The same arguments give the same trace; the ranks of one seed share the step timing.
    base_time_ns
        ``baseTimeNanoseconds``; ``ts`` are microseconds relative to it, with 3 decimals.
    clock_shift_ns
        Added to every timestamp of this rank, to simulate clock skew.
    straggler
        A rank that sleeps about 5 ms before each all-reduce, so that the others' NCCL kernels wait.

    Returns
    -------
    dict
        The trace document, keys in Kineto's write order.

    Examples
    --------
    >>> doc = make_rank_trace(1, 4, target_bytes=200_000)
    >>> doc["distributedInfo"]["rank"], doc["traceEvents"][0]["ph"]
    (1, 'M')
    """
    layers, n_steps = _plan(target_bytes, world_size)
    w = _Rank(rank, seed, clock_shift_ns, rank == straggler)
    # as Kineto writes it: the first 30 ranks of a bigger group, then "..." (pg_config lists them all)
    ranks_str = "[" + ", ".join(map(str, range(min(world_size, 30)))) + (", ...]" if world_size > 30 else "]")
    comm = {"Collective name": "allreduce", "In msg nelems": _NELEMS, "Out msg nelems": _NELEMS,
            "Group size": world_size, "dtype": "Float", "In split size": "[]", "Out split size": "[]",
            "Process Group Name": "0", "Process Group Description": "default_pg", "Process Group Ranks": ranks_str}
    g_start = _T0_NS
    trace_start = g_start - 250_000
    w.ev.append({"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "pid": -1, "tid": 0,
                 "ts": w.us(trace_start + 40_000), "dur": 1526.826})
    lasts = _last_arrivals(seed, n_steps, layers, straggler, world_size)
    for s, last in enumerate(lasts):
        jit, busy = _timing(seed, s, rank, layers, straggler)
        coll_end = g_start + last + _RPC_LAUNCH + _NCCL_LAT + 420_000 + int(80_000 * _shared(seed, s, 3))
        end = w.step(10 + s, g_start + jit, g_start + jit + busy, coll_end, layers, comm)
        g_start = coll_end + _OPT_BUDGET
        assert end < g_start, "step overran its time budget"
    start_us = w.us(trace_start)
    tail = [{"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
             "ts": start_us, "dur": (g_start - trace_start) / 1000, "args": {"Op count": 0}},
            _m("process_sort_index", start_us, "Spans", 0, {"sort_index": 536870912}),
            {"ph": "i", "s": "g", "name": "Iteration Start: PyTorch Profiler", "pid": "Traces",
             "tid": "Trace PyTorch Profiler", "ts": start_us},
            {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": w.us(g_start + 5_000)}]
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": i, **_DEVICE} for i in range(8)],
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size, "pg_count": 1,
                            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl",
                                           "pg_size": world_size, "ranks": list(range(world_size))}],
                            "nccl_version": "2.27.5"},
        "record_shapes": 1,
        "with_stack": 1,
        "host_name": f"node{rank // 8}",
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base_time_ns,
        "traceEvents": w.metadata(start_us) + w.ev + tail,
        "traceName": f"rank{rank}.pt.trace.json",
    }


def write_example(out_dir: str, *, ranks: int = 8, rank_bytes: int = 2_000_000, gzip: bool = True,
                  seed: int = 0, straggler: int | None = None) -> list[str]:
    """Write a synthetic multi-rank example as ``rank{r}.pt.trace.json[.gz]`` files.

    Parameters
    ----------
    out_dir
        Folder to write into; created if missing.
    ranks
        World size; one file per rank.
    rank_bytes
        Approximate uncompressed size of each file.
    gzip
        Compress, deterministically (mtime 0, level 6).
    seed
        Seed of :func:`make_rank_trace`.
    straggler
        A rank that arrives about 5 ms late at every all-reduce.

    Returns
    -------
    list of str
        The paths, in rank order.

    Examples
    --------
    >>> write_example("/tmp/example", ranks=2, rank_bytes=100_000)  # doctest: +SKIP
    ['/tmp/example/rank0.pt.trace.json.gz', '/tmp/example/rank1.pt.trace.json.gz']
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for r in range(ranks):
        data = orjson.dumps(make_rank_trace(r, ranks, target_bytes=rank_bytes, seed=seed, straggler=straggler))
        path = os.path.join(out_dir, f"rank{r}.pt.trace.json" + (".gz" if gzip else ""))
        with open(path, "wb") as f:
            f.write(_gzip.compress(data, compresslevel=6, mtime=0) if gzip else data)
        paths.append(path)
    return paths
