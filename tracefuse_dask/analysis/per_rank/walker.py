"""A rank's critical-path walks: the map side of the cross-rank critical path (``cross_rank.critical_path``).
Pure functions, no IO, no Dask.

In each rank's task (``rank_pieces``), the rank's dependency graph is walked backwards from a set of anchors,
always to the predecessor that finished last:

- program order on each CPU thread (a parent's end waits for its last child, a child's start for the previous
  sibling's end, a first child's for its parent's start);
- launch -> kernel or memcpy (``args.correlation`` or the ``ac2g`` flow; a CUDA/HIP graph launch -> each of its
  kernels), and the order of each GPU stream;
- a blocking call (``vocabulary.SYNC_CALLS`` and ``BLOCKING_COPIES``, by name) does not own the time it blocks:
  its end leads to the device work it waited for (the latest to end while it blocked among the work queued before
  it, on the stream its ``Stream Sync`` event names if it has one; a copy: its copy), and only its time after that
  work ended is its own (``sync overhead``); a kernel after a ``Stream Wait Event`` on its stream waits for the
  work of the other streams queued before it that ended before it, as HolisticTraceAnalysis models them;
- a root of a thread other than the steps' that starts after its previous root ended was set going by the steps'
  thread (``_Walker._woken``).

The anchors are each ``ProfilerStep#N``'s end, or the end of the device work launched in it when that ends later,
and each collective call's arrival (its first NCCL/RCCL kernel's start; for a CPU collective such as gloo, the
start of its call). A walk stops at the step's start (a call's: the earliest step whose span holds the call's
issue, as any of them may reach it; ``stitch`` cuts each step's path at its start) or where it
meets a collective: the end of a collective kernel, or, for a CPU collective, the wait after its call. Each walk
gives a chain of segments; only those go to the reduce, segments shorter than a thousandth of its walk joined
under the op they ran in (``_short_runs``: ``aten::linear (host dispatch)``, ``aten::mm (kernels)``), so that a
walk sends as many as the ops it runs through, not its events, as codes
into the rank's texts (``RankTables.texts``), which the reduce decodes for the walks it takes only. On a
thread, a walk runs along the thread's Euler tour from one choice (a blocking call, a CPU collective, a root of
another thread than the steps') to the next without deciding each step.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import cached_property
from itertools import chain, compress
from typing import Any

import numpy as np
import orjson
import pandas as pd

from ...kineto.vocabulary import (
    BLOCKING_CALLS,
    BLOCKING_COPIES,
    STEP,
    STREAM_SYNC,
    STREAM_WAIT,
    is_comm_kernel,
    is_cpu_op_category,
    kernel_category,
)
from ..schema import ANCHOR_COLUMNS, CATEGORIES, KINDS, LABELS, NO_EVENT, SEGMENT_COLUMNS, WORK_COLUMNS, WORK_KINDS
from .model import GpuWork, RankModel, before_in_group, first_seen, sorted_codes

__all__ = ["rank_pieces"]

_KIND = {k: i for i, k in enumerate(KINDS)}
_QUEUED_NS = 50_000  # a kernel that starts this long after both its launch and the work before it on its stream
_HANDOFF_NS = 20_000  # and this soon after work on another stream ends was waiting for that work
_SHORT_PER_WALK = 1000  # segments shorter than a walk's length over this are joined in runs (``_short_runs``)
_DEVICE_KINDS = ("kernel", "memcpy")  # a device event's segment kind, by whether it is a memcpy or memset


class _Walker:
    """One rank's graph, walked backwards. Times are the rank's relative ns; positions are the call tree's."""

    def __init__(self, model: RankModel) -> None:
        start, end, name_code, names, cat_code, cats, tree, g, launch_pos = (
            model.start, model.end, model.name_code, model.names, model.cat_code, model.cats, model.tree, model.gpu,
            model.launch_pos)
        # Per-event values the walks read one at a time are memoryviews of the arrays: a walk reads a few of
        # them, and a view gives Python ints at once where a list would make one per event first.
        order, parent, thread = tree.order, tree.parent, tree.thread
        self.thread = memoryview(np.asarray(thread, dtype=np.int64))
        self.main: tuple[int, Sequence[int], Sequence[int]] | None = None  # ``follow_steps``
        self.starts, ends = start[order], end[order]  # per position
        self.hs = memoryview(self.starts)
        self.he = memoryview(ends)
        self.hn_code = name_code[order]
        self.hn = names[self.hn_code].tolist()
        self.hc_code, self.cats = cat_code[order], cats
        self.parent = parent
        up = np.asarray(parent, dtype=np.int64)
        self._family(up, np.asarray(thread, dtype=np.int64), ends - self.starts)
        self._device(g, launch_pos)
        self.times = {"ce": self.he, "cs": self.hs, "ge": self.ge, "gs": self.gs}
        self.gpu_call: dict[int, int] = {}  # comm kernel -> collective call index
        self.cpu_call: dict[int, int] = {}  # position of a CPU collective's call -> call index
        # the rank's texts: what the pieces' names, categories, pids and tids are codes into (``code``,
        # ``RankTables.texts``); its event names first, so that a name's code is its ``name_code``
        self.texts: list[str] = names.tolist()
        self.text_code = {n: i for i, n in enumerate(self.texts)}
        self._tour(np.asarray(tree.stop), thread, up, ends)
        self.last_special: Sequence[int] = []

    def _family(self, up: np.ndarray, thread: np.ndarray, dur: np.ndarray) -> None:
        """Each position's previous sibling (a root's: the previous root of its thread), last child and own time
        (its time less its children's); ``up``: each position's parent (-1: a root)."""
        m = len(up)
        child = np.flatnonzero(up >= 0)
        key = np.where(up >= 0, up, -2 - thread)
        by_key = np.argsort(key, kind="stable")
        same = key[by_key][1:] == key[by_key][:-1]
        prev = np.full(m, -1, dtype=np.int64)
        prev[by_key[1:][same]] = by_key[:-1][same]
        self.prev_pos, self.prev = prev, memoryview(prev)
        last_child = np.full(m, -1, dtype=np.int64)
        np.maximum.at(last_child, up[child], child)
        self.last_child = memoryview(last_child)
        children = np.zeros(m, dtype=np.int64)
        np.add.at(children, up[child], dur[child])
        self.own = dur - children

    def _device(self, g: GpuWork, launch_pos: np.ndarray) -> None:
        """The device side: each event's kernel category, when its launch began, the work before it on its
        stream, the work by end, and the Stream Wait Event and Stream Sync marks (``g.kind == "sync"``)."""
        self.work = work = np.flatnonzero(g.kind != "sync")
        self.gs, self.ge = memoryview(g.start), memoryview(g.end)
        self.g = g
        self.gn = g.name.tolist()
        is_copy = np.isin(g.kind, ("memcpy", "memset"))
        self.is_copy = memoryview(is_copy)
        # each device event's kernel category, as a code into CATEGORIES, computed once per (name, kind)
        key, first = np.unique(np.asarray(g.code, dtype=np.int64) * 2 + is_copy, return_index=True)
        codes = np.array([CATEGORIES.index(kernel_category(self.gn[j], _DEVICE_KINDS[int(is_copy[j])])) for j in first],
                         dtype=np.int64)
        self.category = codes[np.searchsorted(key, np.asarray(g.code, dtype=np.int64) * 2 + is_copy)]
        self.stream = g.stream
        self.launch_pos = launch_pos
        self.launch = memoryview(launch_pos)  # the launching call's position, -1 when none is known
        # when its launch started; work of no known launch was queued before the trace's host side began
        queued = np.full(len(launch_pos), np.iinfo(np.int64).min)
        queued[launch_pos >= 0] = self.starts[launch_pos[launch_pos >= 0]]
        self.queued = memoryview(queued)
        by_start = work[np.lexsort((g.end[work], g.start[work]))]
        stream = g.stream_code
        by_stream = by_start[np.argsort(stream[by_start], kind="stable")]
        same = stream[by_stream][1:] == stream[by_stream][:-1]
        prev_on_stream = np.full(len(self.gs), -1, dtype=np.int64)
        prev_on_stream[by_stream[1:][same]] = by_stream[:-1][same]
        self.prev_on_stream = memoryview(prev_on_stream)
        # device work by end, to find what a blocking call or a stream wait waited for
        by_end = work[np.lexsort((work, g.end[work]))]
        self.by_end, self.ends = memoryview(by_end), memoryview(g.end[by_end])
        self.waits: dict[Any, list[int]] = defaultdict(list)  # Stream Wait Event ends per stream
        self.sync_stream: dict[int, Any] = {}  # a blocking call's position -> the stream its Stream Sync names
        for j in np.flatnonzero(g.kind == "sync").tolist():
            if self.gn[j] == STREAM_WAIT:
                self.waits[self.stream[j]].append(self.ge[j])
            elif self.gn[j] == STREAM_SYNC and launch_pos[j] >= 0:
                self.sync_stream[int(launch_pos[j])] = self.stream[j]
        for v in self.waits.values():
            v.sort()

    def _tour(self, stop: np.ndarray, thread: Any, up: np.ndarray, ends: np.ndarray) -> None:
        """Each thread's states in time order (its Euler tour: a position's start, its subtree, its end), so that
        a walk runs back along a thread without deciding each step (``index``, ``walk``). A position's end
        comes just before the start its subtree stops at, the deeper ends first."""
        m = len(up)
        pos = np.arange(m)
        keys = np.concatenate([2 * pos, 2 * stop - 1])
        # ends at one place are of nested positions: the deeper, later one first
        by = np.lexsort((np.concatenate([np.zeros(m, dtype=np.int64), -pos]), keys))
        self.tour_ce = is_ce = by >= m
        self.tour_k = tk = np.where(is_ce, by - m, by)
        self.first = ~is_ce & np.isin(tk, [0, *(np.flatnonzero(thread[1:] != thread[:-1]) + 1).tolist()])
        idx = np.arange(len(by))
        at_ce, at_cs = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
        at_ce[tk[is_ce]], at_cs[tk[~is_ce]] = idx[is_ce], idx[~is_ce]
        self.at = {"ce": memoryview(at_ce), "cs": memoryview(at_cs)}
        self.tour_is_end = memoryview(is_ce)
        self.tour_x = memoryview(tk)
        self.tour_t = np.where(is_ce, ends[tk], self.starts[tk])
        # the time from state i-1 to state i is a position's own time (its end, or its child's start: its
        # parent's), or the thread's idle time between roots
        src = np.where(is_ce, tk, up[tk])
        self.own_kind = np.where(src >= 0, _KIND["cpu_op"], _KIND["idle"])
        self.own_name = np.where(src >= 0, self.hn_code[src], self.code("CPU idle"))
        self.own_src = np.where(src >= 0, src, NO_EVENT)

    def index(self) -> None:
        """Mark the states where a walk has a choice to make (``_step``), once the collective calls and the steps'
        thread are known: a blocking call's or a CPU collective's end, the start after a CPU collective, a thread's
        first state, a root's start on another thread than the steps'."""
        calls = np.array(sorted(self.cpu_call), dtype=np.int64)
        blocking = np.array([n in BLOCKING_CALLS for n in self.texts], dtype=bool)[self.hn_code]
        is_ce, tk = self.tour_ce, self.tour_k
        special = self.first | np.where(is_ce, np.isin(tk, calls) | blocking[tk], np.isin(self.prev_pos[tk], calls))
        if self.main is not None:  # a root of another thread than the steps': it may have been woken (``_woken``)
            special |= ~is_ce & (np.asarray(self.parent)[tk] < 0) & (np.asarray(self.thread)[tk] != self.main[0])
        last = np.maximum.accumulate(np.where(special, np.arange(len(tk)), -1))
        self.last_special = memoryview(last)
        # run_min[i]: the earliest time among states last_special[i] .. i-1, what a walk along the thread from i
        # reaches (times along a thread's tour mostly grow; overlapping siblings make them dip)
        t = pd.Series(self.tour_t).groupby(last).cummin().to_numpy()
        self.run_min = memoryview(np.concatenate([np.array([np.iinfo(np.int64).max]), t[:-1]]))

    @cached_property
    def _by_launch(self) -> tuple[Sequence[int], Sequence[int]]:
        """The device work by the position of its launch (stable), and those positions."""
        by = np.argsort(self.launch_pos, kind="stable")
        return memoryview(by), memoryview(self.launch_pos[by])

    def launched_by(self, k: int) -> Sequence[int]:
        """The device work the host position ``k`` launched, in order."""
        by, at = self._by_launch
        return by[bisect_left(at, k):bisect_right(at, k)]

    def _waited_for(self, k: int) -> int:
        """The device work a blocking call at position ``k`` waited for: the latest to end while it blocked,
        among the work queued before it (launched before it, or before the trace), on the stream its ``Stream
        Sync`` event names if it has one (a copy: the work it launched); -1 when none."""
        s, e = self.hs[k], self.he[k]
        if self.hn[k] in BLOCKING_COPIES:
            mine = [j for j in self.launched_by(k) if s < self.ge[j] <= e]
            return max(mine, key=lambda j: self.ge[j], default=-1)
        stream = self.sync_stream.get(k)
        i = bisect_right(self.ends, e) - 1
        while i >= 0 and self.ends[i] > s:
            j = self.by_end[i]
            if self.queued[j] < s and (stream is None or self.stream[j] == stream):
                return j
            i -= 1
        return -1

    def follow_steps(self, pos: int) -> None:
        """Make the thread of the step at position ``pos`` the one a walk goes on to from a root of another thread
        that began after its thread's previous root ended (``_woken``)."""
        thread = np.asarray(self.thread)
        on = np.flatnonzero(thread[self.tour_k] == thread[pos])
        on = on[np.lexsort((on, self.tour_t[on]))]
        self.main = (int(thread[pos]), memoryview(on), memoryview(self.tour_t[on]))

    def _woken(self, x: int, t: int) -> tuple[int, tuple[Any, ...]] | None:
        """The steps' thread's latest state by ``t``, its time and the piece to it, for the start of root ``x`` of
        another thread (the autograd engine's backward thread, a launcher's), which began when the steps' thread
        set it going, if its own previous root ended before that: the piece is the steps' thread's own time then
        (what it ran, or ``CPU idle`` between its roots); None on the steps' own thread, or without steps."""
        if self.main is None or self.thread[x] == self.main[0]:
            return None
        i = bisect_right(self.main[2], t) - 1
        if i < 0:
            return None
        k = self.main[1][i]
        state = "ce" if self.tour_is_end[k] else "cs", self.tour_x[k]
        nxt = k + 1  # the thread's own time from state k on is the next state's
        if nxt < len(self.tour_k) and self.thread[self.tour_k[nxt]] == self.main[0]:
            src = int(self.own_src[nxt])
            return self.main[2][i], (KINDS[self.own_kind[nxt]], self.texts[self.own_name[nxt]],
                                     None if src == NO_EVENT else src, *state)
        return self.main[2][i], ("idle", "CPU idle", None, *state)

    def last_of(self, state: tuple[str, int], start: int | None, end: int | None) -> tuple[str, int]:
        """``state`` (a host event's end), or the end of the device work launched in ``[start, end)`` (any, when
        None) that ends last, when it ends later."""
        by, at = self._by_queued
        mine = by if start is None else by[np.searchsorted(at, start):np.searchsorted(at, end)]
        if not len(mine):
            return state
        j = int(mine[np.argmax(np.asarray(self.ge)[mine])])
        return ("ge", j) if self.ge[j] > self._time(*state) else state

    @cached_property
    def _by_queued(self) -> tuple[np.ndarray, np.ndarray]:
        """The device work by when it was queued (stable), and those times."""
        queued = np.asarray(self.queued)[self.work]
        by = np.argsort(queued, kind="stable")
        return self.work[by], queued[by]

    def _other_stream(self, j: int, after: int) -> int:
        """Work on another stream that ended last in ``(after, start of j]``, for a kernel behind a stream wait: work
        queued before ``j`` was (what ``j`` waits for was recorded before ``j``'s launch)."""
        i = bisect_right(self.ends, self.gs[j]) - 1
        known = self.launch[j] >= 0
        while i >= 0 and self.ends[i] > after:
            q = self.by_end[i]
            if self.stream[q] != self.stream[j] and (not known or self.queued[q] < self.queued[j]):
                return q
            i -= 1
        return -1

    def walk(self, state: tuple[str, int], floor: float) -> tuple[list[Any], tuple[str, int | None, int]]:
        """The walk from ``state`` back to ``floor`` or a collective, latest first, as pieces, and the stop:
        ``("start", None, t)`` or ``("call", call index, t)``.

        A piece is a segment ``[kind, name, source, start, end]`` (codes into ``KINDS`` and ``texts``; a
        source is the event it is time of: a host position ``k``, device work ``j`` as ``-1 - j``, or ``NO_EVENT``),
        or a run along a thread's tour ``(i, s, t)``: the own times of its states ``i`` down to ``s + 1``, from
        ``t`` back (``_segments``)."""
        pieces: list[Any] = []
        where, x = state
        times, step, at, last_special, run_min = self.times, self._step, self.at, self.last_special, self.run_min
        t = times[where][x]
        for _ in range(4 * (len(self.hs) + len(self.gs)) + 4):
            if where in at and last_special[i := at[where][x]] != i:  # along the thread to its next choice
                s = last_special[i]
                if min(t, run_min[i]) <= floor:  # the walk ends in this run, at the last state k reached after it
                    k = s + 1 + int(np.flatnonzero(self.tour_t[s:i] <= floor)[-1])
                    if k < i:
                        pieces.append((i, k, t))
                        t = min(t, int(self.tour_t[k:i].min()))
                    pieces.append([int(self.own_kind[k]), int(self.own_name[k]), int(self.own_src[k]), floor, t])
                    return pieces, ("start", None, floor)
                pieces.append((i, s, t))
                t = min(t, run_min[i])
                where, x = "ce" if self.tour_is_end[s] else "cs", self.tour_x[s]
            nxt = step(where, x, t)
            if nxt is None:
                return pieces, ("start", None, t)
            if nxt[0] == "call":
                return pieces, ("call", nxt[1], t)
            kind, name, src, where, x = nxt
            t0 = min(times[where][x], t)
            pieces.append([_KIND[kind], self.code(name), NO_EVENT if src is None else src, max(t0, floor), t])
            if t0 <= floor:
                return pieces, ("start", None, floor)
            t = t0
        raise RuntimeError("critical path walk did not end")  # a cycle: only with corrupt nesting

    @cached_property
    def _is_step(self) -> np.ndarray:
        """Per position, whether it is a ``ProfilerStep#N``."""
        return np.array([STEP.match(n) is not None for n in self.texts], dtype=bool)[self.hn_code]

    @cached_property
    def _top_op(self) -> np.ndarray:
        """Per position, the outermost op (``cpu_op``) among itself and its ancestors, -1 when none: the doubling of
        each position's ancestor, ``log2(depth)`` passes over the tree."""
        # not the step: 2021's profiler wrote ProfilerStep#N as an Operator, around every op of the step
        is_op = np.array([is_cpu_op_category(c) for c in self.cats], dtype=bool)[self.hc_code] & ~self._is_step
        top = np.where(is_op, np.arange(len(is_op)), -1)
        up = np.asarray(self.parent, dtype=np.int64)
        while (up >= 0).any():
            has = up >= 0
            above = np.where(has, top[np.where(has, up, 0)], -1)
            top = np.where(above >= 0, above, top)
            up = np.where(has, up[np.where(has, up, 0)], -1)
        return top

    def labels(self, kind: np.ndarray, name: np.ndarray, src: np.ndarray) -> np.ndarray:
        """Per segment, the code of what its time counts for when it is joined with others (``_short_runs``): the
        outermost op it ran in, for host time (``aten::linear (host dispatch)``; outside any op, the annotation it
        ran in, ``Optimizer.step#SGD.step (host)``, or ``ProfilerStep#6 (host, outside ops)``) and
        launch gaps, or that launched it, for device work (``aten::mm (kernels)``); its own name for the rest (idle
        time, a sync wait, a collective's transfer, device work of no known launch)."""
        out = name.copy()
        host = np.isin(kind, [_KIND["cpu_op"], _KIND["launch gap"]]) & (src >= 0)
        device = np.isin(kind, [_KIND[k] for k in _DEVICE_KINDS]) & (src < 0) & (src != NO_EVENT)
        at = np.full(len(src), -1, dtype=np.int64)
        at[host] = src[host]
        at[device] = self.launch_pos[-1 - src[device]]
        has = at >= 0
        if not has.any():
            return out
        kind, at = kind[has], at[has]
        top = self._top_op[at]
        op = np.where(top >= 0, top, at)
        suffix = np.select([kind == _KIND["launch gap"], kind == _KIND["kernel"], kind == _KIND["memcpy"], top >= 0,
                            self._is_step[op]], [0, 1, 2, 3, 4], 5)  # into LABELS
        n = len(LABELS)  # (name, suffix) pairs as one key, numbered in key order
        pairs, inverse = sorted_codes(self.hn_code[op].astype(np.int64) * n + suffix)
        out[has] = self.codes([f"{self.texts[k // n]}{LABELS[k % n]}" for k in pairs.tolist()])[inverse]
        return out

    def code(self, text: str) -> int:
        """``text``'s code in ``texts``, added when new."""
        code = self.text_code.get(text)
        if code is None:
            code = self.text_code[text] = len(self.texts)
            self.texts.append(text)
        return code

    def codes(self, texts: Sequence[str]) -> np.ndarray:
        """The codes of ``texts`` (``code``), as an array."""
        return np.array([self.code(t) for t in texts], dtype=np.int64)

    def _time(self, where: str, x: int) -> int:
        return self.times[where][x]

    def _step(self, where: str, x: int, t: int) -> tuple[Any, ...] | None:
        if where == "ce":
            if x in self.cpu_call:
                return "call", self.cpu_call[x]
            name = self.hn[x]
            c = self.last_child[x]
            if name in BLOCKING_CALLS:
                j = self._waited_for(x)
                if j >= 0 and self.ge[j] >= (self.he[c] if c >= 0 else self.hs[x]):
                    return "sync overhead", name, x, "ge", j
            return ("cpu_op", name, x, "ce", c) if c >= 0 else ("cpu_op", name, x, "cs", x)
        if where == "cs":
            ps, p = self.prev[x], self.parent[x]
            if ps >= 0 and ps in self.cpu_call:
                return "call", self.cpu_call[ps]
            if p >= 0:
                return ("cpu_op", self.hn[p], p, "ce", ps) if ps >= 0 else ("cpu_op", self.hn[p], p, "cs", p)
            woken = self._woken(x, t)  # a root: after the thread's previous root, or when another thread woke it
            if ps >= 0 and (woken is None or woken[0] <= self.he[ps]):
                return "idle", "CPU idle", None, "ce", ps
            return woken[1] if woken else None
        if where == "ge":
            if x in self.gpu_call:
                return "call", self.gpu_call[x]
            return _DEVICE_KINDS[self.is_copy[x]], self.gn[x], -1 - x, "gs", x
        # "gs": the latest of the previous work on the stream, a stream wait's work, the launch
        best: tuple[int, int, tuple[Any, ...]] | None = None
        p = self.prev_on_stream[x]
        if p >= 0:
            best = (min(self.ge[p], t), 2, ("idle", "GPU idle", None, "ge", p))
        after = self.ge[p] if p >= 0 else -1
        lp = self.launch[x]
        launched = self.hs[lp] if lp >= 0 else None
        w = self.waits.get(self.stream[x])
        waited = bool(w and bisect_right(w, t) > bisect_right(w, after))
        # Without a Stream Wait Event in the trace, a kernel queued well before it ran, right after work on
        # another stream ended, waited for that work (an event recorded there).
        held = max(after, launched if launched is not None else -1)
        if waited or (launched is not None and t - held > _QUEUED_NS):
            q = self._other_stream(x, held if not waited else after)
            if q >= 0 and (waited or t - self.ge[q] <= _HANDOFF_NS) and (
                    best is None or (min(self.ge[q], t), 1) > best[:2]):
                best = (min(self.ge[q], t), 1, ("sync wait", STREAM_WAIT, None, "ge", q))
        if launched is not None and (best is None or (min(launched, t), 0) > best[:2]):
            if t - max(self.he[lp], after) > _QUEUED_NS:  # long after its launch returned, its stream free: the
                # device held it (a dependency the trace does not show); the launch call's own time comes before
                best = (min(self.he[lp], t), 0, ("idle", "GPU idle", None, "ce", lp))
            else:
                best = (min(launched, t), 0, ("launch gap", self.gn[x], lp, "cs", lp))
        return best[2] if best else None


def rank_pieces(model: RankModel, calls: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, list[str]]:
    """One rank's walks from its anchors, and the work between its collectives (map task).

    ``calls``: the rank's collective calls (``collectives.rank_collectives``, absolute ns).

    Returns
    -------
    anchors, segments, work, texts
        ``ANCHOR_COLUMNS``, ``SEGMENT_COLUMNS`` and ``WORK_COLUMNS`` (absolute ns, but a segment's ``event_ns``),
        and the texts their codes stand for.
    """
    w = _Walker(model)
    tree, g, step_spans, step_pos, base = model.tree, model.gpu, model.steps, model.step_event, model.base
    start, cats, pids, tids = model.start, model.cats, model.pid, model.tid
    arrivals: dict[int, tuple[str, int]] = {}
    # the calls' columns as lists (None where a call has no value), read once: a frame's column costs ~0.1 ms
    index, cpu_start, cpu_end, gpu_start, gpu_end, stream = (
        calls[c].to_numpy(dtype=object, na_value=None).tolist()
        for c in ("index", "cpu_start_ns", "cpu_end_ns", "gpu_start_ns", "gpu_end_ns", "stream"))
    if any(s is not None for s in gpu_start):
        spans: dict[Any, list[tuple[int, int, int]]] = defaultdict(list)
        for c, s, e, st in zip(index, gpu_start, gpu_end, stream):
            if s is not None:
                spans[int(st)].append((int(s) - base, int(e) - base, int(c)))
        for j in compress(range(len(w.gs)), map(spans.__contains__, w.stream)):  # work on a call's stream
            if not is_comm_kernel(w.gn[j], g.args[j]):
                continue
            for s, e, c in spans[w.stream[j]]:
                if s <= w.gs[j] <= e:
                    w.gpu_call[j] = c
                    if c not in arrivals or w.gs[j] < w.gs[arrivals[c][1]]:
                        arrivals[c] = ("gs", j)
                    break
    if any(s is None for s in gpu_start):
        at = {(s, e): k for k, (s, e) in enumerate(zip(w.hs, w.he))}
        for c, s, e in compress(zip(index, cpu_start, cpu_end), (s is None for s in gpu_start)):
            k = at.get((int(s) - base, int(e) - base))
            if k is not None:
                w.cpu_call[k] = int(c)
                arrivals[int(c)] = ("cs", k)
    if step_spans:
        w.follow_steps(int(tree.pos[step_pos[step_spans[0][0]]]))
    w.index()
    # a step ends when the last of its work does: its own event, or the device work launched in it that ends later
    ends = [w.last_of(("ce", int(tree.pos[step_pos[n]])), s, e) for n, s, e in step_spans]
    starts = [s for _, s, _ in step_spans]
    issued = {int(c): int(t) - base for c, t in zip(index, cpu_start) if t is not None}

    def issue(c: int) -> int:
        """When call ``c`` was issued on the host (its arrival when the trace has no host call)."""
        return issued.get(c, w._time(*arrivals[c]))

    def floor_of(c: int) -> float:
        """The start of the step whose host span holds call ``c``'s issue (its device work may run after)."""
        i = bisect_right(starts, t := issue(c)) - 1
        return starts[i] if i >= 0 and t < step_spans[i][2] else -np.inf

    step_start, step_end = np.array(starts, dtype=np.int64), np.array([w._time(*e) for e in ends], dtype=np.int64)

    def walk_floor(c: int) -> float:
        """Where call ``c``'s walk stops: the start of the earliest step whose span, its device work included, holds
        the call's issue, as any of them may reach the call (``stitch`` cuts each step's path at its start)."""
        holds = step_start[(step_start <= (t := issue(c))) & (t < step_end)]
        return int(holds.min()) if len(holds) else floor_of(c)

    anchors, walks = [], []
    # (anchor, key, state, floor, the host's end of the step)
    todo: list[tuple[str, int, tuple[str, int], float, int | None]] = [
        ("step", n, end, s, e) for (n, s, e), end in zip(step_spans, ends)]
    if not step_spans:  # no steps: the whole trace, from the host event (not Kineto's span of the whole profile)
        # or the device work that ends last
        ops = np.flatnonzero(np.array([c.lower() != "trace" for c in cats], dtype=bool)[w.hc_code]).tolist()
        if ops:
            final = max(ops, key=lambda k: (w.he[k], -k))
            todo.append(("step", -1, w.last_of(("ce", final), None, None), -np.inf, w.he[final]))
    todo += [("call", c, state, walk_floor(c), None) for c, state in sorted(arrivals.items())]
    for anchor, key, state, floor, host_end in todo:
        pieces, (stop, call, t) = w.walk(state, floor)
        at = w._time(*state)
        anchors.append((anchor, key, at + base, floor + base if np.isfinite(floor) else None, stop, call, t + base,
                        len(anchors), None if host_end is None else host_end + base))
        walks.append((pieces, (at - t) // _SHORT_PER_WALK))
    anchors_df = pd.DataFrame(anchors, columns=ANCHOR_COLUMNS)
    # the nullable columns from the rows: pandas makes ints and None float64, which moves absolute ns (1.7e18), and
    # so each step's start on the path, by up to 128 ns
    for c in ("floor_ns", "stop_call", "host_ns"):
        anchors_df[c] = pd.array([row[ANCHOR_COLUMNS.index(c)] for row in anchors], dtype="Int64")
    segments = _segments(w, walks, start, pids, tids, np.concatenate([tree.order, g.index]), base)
    gpu_ends = {int(c): int(e) - base for c, e in zip(index, gpu_end) if e is not None}
    return (anchors_df, *_used_texts(segments, _work(w, gpu_ends, arrivals, floor_of), w.texts))


def _used_texts(segments: pd.DataFrame, work: pd.DataFrame,
                texts: list[str]) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """``segments`` and ``work`` with their codes into only the texts they use, and those texts: the walker's
    texts start with every name of the rank, and the client holds each rank's texts (10,000 small A100 ranks:
    1.1 kB of text each used, 4.9 kB with every kernel name)."""
    columns = [(segments, c) for c in ("name", "pid", "tid")] + [(work, c) for c in ("name", "cat")]
    used = np.unique(np.concatenate([t[c].to_numpy(dtype=np.int64) for t, c in columns]))
    code = np.zeros(len(texts), dtype=np.int64)
    code[used] = np.arange(len(used))
    segments, work = (t.assign(**{c: code[t[c].to_numpy(dtype=np.int64)] for c in cs}) if len(t) else t
                      for t, cs in ((segments, ("name", "pid", "tid")), (work, ("name", "cat"))))
    return segments, work, [texts[i] for i in used.tolist()]


def _segments(w: _Walker, walks: list[tuple[list[Any], int]], start: np.ndarray, pids: np.ndarray, tids: np.ndarray,
              event_of: np.ndarray, base: int) -> pd.DataFrame:
    """Every walk's pieces (``_Walker.walk``) as segment rows (``SEGMENT_COLUMNS``): runs along a thread expanded
    into their states' own times, empty segments dropped, consecutive ones of one event joined, then runs of short
    ones joined (``_short_runs``, below each walk's limit). ``event_of`` maps a source (host positions, then device
    work) to its X event."""
    pieces = list(chain.from_iterable(p for p, _ in walks))
    is_run = np.array([type(p) is tuple for p in pieces], dtype=bool)
    runs = np.array(list(compress(pieces, is_run)), dtype=np.int64).reshape(-1, 3)  # (i, s, t)
    single_rows = np.array(list(compress(pieces, ~is_run)), dtype=np.int64).reshape(-1, 5)  # as in the tables
    size = np.ones(len(pieces), dtype=np.int64)
    size[is_run] = runs[:, 0] - runs[:, 1]
    offset = np.cumsum(size) - size
    total = int(size.sum())
    kind, name, src, t0, t1 = (np.empty(total, dtype=np.int64) for _ in range(5))
    if len(runs):
        _expand_runs(w, runs, offset[is_run], (kind, name, src, t0, t1))
    if len(single_rows):
        at = offset[~is_run]
        kind[at], name[at], src[at], t0[at], t1[at] = single_rows.T
    walk = np.repeat(np.repeat(np.arange(len(walks)), [len(p) for p, _ in walks]), size)
    keep = t1 > t0
    walk, kind, name, src, t0, t1 = walk[keep], kind[keep], name[keep], src[keep], t0[keep], t1[keep]
    if not len(walk):
        return pd.DataFrame({c: [] for c in SEGMENT_COLUMNS})
    same = (walk[1:] == walk[:-1]) & (kind[1:] == kind[:-1]) & (src[1:] == src[:-1]) & (t1[1:] == t0[:-1]) \
        & (name[1:] == name[:-1])
    head = np.flatnonzero(np.concatenate([[True], ~same]))
    tail = np.append(head[1:], len(t0)) - 1
    limit = np.array([short for _, short in walks], dtype=np.int64)
    device = (src[head] < 0) & (src[head] != NO_EVENT) & np.isin(kind[head], [_KIND[k] for k in _DEVICE_KINDS])
    category = np.where(device, w.category[np.where(device, -1 - src[head], 0)], 0) if len(w.gs) else \
        np.zeros(len(head), dtype=np.int64)
    walk, kind, name, src, t0, t1, category = _short_runs(
        walk[head], kind[head], name[head], src[head], t0[tail], t1[head], limit[walk[head]],
        w.labels(kind[head], name[head], src[head]), category)
    has = src != NO_EVENT
    event = event_of[np.where(src >= 0, src, np.where(has, len(w.hs) - 1 - src, 0))]
    pid, tid = (_text_codes(w, v[event], has) for v in (pids, tids))
    return pd.DataFrame({"walk": walk, "kind": kind, "name": name, "start_ns": t0 + base, "end_ns": t1 + base,
                         "pid": pid, "tid": tid, "event_ns": np.where(has, start[event], NO_EVENT), "category": category},
                        columns=SEGMENT_COLUMNS)


def _expand_runs(w: _Walker, runs: np.ndarray, offset: np.ndarray, into: tuple[np.ndarray, ...]) -> None:
    """Each run along a thread's tour ``(i, s, t)`` (``_Walker.walk``) as its states' segments, written into the
    segment columns ``into`` (kind, name, source, start, end) from the run's ``offset`` on. Its own function: the
    expansion's arrays, as long as a rank's walks (the analysis's peak memory), are freed once it returns."""
    i, s, t = runs.T
    n = i - s
    first = np.repeat(offset, n)
    step = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # 0, 1, ... within each run
    rows, k, cap = first + step, np.repeat(i, n) - step, np.repeat(t, n)
    # a state's segment starts at the earliest time of the run so far: its own, unless times along the tour dip
    begin = np.minimum(w.tour_t[k - 1], cap)
    if ((np.diff(begin) > 0) & (step[1:] > 0)).any():
        begin = pd.Series(begin).groupby(np.repeat(np.arange(len(n)), n)).cummin().to_numpy()
    stop = np.concatenate([[0], begin[:-1]])
    stop[step == 0] = cap[step == 0]
    kind, name, src, t0, t1 = into
    kind[rows], name[rows], src[rows], t0[rows], t1[rows] = w.own_kind[k], w.own_name[k], w.own_src[k], begin, stop


def _text_codes(w: _Walker, values: np.ndarray, has: np.ndarray) -> np.ndarray:
    """Each value's JSON text (a pid or tid as in its file; "" where ``has`` is false) as a code (``_Walker.code``),
    rendered once each."""
    code, distinct = pd.factorize(values, use_na_sentinel=False)
    return w.codes([orjson.dumps(v).decode() for v in distinct] + [""])[np.where(has, code, len(distinct))]


def _short_runs(walk: np.ndarray, kind: np.ndarray, name: np.ndarray, src: np.ndarray, t0: np.ndarray,
                t1: np.ndarray, limit: np.ndarray, label: np.ndarray, category: np.ndarray) -> tuple[np.ndarray, ...]:
    """Segments (latest first within each walk) with those shorter than their row's ``limit`` ns joined under the
    ops they ran in, so that a rank's walks stay small whatever its event count.

    A short segment takes its ``label`` (the op it counts for, ``_Walker.labels``), and loses its event unless that
    is its own name. Each run of consecutive short ones of one kind becomes one segment per label, with the label's
    time in the run, laid end to end from the run's end in the order the labels first come: a run of one label is
    one segment over its span, and a run of many has as many segments as it has ops, not pieces (an op's device
    work one per kernel category). Each walk's time, its time by kind, by label and by category are unchanged; in a
    run of many labels a segment lies within the run's span, not over its op's own pieces."""
    short = t1 - t0 < limit
    src = np.where(short & (label != name), NO_EVENT, src)
    name = np.where(short, label, name)
    head = np.flatnonzero(np.r_[True, ~(short[1:] & short[:-1] & (kind[1:] == kind[:-1]) & (walk[1:] == walk[:-1]))])
    run = np.repeat(np.arange(len(head)), np.diff(np.append(head, len(t0))))
    # per (run, name, category), in the order they first come: one int key (name and category are codes >= 0)
    names, categories = int(name.max()) + 1, int(category.max()) + 1
    code, keys = pd.factorize((run * names + name) * categories + category)
    ns = np.zeros(len(keys), dtype=np.int64)
    np.add.at(ns, code, t1 - t0)
    r, name, category = keys // categories // names, keys // categories % names, keys % categories
    first = head[r]
    before = np.cumsum(ns) - ns  # the labels' time before each in its run (r is sorted: runs are contiguous)
    end = t1[first] - (before - before[np.searchsorted(r, r)])
    alone = np.bincount(run)[r] == 1
    return walk[first], kind[first], name, np.where(alone, src[first], NO_EVENT), end - ns, end, category


def _work(w: _Walker, gpu_ends: Mapping[int, int], arrivals: Mapping[int, tuple[str, int]],
          floor_of: Any) -> pd.DataFrame:
    """Per collective call: the work since the previous collective on this rank (or the step's start), by kind and
    name: host ops by their own time (children's left out) and category, device work by its time, the GPU's idle
    time (``idle``, ``GPU idle``) and the interval's length (``interval``), as codes (``WORK_KINDS``, texts).
    ``gpu_ends``: the end of each call that has device work (the rank's ns)."""
    ends = dict(gpu_ends)  # and, below, the CPU collectives'
    following = {p: k for k, p in enumerate(w.prev) if p >= 0} if w.cpu_call else {}
    for k, c in w.cpu_call.items():  # a CPU collective ends when its thread goes on: its next sibling's start
        nxt, p = following.get(k, -1), w.parent[k]
        ends[c] = w.hs[nxt] if nxt >= 0 else w.he[p] if p >= 0 else w.he[k]
    spans = []
    prev_end = -np.inf
    for c in sorted(arrivals):
        b = w._time(*arrivals[c])
        a = max(prev_end, floor_of(c))
        prev_end = max(prev_end, ends.get(c, b))
        if np.isfinite(a):
            spans.append((c, int(a), b))
    if not spans:
        return pd.DataFrame({c: [] for c in WORK_COLUMNS})
    call, a, b = (np.array(v, dtype=np.int64) for v in zip(*spans))
    seq = np.arange(len(spans))
    none = w.code("")
    one = np.ones(len(spans), dtype=np.int64)
    parts = [(seq, 0, one * WORK_KINDS.index("interval"), one * none, one * none, one, b - a)]
    k, at = _starting(w.starts, a, b)  # host ops by their own time, but not a CPU collective's own call
    mine = ~np.isin(k, list(w.cpu_call))
    k, at = k[mine], at[mine]
    parts.append(_sums(at, 1, w.own[k], kind=(np.zeros(len(k), dtype=np.int64), [WORK_KINDS.index("cpu_op")]),
                       name=(w.hn_code[k], None), cat=(w.hc_code[k], w.codes(w.cats))))
    gs, ge = w.g.start, w.g.end
    work = (w.g.kind != "sync") & ~np.isin(np.arange(len(gs)), list(w.gpu_call))
    j, at = _starting(np.where(work, gs, np.iinfo(np.int64).min), a, b)  # device work, in its input order
    by = np.lexsort((j, at))
    j, at = j[by], at[by]
    parts.append(_sums(at, 2, ge[j] - gs[j], kind=(np.isin(w.g.kind[j], ("memcpy", "memset")),
                                                   [WORK_KINDS.index("kernel"), WORK_KINDS.index("memcpy")]),
                       name=(w.g.code[j], None), cat=(np.zeros(len(j), dtype=np.int64), [none])))
    if len(gs):  # the GPU's idle time: the interval less the union of its work, cut at the interval's end
        s, e = gs[j], np.minimum(ge[j], b[at])
        by = np.lexsort((e, s, at))
        s, e, at = s[by], e[by], at[by]
        reach = before_in_group(e, at)
        covered = np.bincount(at, np.maximum(0, e - np.maximum(s, np.maximum(reach, a[at]))), len(spans))
        parts.append((seq, 3, one * WORK_KINDS.index("idle"), one * w.code("GPU idle"), one * none, one,
                      b - a - covered.astype(np.int64)))
    # the rows by interval, then part, each part's in its own order
    row_seq, kind, name, cat, count, ns = (np.concatenate([p[i] for p in parts]) for i in (0, 2, 3, 4, 5, 6))
    order = np.argsort(row_seq * 4 + np.concatenate([np.full(len(p[0]), p[1]) for p in parts]), kind="stable")
    return pd.DataFrame(dict(zip(WORK_COLUMNS, (call[row_seq[order]], kind[order], name[order], cat[order],
                                                count[order], ns[order]))))


def _starting(t: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices of ``t`` that fall in each ``[a, b)``, by time, and the interval of each."""
    order = np.argsort(t, kind="stable")
    lo, hi = np.searchsorted(t[order], a), np.searchsorted(t[order], b)
    n = np.maximum(hi - lo, 0)
    return order[np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))], np.repeat(np.arange(len(a)), n)


def _sums(at: np.ndarray, part: int, ns: np.ndarray,
          **keys: tuple[np.ndarray, Any]) -> tuple[np.ndarray | int, ...]:
    """Count and total ``ns`` per interval and keys (each given as local codes and the codes they stand for, or
    None when they are the codes), in order of first appearance: the rows ``(seq, part, *keys, count, ns)``."""
    group, first = first_seen(at, *(code for code, _ in keys.values()))
    order = np.argsort(group, kind="stable")
    total = np.add.reduceat(ns[order], np.searchsorted(group[order], np.arange(len(first)))) if len(first) else \
        np.zeros(0, dtype=np.int64)
    return (at[first], part, *(np.asarray(code, dtype=np.int64)[first] if values is None
                               else np.asarray(values, dtype=np.int64)[np.asarray(code, dtype=np.int64)[first]]
                               for code, values in keys.values()),
            np.bincount(group, minlength=len(first)), total.astype(np.int64))
