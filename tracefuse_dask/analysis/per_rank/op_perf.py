"""How good each op's time is: the ``op_perf`` table of a rank, one row per op group (name, input dims, input
types, concrete inputs), with the kernel time its calls launched, the kernel they spent most of it in, the FLOPs
and bytes of a call (``tracefuse_dask.perf``) and where that puts it against the device's roofline.

The ops are those TraceLens's unified perf report takes (``collect_unified_perf_events``): for each kernel, the
outermost op above it that a model covers (``aten::_scaled_dot_product_flash_attention``, not the
``aten::_flash_attention_forward`` inside it), else the leaf op that launched it (those of ``kernel_launchers``).
A call's kernel time is the busy time (the union) of its kernels, as TraceLens measures it. Collective calls
(``record_param_comms``, ``nccl:*``, ``symm_mem::*``) are left out, as TraceLens leaves them out by default.

A backward op without a model of its own (CPU's ``aten::_scaled_dot_product_flash_attention_for_cpu_backward``
under ``ScaledDotProductFlashAttentionForCpuBackward0``) is modelled through its forward op where the trace links them
(``backward_links``, TraceLens's autograd link): its row has its own name, the forward op's input columns, the
forward op's name as its ``context``, and the backward of the forward op's model (``perf.backward_work``).
"""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from ...kineto.vocabulary import is_collective_call
from ...perf import (
    backward_category,
    backward_work,
    category,
    has_backward,
    has_model,
    work,
)
from ...perf.devices import Device
from ..schema import OP_PERF_COLUMNS
from .model import RankModel

__all__ = ["backward_links", "op_perf_table", "owners"]

_KERNEL_US = OP_PERF_COLUMNS.index("kernel_us")

_EVALUATE = "autograd::engine::evaluate_function: "


def backward_links(model: RankModel, is_cpu_op: np.ndarray, leaf: np.ndarray) -> dict[int, int]:
    """TraceLens's autograd link (``link_all_fwd_bwd_events``, ``_get_linked_fwd_event``): per tree position of a
    backward op that its forward op's model covers, that forward op's event.

    The backward op is the one CPU op under ``autograd::engine::evaluate_function: <name>`` that is named ``<name>``
    and launched kernels (``leaf``: each kernel's leaf op position). Its forward op is, of the events with the same
    ``Sequence number`` that start before the backward, the latest one whose model has a backward
    (``perf.has_backward``). Two choices differ from TraceLens, which takes the latest event of that number on
    another thread and links only when that event has a model: the ops inside a forward op can carry its number
    (``aten::_scaled_dot_product_flash_attention_for_cpu`` in ``aten::scaled_dot_product_attention``), and on a CPU
    device the backward runs on the forward's thread. Autograd counts sequence numbers per forward thread: with two
    forward threads one number can name two forward ops, and the latest before the backward is taken (a backward
    event's ``Fwd thread id`` is not a thread id the forward events carry). Traces without autograd, or without
    such a forward op, cost nothing."""
    names, code, tree = model.names, model.name_code, model.tree
    evaluate = [c for c, nm in enumerate(names) if str(nm).startswith(_EVALUATE)]
    forward = [c for c, nm in enumerate(names) if has_backward(str(nm))]
    if not evaluate or not forward:
        return {}
    start = model.start.tolist()
    forwards: dict[Any, list[tuple[int, int]]] = defaultdict(list)  # (start, event) by sequence number
    for i in np.flatnonzero(np.isin(code, forward)).tolist():
        if model.args[i].sequence is not None:
            forwards[model.args[i].sequence].append((start[i], i))
    for candidates in forwards.values():
        candidates.sort()
    under = np.cumsum(np.bincount(leaf[leaf >= 0] + 1, minlength=len(tree.order) + 1))  # kernels before a position
    links: dict[int, int] = {}
    for bwd in np.flatnonzero(np.isin(code, evaluate)).tolist():
        candidates, p = forwards.get(model.args[bwd].sequence, []), int(tree.pos[bwd])
        k = bisect_left(candidates, (start[bwd], -1))  # the candidates that start before the backward
        if not k or p < 0:
            continue
        main = str(names[code[bwd]])[len(_EVALUATE):]
        ops = [q for q in range(p + 1, int(tree.stop[p])) if under[tree.stop[q]] > under[q]
               and is_cpu_op[tree.order[q]] and str(names[code[tree.order[q]]]) == main]
        if len(ops) == 1:
            links[ops[0]] = candidates[k - 1][1]
    return links


def owners(leaf: np.ndarray, parent: list[int], modelled: np.ndarray, stop: np.ndarray,
           links: Mapping[int, int], own_backward: np.ndarray) -> np.ndarray:
    """Per kernel, the tree position of the op it counts for: the outermost ancestor of its leaf op (itself
    included) that is ``modelled``, else the leaf (-1 stays -1).

    A backward op of ``links`` then owns the kernels below it that no modelled op owns, unless an op below it has a
    backward model of its own (``own_backward``: ``aten::_scaled_dot_product_flash_attention_backward`` under
    ``ScaledDotProductFlashAttentionBackward0``). TraceLens links no op with a modelled op anywhere below it (a
    modelled ``aten::copy_`` in the backward of CPU's attention is enough), and then gives every op below it the
    forward's whole backward; here the copy keeps its own row and the backward op the rest."""
    memo: dict[int, int] = {}
    out = leaf.copy()
    for k, p in enumerate(leaf.tolist()):
        if p < 0:
            continue
        owner = memo.get(p)
        if owner is None:
            owner, q = p, p
            while q >= 0:
                if modelled[q]:
                    owner = q
                q = parent[q]
            memo[p] = owner
        out[k] = owner
    by_leaf = np.argsort(leaf, kind="stable")
    sorted_leaf = leaf[by_leaf]
    for p in sorted(links):  # outer first: a backward op inside another's keeps its own kernels
        inside = by_leaf[np.searchsorted(sorted_leaf, p):np.searchsorted(sorted_leaf, stop[p])]
        if not own_backward[out[inside]].any():
            inside = inside[~modelled[out[inside]]]
            out[inside] = p
    return out


def _busy_ns(leaf: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per leaf op call: its position, the union of its kernels' [start, end) in ns, and its first kernel.

    Sorted by call and start, a kernel adds what it runs past the latest end of the call's earlier kernels: a
    running maximum per call, one pass over all kernels (each call's ends are lifted by its number times the
    span, so that one maximum never carries into the next call)."""
    order = np.lexsort((start, leaf))
    p, s, e = leaf[order], start[order], end[order]
    new = np.r_[True, p[1:] != p[:-1]]
    call = np.cumsum(new) - 1
    lo = int(s.min())
    span = int(e.max()) - lo + 1
    if span * (int(call[-1]) + 1) < 2**62:
        lift = call * span
        latest = np.maximum.accumulate(e - lo + lift) - lift + lo
        before = np.where(new, s, np.r_[lo, latest[:-1]])
        added = np.maximum(e - np.maximum(s, before), 0)
    else:  # too long a span for that many calls in int64: one call at a time
        added = np.concatenate([_added(s[a:b], e[a:b]) for a, b in zip(*_bounds(new))])
    firsts = np.flatnonzero(new)
    return p[firsts], np.add.reduceat(added, firsts), order[firsts]


def _bounds(new: np.ndarray) -> tuple[list[int], list[int]]:
    firsts = np.flatnonzero(new).tolist()
    return firsts, firsts[1:] + [len(new)]


def _added(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    latest = np.maximum.accumulate(e)
    before = np.r_[s[0], latest[:-1]]
    return np.maximum(e - np.maximum(s, before), 0)


def op_perf_table(leaf: np.ndarray, start: np.ndarray, end: np.ndarray, kernel_names: list[str],
                  keys_of: Callable[[np.ndarray], list[tuple[str, str, str, str, str]]],
                  device: Device | None) -> pd.DataFrame:
    """The rank's op groups.

    Parameters
    ----------
    leaf
        Per launched kernel (memcpy, memset), the tree position of the op it counts for (-1: none).
    start, end
        The kernels' times (ns).
    kernel_names
        The kernels' names.
    keys_of
        Tree positions' (name, input dims, input types, concrete inputs, context): the args as compact JSON text,
        and the annotation around the op that its model reads (``perf.needs_context``), else "".
    device
        The rank's device, for the roofline; None leaves those columns empty.
    """
    has = leaf >= 0
    if not has.any():
        return pd.DataFrame([], columns=OP_PERF_COLUMNS)
    calls, busy, first = _busy_ns(leaf[has], start[has], end[has])
    names = np.asarray(kernel_names, dtype=object)[has]
    keys = keys_of(calls)
    code, distinct = pd.factorize(pd.Series(keys, dtype=object))
    n = len(distinct)
    counts = np.bincount(code, minlength=n)
    total = np.bincount(code, weights=busy, minlength=n)
    firsts = np.unique(code, return_index=True)[1]  # each group's first call, in position order
    main = _main_kernels(code[np.searchsorted(calls, leaf[has])], names, (end - start)[has], n)
    rows = [(*distinct[g], int(counts[g]), int(round(total[g])), main[g], names[first[k]])
            for g, k in zip(range(n), firsts) if not is_collective_call(distinct[g][0])]  # the links measure those
    # the most kernel time first, then by name
    table = sorted((_row(*r, device) for r in rows), key=lambda row: (-row[_KERNEL_US], row[0]))
    return pd.DataFrame(table, columns=OP_PERF_COLUMNS)


def _main_kernels(group: np.ndarray, names: np.ndarray, dur: np.ndarray, n: int) -> list[Any]:
    """Per group, the name of the kernel its calls spent the most time in (of equal times, the first name): what
    ``tracefuse diff`` follows when a kernel is renamed between two runs."""
    code, distinct = pd.factorize(names, sort=True)
    key = group * len(distinct) + code
    order = np.argsort(key, kind="stable")
    firsts = np.flatnonzero(np.concatenate([[True], key[order][1:] != key[order][:-1]]))
    ns = np.add.reduceat(dur[order], firsts)  # per (group, name)
    key = key[order][firsts]
    of, name = key // len(distinct), key % len(distinct)
    best = np.lexsort((name, -ns, of))
    best = best[np.concatenate([[True], of[best][1:] != of[best][:-1]])]
    main: list[Any] = [float("nan")] * n
    for g, k in zip(of[best].tolist(), name[best].tolist()):
        main[g] = distinct[k]
    return main


def _row(name: str, dims: str, types: str, concrete: str, context: str, n: int, busy_ns: int, main_kernel: str,
         first_kernel: str, device: Device | None) -> list[Any]:
    nan = float("nan")
    if context and not has_model(name) and has_backward(context):  # a backward op through its forward op
        w, cat = backward_work(context, dims, types, concrete), backward_category(context)
    else:
        w, cat = work(name, dims, types, concrete, context), category(name, first_kernel)
    row: list[Any] = [name, cat, dims, types, concrete, context, n, busy_ns / 1e3, main_kernel]
    if w is None:
        return row + [nan] * 5 + [None, None, nan, nan, nan, nan, False, None]
    total_ns = busy_ns or nan
    fpb = w.flops / w.bytes if w.bytes else nan
    tflops = w.flops * n / total_ns / 1e3
    tb_s = w.bytes * n / total_ns / 1e3 if w.bytes is not None else nan
    roof_of = device.roof(w.unit, w.precision) if device is not None else None
    name_of_roof, peak = roof_of if roof_of else (None, None)
    bw = device.memory_tb_s if device is not None else nan
    roof, pct, bound = nan, nan, None
    if peak and w.bytes and w.flops > 0:  # a pure copy has no roofline (TraceLens's rule: GFLOPs > 0)
        roof = min(peak, fpb * bw)  # the roof at the op's intensity
        pct = 100.0 * tflops / roof
        bound = "compute" if fpb * bw >= peak else "memory"
    return row + [w.flops / 1e9, w.bytes / 2**20 if w.bytes is not None else nan, fpb, tflops, tb_s, w.precision,
                  name_of_roof, peak if peak else nan, bw, roof, pct, bool(pct > 100), bound]


