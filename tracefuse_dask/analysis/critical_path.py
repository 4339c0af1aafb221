"""The cross-rank critical path of each step, and why the straggler is late. Pure functions, no IO, no Dask.

Map side (``rank_pieces``, in each rank's task): the rank's dependency graph is walked backwards from a
set of anchors, always to the predecessor that finished last:

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

Reduce (``stitch``): from the end of each step on the rank that finished last (clocks corrected), follow the
walks; at a matched collective, the transfer runs from the last participant's arrival, and the walk goes on
from that rank's arrival. The chain is what determined the step's length.

``straggler_cause`` compares, for the collectives the straggler reached last, the work each rank did since its
previous collective (``path_work``, by name) with the median rank's.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict, namedtuple
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import cached_property
from itertools import compress
from typing import Any

import numpy as np
import orjson
import pandas as pd

from ..kineto.layout import CRITICAL_PATH_PID, MAX_RANK
from ..kineto.times import to_ns
from ..kineto.vocabulary import (
    BLOCKING_COPIES,
    KERNEL_CATEGORIES,
    STEP,
    STREAM_SYNC,
    STREAM_WAIT,
    SYNC_CALLS,
    is_comm_kernel,
    is_cpu_op_category,
    kernel_category,
    kernel_label,
)
from ..model import Marks

__all__ = [
    "ANCHOR_COLUMNS",
    "CAUSE_SHARE",
    "CATEGORIES",
    "GPU_KINDS",
    "KINDS",
    "LABELS",
    "PATH_COLUMNS",
    "SEGMENT_COLUMNS",
    "WORK_COLUMNS",
    "WORK_KINDS",
    "bound",
    "path_line",
    "rank_pieces",
    "stitch",
    "straggler_cause",
    "trace_marks",
    "walks_in",
]

# "sync wait": a stream waiting for another stream's work; "sync overhead": the part of a blocking call (a sync, a
# blocking copy) after the device work it waited for ended, the call's own time
KINDS = ("cpu_op", "kernel", "memcpy", "launch gap", "sync wait", "collective transfer", "idle", "sync overhead")
GPU_KINDS = ("kernel", "memcpy", "sync wait", "collective transfer")  # with "GPU idle": the path's time on the GPU
_KIND = {k: i for i, k in enumerate(KINDS)}
_NONE = -(2**62)  # a segment's source when it has no event
_BLOCKING = SYNC_CALLS | BLOCKING_COPIES
CAUSE_SHARE = 0.2
"""An op is a straggler's cause when it accounts for at least this share of the straggler's extra time."""
WHAT_IF_TID = MAX_RANK + 1  # the critical-path process's thread of the straggler what-if, after every rank's
CATEGORIES = ("", *KERNEL_CATEGORIES)  # a segment's kernel category: "" for time not of device work
_QUEUED_NS = 50_000  # a kernel that starts this long after both its launch and the work before it on its stream
_HANDOFF_NS = 20_000  # and this soon after work on another stream ends was waiting for that work
_SHORT_PER_WALK = 1000  # segments shorter than a walk's length over this are joined in runs (``_short_runs``)
# ``at_ns``: where the walk starts (a step's: its last work's end); ``host_ns``: a step's host end (its own event's)
ANCHOR_COLUMNS = ["anchor", "key", "at_ns", "floor_ns", "stop", "stop_call", "stop_ns", "walk", "host_ns"]
# Segments and work are codes, so that they cost the task, the transfer and the reduce little: ``kind`` into
# ``KINDS`` or ``WORK_KINDS``, ``name``, ``cat``, ``pid`` and ``tid`` into the rank's texts (``RankTables.texts``:
# the name, the category, the pid or tid as JSON text, "" for none); ``walk`` is the anchor's row in its rank's
# anchors; ``event_ns`` the start of the event a segment is time of, in the file's ns (``_NONE``: none).
# ``category``: a code into ``CATEGORIES``.
SEGMENT_COLUMNS = ["walk", "kind", "name", "start_ns", "end_ns", "pid", "tid", "event_ns", "category"]
WORK_COLUMNS = ["call", "kind", "name", "cat", "count", "ns"]
WORK_KINDS = ("interval", "cpu_op", "kernel", "memcpy", "idle")
PATH_COLUMNS = ["step", "order", "rank", "kind", "name", "start_us", "dur_us", "pid", "tid", "event_ts", "category"]
_CAUSES = {"cpu_op": "host-bound", "launch gap": "host-bound", "idle": "host-bound", "memcpy": "memcpy or data loading",
           "sync wait": "synchronisation", "collective transfer": "synchronisation"}


_Anchor = namedtuple("_Anchor", ["shift", "stop", "stop_call", "stop_ns"])  # what ``stitch`` reads of an anchor
_Walks = namedtuple("_Walks", ["anchor", "shift"])  # in ``stitch``: an anchor's walks, on its rank's corrected clock
_DEVICE_KINDS = ("kernel", "memcpy")  # a device event's segment kind, by whether it is a memcpy or memset
# what a joined segment's name adds to its op's (``_Walker.labels``), in the order it picks them; the last: otherwise
LABELS = (" (launch gaps)", " (kernels)", " (memcpy)", " (host dispatch)", " (host, outside ops)", " (host)")


class _Walker:
    """One rank's graph, walked backwards. Times are the rank's relative ns; positions are the call tree's."""

    def __init__(self, start: np.ndarray, end: np.ndarray, name_code: np.ndarray, names: np.ndarray,
                 cat_code: np.ndarray, cats: np.ndarray, tree: Any, g: Any, launch_pos: np.ndarray) -> None:
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
        m = len(self.hs)
        self.parent = parent
        up = np.asarray(parent, dtype=np.int64)
        child = np.flatnonzero(up >= 0)
        # each position's previous sibling (a root's: the previous root of its thread)
        key = np.where(up >= 0, up, -2 - np.asarray(thread, dtype=np.int64))
        by_key = np.argsort(key, kind="stable")
        same = key[by_key][1:] == key[by_key][:-1]
        prev = np.full(m, -1, dtype=np.int64)
        prev[by_key[1:][same]] = by_key[:-1][same]
        self.prev_pos, self.prev = prev, memoryview(prev)
        last_child = np.full(m, -1, dtype=np.int64)
        np.maximum.at(last_child, up[child], child)
        self.last_child = memoryview(last_child)
        dur = ends - self.starts
        children = np.zeros(m, dtype=np.int64)
        np.add.at(children, up[child], dur[child])
        self.own = dur - children  # each position's time less its children's
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
        self.times = {"ce": self.he, "cs": self.hs, "ge": self.ge, "gs": self.gs}
        self.gpu_call: dict[int, int] = {}  # comm kernel -> collective call index
        self.cpu_call: dict[int, int] = {}  # position of a CPU collective's call -> call index
        # Each thread's states in time order (its Euler tour: a position's start, its subtree, its end), so that
        # a walk runs back along a thread without deciding each step (``index``, ``walk``). A position's end
        # comes just before the start its subtree stops at, the deeper ends first.
        pos = np.arange(m)
        keys = np.concatenate([2 * pos, 2 * np.asarray(tree.stop) - 1])
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
        # the rank's texts: what the pieces' names, categories, pids and tids are codes into (``code``,
        # ``RankTables.texts``); its event names first, so that a name's code is its ``name_code``
        self.texts: list[str] = names.tolist()
        self.text_code = {n: i for i, n in enumerate(self.texts)}
        self.own_name = np.where(src >= 0, self.hn_code[src], self.code("CPU idle"))
        self.own_src = np.where(src >= 0, src, _NONE)
        self.last_special: Sequence[int] = []

    def index(self) -> None:
        """Mark the states where a walk has a choice to make (``_step``), once the collective calls and the steps'
        thread are known: a blocking call's or a CPU collective's end, the start after a CPU collective, a thread's
        first state, a root's start on another thread than the steps'."""
        calls = np.array(sorted(self.cpu_call), dtype=np.int64)
        blocking = np.array([n in _BLOCKING for n in self.texts], dtype=bool)[self.hn_code]
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
                                     None if src == _NONE else src, *state)
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
        source is the event it is time of: a host position ``k``, device work ``j`` as ``-1 - j``, or ``_NONE``),
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
            pieces.append([_KIND[kind], self.code(name), _NONE if src is None else src, max(t0, floor), t])
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
        device = np.isin(kind, [_KIND[k] for k in _DEVICE_KINDS]) & (src < 0) & (src != _NONE)
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
        n = len(LABELS)  # (name, suffix) pairs as one key: a 1-d unique, far faster than unique(axis=1)
        pairs, inverse = np.unique(self.hn_code[op].astype(np.int64) * n + suffix, return_inverse=True)
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
            if name in _BLOCKING:
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


def rank_pieces(start: np.ndarray, end: np.ndarray, name_code: np.ndarray, names: np.ndarray, cat_code: np.ndarray,
                cats: np.ndarray, pids: np.ndarray, tids: np.ndarray, tree: Any, g: Any, launch_pos: np.ndarray,
                step_spans: Sequence[tuple[int, int, int]], step_pos: Mapping[int, int], calls: pd.DataFrame,
                base: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, list[str]]:
    """One rank's walks from its anchors, and the work between its collectives (map task).

    Parameters
    ----------
    start, end, name_code, cat_code, pids, tids
        Per X event, as arrays (relative ns, name and category as codes into ``names`` and ``cats``, pid and tid
        as in the trace).
    names, cats
        The distinct names and categories.
    tree
        The call tree (``analysis.rank._Tree``).
    g
        The device work (``analysis.rank._Gpu``).
    launch_pos
        Per device event, the position of the call that launched it (-1: none known).
    step_spans, step_pos
        ``(step, start, end)`` of each ``ProfilerStep#N``, and the event index of each step's own event.
    calls
        The rank's collective calls (``collectives.rank_collectives``, absolute ns).
    base
        What makes the relative times absolute.

    Returns
    -------
    anchors, segments, work, texts
        ``ANCHOR_COLUMNS``, ``SEGMENT_COLUMNS`` and ``WORK_COLUMNS`` (absolute ns, but a segment's ``event_ns``),
        and the texts their codes stand for.
    """
    w = _Walker(start, end, name_code, names, cat_code, cats, tree, g, launch_pos)
    arrivals: dict[int, tuple[str, int]] = {}
    gpu_calls = calls[calls["gpu_start_ns"].notna()]
    if len(gpu_calls):
        spans: dict[Any, list[tuple[int, int, int]]] = defaultdict(list)
        for c, s, e, st in zip(gpu_calls["index"], gpu_calls["gpu_start_ns"], gpu_calls["gpu_end_ns"],
                               gpu_calls["stream"]):
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
    cpu_calls = calls[calls["gpu_start_ns"].isna()]
    if len(cpu_calls):
        at = {(s, e): k for k, (s, e) in enumerate(zip(w.hs, w.he))}
        for c, s, e in zip(cpu_calls["index"], cpu_calls["cpu_start_ns"], cpu_calls["cpu_end_ns"]):
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
    issued = {int(c): int(t) - base for c, t in zip(calls["index"], calls["cpu_start_ns"]) if pd.notna(t)}

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
    return (anchors_df, *_used_texts(segments, _work(w, calls, arrivals, floor_of, base), w.texts))


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
    item_walk, counts, runs, singles, single_rows = [], [], [], [], []
    for n, (pieces, _) in enumerate(walks):
        for piece in pieces:
            if type(piece) is tuple:
                i, s, t = piece
                runs.append((len(counts), i, s, t))
                counts.append(i - s)
            else:
                singles.append(len(counts))
                single_rows.append(piece)
                counts.append(1)
            item_walk.append(n)
    size = np.array(counts, dtype=np.int64)
    offset = np.cumsum(size) - size
    total = int(size.sum())
    kind, name, src, t0, t1 = (np.empty(total, dtype=np.int64) for _ in range(5))
    if runs:
        item, i, s, t = (np.array(v, dtype=np.int64) for v in zip(*runs))
        n = i - s
        first = np.repeat(offset[item], n)
        step = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # 0, 1, ... within each run
        rows, k, cap = first + step, np.repeat(i, n) - step, np.repeat(t, n)
        # a state's segment starts at the earliest time of the run so far: its own, unless times along the tour dip
        begin = np.minimum(w.tour_t[k - 1], cap)
        if ((np.diff(begin) > 0) & (step[1:] > 0)).any():
            begin = pd.Series(begin).groupby(np.repeat(np.arange(len(n)), n)).cummin().to_numpy()
        stop = np.concatenate([[0], begin[:-1]])
        stop[step == 0] = cap[step == 0]
        kind[rows], name[rows], src[rows], t0[rows], t1[rows] = w.own_kind[k], w.own_name[k], w.own_src[k], begin, stop
    if singles:
        at = offset[singles]
        columns = list(zip(*single_rows))
        kind[at], name[at], src[at], t0[at], t1[at] = columns
    walk = np.repeat(np.array(item_walk, dtype=np.int64), size)
    keep = t1 > t0
    walk, kind, name, src, t0, t1 = walk[keep], kind[keep], name[keep], src[keep], t0[keep], t1[keep]
    if not len(walk):
        return pd.DataFrame({c: [] for c in SEGMENT_COLUMNS})
    same = (walk[1:] == walk[:-1]) & (kind[1:] == kind[:-1]) & (src[1:] == src[:-1]) & (t1[1:] == t0[:-1]) \
        & (name[1:] == name[:-1])
    head = np.flatnonzero(np.concatenate([[True], ~same]))
    tail = np.append(head[1:], len(t0)) - 1
    limit = np.array([short for _, short in walks], dtype=np.int64)
    device = (src[head] < 0) & (src[head] != _NONE) & np.isin(kind[head], [_KIND[k] for k in _DEVICE_KINDS])
    category = np.where(device, w.category[np.where(device, -1 - src[head], 0)], 0) if len(w.gs) else \
        np.zeros(len(head), dtype=np.int64)
    walk, kind, name, src, t0, t1, category = _short_runs(
        walk[head], kind[head], name[head], src[head], t0[tail], t1[head], limit[walk[head]],
        w.labels(kind[head], name[head], src[head]), category)
    has = src != _NONE
    event = event_of[np.where(src >= 0, src, np.where(has, len(w.hs) - 1 - src, 0))]
    pid, tid = (_text_codes(w, v[event], has) for v in (pids, tids))
    return pd.DataFrame({"walk": walk, "kind": kind, "name": name, "start_ns": t0 + base, "end_ns": t1 + base,
                         "pid": pid, "tid": tid, "event_ns": np.where(has, start[event], _NONE), "category": category},
                        columns=SEGMENT_COLUMNS)


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
    src = np.where(short & (label != name), _NONE, src)
    name = np.where(short, label, name)
    head = np.flatnonzero(np.r_[True, ~(short[1:] & short[:-1] & (kind[1:] == kind[:-1]) & (walk[1:] == walk[:-1]))])
    run = np.repeat(np.arange(len(head)), np.diff(np.append(head, len(t0))))
    by = pd.DataFrame({"run": run, "name": name, "category": category, "ns": t1 - t0}).groupby(
        ["run", "name", "category"], sort=False)["ns"].sum()
    r, name, category = (by.index.get_level_values(i).to_numpy() for i in (0, 1, 2))
    ns = by.to_numpy()
    first = head[r]
    end = t1[first] - (pd.Series(ns).groupby(r).cumsum().to_numpy() - ns)  # after the labels before in the run
    alone = np.bincount(run)[r] == 1
    return walk[first], kind[first], name, np.where(alone, src[first], _NONE), end - ns, end, category


def _work(w: _Walker, calls: pd.DataFrame, arrivals: Mapping[int, tuple[str, int]], floor_of: Any,
          base: int) -> pd.DataFrame:
    """Per collective call: the work since the previous collective on this rank (or the step's start), by kind and
    name: host ops by their own time (children's left out) and category, device work by its time, the GPU's idle
    time (``idle``, ``GPU idle``) and the interval's length (``interval``), as codes (``WORK_KINDS``, texts)."""
    ends = {int(c): int(e) - base for c, e in zip(calls["index"], calls["gpu_end_ns"]) if pd.notna(e)}
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
    parts = [pd.DataFrame({"seq": seq, "part": 0, "kind": WORK_KINDS.index("interval"), "name": none, "cat": none,
                           "count": 1, "ns": b - a})]
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
        reach = pd.Series(e).groupby(at).cummax().groupby(at).shift(fill_value=np.iinfo(np.int64).min).to_numpy()
        covered = np.bincount(at, np.maximum(0, e - np.maximum(s, np.maximum(reach, a[at]))), len(spans))
        parts.append(pd.DataFrame({"seq": seq, "part": 3, "kind": WORK_KINDS.index("idle"), "name": w.code("GPU idle"),
                                   "cat": none, "count": 1, "ns": b - a - covered.astype(np.int64)}))
    rows = pd.concat(parts, ignore_index=True).sort_values(["seq", "part"], kind="stable")
    return pd.DataFrame({"call": call[rows["seq"].to_numpy()], **{c: rows[c].to_numpy() for c in WORK_COLUMNS[1:]}})


def _starting(t: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices of ``t`` that fall in each ``[a, b)``, by time, and the interval of each."""
    order = np.argsort(t, kind="stable")
    lo, hi = np.searchsorted(t[order], a), np.searchsorted(t[order], b)
    n = np.maximum(hi - lo, 0)
    return order[np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))], np.repeat(np.arange(len(a)), n)


def _sums(at: np.ndarray, part: int, ns: np.ndarray, **keys: tuple[np.ndarray, Any]) -> pd.DataFrame:
    """Count and total ``ns`` per interval and keys (each given as local codes and the codes they stand for, or
    None when they are the codes), in order of first appearance."""
    rows = pd.DataFrame({"seq": at, "ns": ns, **{k: code for k, (code, _) in keys.items()}})
    out = rows.groupby(["seq", *keys], sort=False)["ns"].agg(["size", "sum"]).reset_index()
    return pd.DataFrame({"seq": out["seq"], "part": part, "count": out["size"], "ns": out["sum"],
                         **{k: out[k].to_numpy(dtype=np.int64) if values is None
                            else np.asarray(values, dtype=np.int64)[out[k].to_numpy(dtype=np.int64)]
                            for k, (_, values) in keys.items()}})


def stitch(anchors: pd.DataFrame, segments_of: Callable[[list[tuple[int, int]]], pd.DataFrame], calls: pd.DataFrame,
           matched: pd.DataFrame, offsets_ns: Mapping[int, float],
           texts: Mapping[int, Sequence[str]]) -> tuple[pd.DataFrame, list[dict[str, Any]], int]:
    """The critical path of each step across ranks (reduce), from every rank's walks.

    Parameters
    ----------
    anchors
        Every rank's ``rank_pieces`` anchors, with a leading ``rank`` column.
    segments_of
        The segments of the walks ``[(rank, walk), ...]`` (sorted), as ``rank_pieces`` gives them with a leading
        ``rank`` column, each walk's rows together and in order: only the walks the path takes are asked for,
        once, and only when there are any (most of a big job's segments are off the path, and they can stay
        where the ranks were analysed).
    calls
        Every rank's collective calls; ``matched``: those matched into instances (``match_collectives``).
    offsets_ns
        Each rank's clock offset (what to subtract).
    texts
        Each rank's texts (``RankTables.texts``).

    Returns
    -------
    path, steps, origin
        One row per segment (``PATH_COLUMNS``, ``start_us`` from ``origin``); per step ``{step, start_us,
        duration_us, host_us, path_us, gpu_us, by_rank, by_kind, by_category, syncs, top}``; the absolute ns
        (clocks corrected) where the first step starts. A step runs from its earliest start on any rank to its
        latest end, the end of the device work launched in it included (``host_us``: to its latest host end, the
        step's period on the host); steps whose device work runs into the next step's overlap. When the path's
        first rank began it later, that wait is an ``idle`` segment. Step -1 is the whole trace, for ranks without
        steps.
    """
    if anchors.empty:
        return pd.DataFrame(columns=PATH_COLUMNS), [], 0
    off = {int(r): round(v) for r, v in offsets_ns.items()}  # whole ns: absolute ns overflow a float's 53 bits
    a = anchors.assign(shift=anchors["rank"].map(lambda r: off.get(int(r), 0)).astype("int64"))
    by_anchor = {(r, k, key): _Anchor(*row) for r, k, key, *row in zip(
        *(a[c].tolist() for c in ("rank", "anchor", "key", "shift", "stop", "stop_call", "stop_ns")))}
    walks_of: dict[tuple[int, str, int], list[int]] = defaultdict(list)  # a step of a rank can have two anchors
    for r, k, key, walk in zip(a["rank"].tolist(), a["anchor"], a["key"].tolist(), a["walk"].tolist()):
        walks_of[(r, k, key)].append(walk)
    arrival = _arrivals(calls, off)
    op_of = {(r, c): op for r, c, op in zip(*(calls[k].tolist() for k in ("rank", "index", "op")))}
    members: dict[int, list[tuple[int, int]]] = defaultdict(list)
    instance_of: dict[tuple[int, int], int] = {}
    for r, c, i in zip(*(matched[k].astype("int64").tolist() if k in matched else [] for k in
                         ("rank", "index", "instance"))):
        members[i].append((r, c))
        instance_of[(r, c)] = i
    chains: list[tuple[int, list[Any], int | None, int]] = []  # per step: its anchors' walks and transfers
    ends = a[a["anchor"] == "step"].assign(end=a["at_ns"] - a["shift"], floor=a["floor_ns"] - a["shift"],
                                           host=a["host_ns"] - a["shift"])
    latest = ends["end"] == ends.groupby("key")["end"].transform("max")
    by_step = pd.DataFrame({"last": ends[latest].groupby("key")["rank"].min(),
                            "begin": ends.groupby("key")["floor"].min(), "end": ends.groupby("key")["end"].max(),
                            "host": ends.groupby("key")["host"].max()})
    host_end = dict(zip(by_step.index.tolist(), by_step["host"].astype("int64").tolist()))
    for step, last, begin, end in zip(by_step.index.tolist(), by_step["last"].tolist(), by_step["begin"].tolist(),
                                      by_step["end"].tolist()):
        begin = None if pd.isna(begin) else int(begin)
        chain: list[Any] = []
        cur = (last, "step", int(step))
        seen = set()
        while cur in by_anchor and cur not in seen:
            seen.add(cur)
            r = cur[0]
            row = by_anchor[cur]
            chain.append(_Walks(cur, row.shift))
            if row.stop != "call":
                break
            c, t = int(row.stop_call), int(row.stop_ns) - row.shift
            if begin is not None and t <= begin:  # the walk reached the step's start: the rest is cut anyway
                break
            inst = instance_of.get((r, c))
            nxt = (r, c)
            if inst is not None:
                who = sorted(((arrival[m], m) for m in members[inst] if m in arrival), key=lambda x: (-x[0], x[1][0]))
                if who and who[0][0] <= t:
                    nxt = who[0][1]
            t0 = min(arrival.get(nxt, t), t)
            if t0 < t:
                chain.append((nxt[0], "collective transfer", op_of.get((r, c), "collective"), t0, t, "", "", np.nan,
                              ""))
            if begin is not None and t0 <= begin:
                break
            cur = (nxt[0], "call", nxt[1])
        chains.append((int(step), chain, begin, int(end)))
    wanted = sorted({(w.anchor[0], walk) for _, chain, _, _ in chains for w in chain if type(w) is _Walks
                     for walk in walks_of[w.anchor]})
    segments = segments_of(wanted) if wanted else pd.DataFrame()
    rows_of = _runs(segments["rank"].to_numpy(), segments["walk"].to_numpy()) if len(segments) else {}
    columns = [segments[c].to_numpy() for c in ("kind", "name", "start_ns", "end_ns", "pid", "tid", "event_ns",
                                                "category")] if len(segments) else []

    def segs_of(cur: tuple[int, str, int], shift: int) -> list[tuple[Any, ...]]:
        """The segments of an anchor's walks, decoded, on the rank's corrected clock. ``event_ts`` is the event's
        start as Python divides exact ints (one rounding; numpy's float division would move the last digit)."""
        r, text = cur[0], texts[cur[0]]
        idx = [rows_of[(r, walk)] for walk in walks_of[cur] if (r, walk) in rows_of]
        if not idx:
            return []
        return [(r, KINDS[k], text[n], t0 - shift, t1 - shift, text[p], text[q], t / 1000 if t != _NONE else np.nan,
                 CATEGORIES[c])
                for k, n, t0, t1, p, q, t, c in zip(*(np.concatenate([v[i] for i in idx]).tolist() for v in columns))]
    paths: list[tuple[int, list[tuple[Any, ...]], int, int]] = []
    for step, chain, begin, end in chains:
        path: list[tuple[Any, ...]] = []
        for w in chain:
            path += segs_of(*w) if type(w) is _Walks else [w]
        path.sort(key=lambda p: (p[3], p[4]))
        if begin is None:  # no steps: the whole trace, from where the path starts
            begin = path[0][3] if path else int(end)
        # a call's walk may go back past this step's start (to an earlier step's, whose device work the call ran in)
        path = [p if p[3] >= begin else (*p[:3], begin, *p[4:]) for p in path if p[4] > begin]
        if path and path[0][3] > begin:  # the rank where the path starts began the step after another rank did
            path.insert(0, (path[0][0], "idle", f"not yet in ProfilerStep#{step}", begin, path[0][3], "", "",
                            np.nan, ""))
        paths.append((step, path, begin, end))
    origin = min((b for _, _, b, _ in paths), default=0)
    rows = [(step, k, r, kind, name, (t0 - origin) / 1e3, (t1 - t0) / 1e3, *event)
            for step, path, _, _ in paths for k, (r, kind, name, t0, t1, *event) in enumerate(path)]
    steps = [_step_summary(step, path, (b - origin) / 1e3, e - b, host_end[step] - b) for step, path, b, e in paths]
    return pd.DataFrame(rows, columns=PATH_COLUMNS), steps, int(origin)


def walks_in(segments: pd.DataFrame, wanted: Sequence[tuple[int, int]]) -> pd.DataFrame:
    """The rows of ``segments`` (with a ``rank`` column) of the walks ``wanted`` (``[(rank, walk), ...]``), for
    ``stitch``; ``segments`` as it is when it has no rows (then, with no ranks, it may have no other column)."""
    if not len(segments):
        return segments
    key = segments["rank"].to_numpy(dtype=np.int64) << 32 | segments["walk"].to_numpy(dtype=np.int64)
    return segments[np.isin(key, [r << 32 | w for r, w in wanted])]


def _runs(rank: np.ndarray, walk: np.ndarray) -> dict[tuple[int, int], Any]:
    """The rows of each (rank, walk): a slice, as each rank's walks come one after the other (an index array
    where one's rows are not together)."""
    if len(rank) == 0:
        return {}
    cut = np.flatnonzero((rank[1:] != rank[:-1]) | (walk[1:] != walk[:-1])) + 1
    first, stop = np.r_[0, cut].tolist(), np.r_[cut, len(rank)].tolist()
    runs = {(r, w): slice(a, b) for r, w, a, b in zip(rank[first].tolist(), walk[first].tolist(), first, stop)}
    if len(runs) == len(first):
        return runs
    return pd.DataFrame({"rank": rank, "walk": walk}).groupby(["rank", "walk"], sort=False).indices


def _arrivals(calls: pd.DataFrame, off: Mapping[int, int]) -> dict[tuple[int, int], int]:
    """Each call's arrival, clocks corrected: its first collective kernel's start, else its CPU start."""
    t = calls["gpu_start_ns"].astype("Int64").fillna(calls["cpu_start_ns"].astype("Int64"))
    return {(int(r), int(c)): int(v) - off.get(int(r), 0) for r, c, v in zip(calls["rank"], calls["index"], t)}


def _step_summary(step: int, path: Sequence[tuple[Any, ...]], start_us: float, duration_ns: int,
                  host_ns: int) -> dict[str, Any]:
    by_rank: dict[int, float] = defaultdict(float)
    by_kind: dict[str, float] = defaultdict(float)
    by_item: dict[tuple[int, str, str], float] = defaultdict(float)
    by_category: dict[str, float] = defaultdict(float)
    syncs: dict[str, float] = defaultdict(float)
    gpu = 0.0
    for r, kind, name, t0, t1, *_, category in path:
        d = (t1 - t0) / 1e3
        by_rank[r] += d
        by_kind[kind] += d
        by_item[(r, kind, name)] += d
        if category:
            by_category[category] += d
        if kind in GPU_KINDS or name == "GPU idle":
            gpu += d
        elif kind == "sync overhead":
            syncs[name] += d
    total = sum(by_rank.values())
    top = sorted(by_item.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    return {"step": step, "start_us": round(start_us, 3), "duration_us": round(duration_ns / 1e3, 3),
            "host_us": round(host_ns / 1e3, 3), "path_us": round(total, 3), "gpu_us": round(gpu, 3),
            "by_rank": {str(r): round(v, 3) for r, v in sorted(by_rank.items())},
            "by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "by_category": {k: round(v, 3) for k, v in sorted(by_category.items(), key=lambda kv: (-kv[1], kv[0]))},
            "syncs": [k for k, _ in sorted(syncs.items(), key=lambda kv: (-kv[1], kv[0]))],
            "top": [{"rank": r, "kind": k, "name": n, "us": round(v, 3), "share": round(v / total, 4) if total else 0.0}
                    for (r, k, n), v in top]}


def straggler_cause(rank: int | None, instances: pd.DataFrame, matched: pd.DataFrame, work: pd.DataFrame,
                    steps: int, gpu: bool, texts: Mapping[int, Sequence[str]],
                    late_steps: Collection[int] | None = None, behind: bool = False) -> dict[str, Any] | None:
    """Why ``rank`` is late: its work before the collectives it reached last (``behind``: after the median rank,
    as for a second straggler, which another one hides; in ``late_steps``, when given), against the median
    rank's, by name.

    For each such collective, the median rank is the other participant whose time since its previous collective
    is the median one. ``extra_us`` is how much longer ``rank`` took to reach those collectives (never less
    than 0 per collective), per step (of ``steps``); the differences by (kind, name) are ranked, and the cause's
    kind is the class of the largest ones (host-bound, slower kernels, more work, memcpy or data loading,
    synchronisation). An op is the cause only when its difference is at least ``CAUSE_SHARE`` of the extra time;
    else the verdict says that no single op explains it. ``work`` is every rank's ``rank_pieces`` work, with a
    leading ``rank`` column; ``texts`` each rank's texts (``RankTables.texts``).
    """
    if rank is None or instances.empty or work.empty:
        return None
    mine = (instances["last_rank"] == rank) | behind
    if late_steps is not None:
        mine &= instances["step"].isin(list(late_steps)).to_numpy(dtype=bool)
    late = instances.loc[mine, "instance"].astype(int).tolist()
    call_of = {(int(i), int(r)): int(c) for i, r, c in zip(matched["instance"], matched["rank"], matched["index"])}
    parts = work.groupby(["rank", "call"], sort=False).indices
    columns = [work[c].to_numpy() for c in ("kind", "name", "cat", "count", "ns")]
    interval = work[work["kind"] == WORK_KINDS.index("interval")]  # one row per call
    length = {(int(r), int(c)): float(ns) for r, c, ns in zip(interval["rank"], interval["call"], interval["ns"])}
    diff: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    cat_of: dict[tuple[str, str], str] = {}
    extra = idle = span = 0.0
    medians = []
    kept = []
    for inst in late:
        if (inst, rank) not in call_of:
            continue
        mine = (rank, call_of[(inst, rank)])
        others = sorted((length[(r, c)], r) for (i, r), c in call_of.items()
                        if i == inst and r != rank and (r, c) in length)
        if mine not in parts or not others:
            continue
        med_len, med = others[(len(others) - 1) // 2]
        if behind and length[mine] <= med_len:
            continue
        kept.append(inst)
        medians.append(med)
        extra += max(0.0, length[mine] - med_len)
        span += length[mine]
        for key, sign, side in ((mine, 1.0, 0), ((med, call_of[(inst, med)]), -1.0, 1)):
            text = texts[key[0]]
            for code, name_code, cat_code, n, ns in zip(*(v[parts[key]].tolist() for v in columns)):
                kind, name, cat = WORK_KINDS[code], text[name_code], text[cat_code]
                if kind == "idle" and side == 0:
                    idle += ns
                if kind in ("idle", "interval"):
                    continue
                diff[(kind, name)] += sign * ns
                counts[(kind, name)][side] += int(n)
                cat_of.setdefault((kind, name), cat)
    positive = sorted(((v, k) for k, v in diff.items() if v > 0), key=lambda x: (-x[0], x[1]))
    if not positive or not extra:
        return None
    n_steps = max(1, steps)
    classes: dict[str, float] = defaultdict(float)
    top = []
    for v, key in positive[:10]:
        cls = _cause_class(*key, *counts[key])
        classes[cls] += v
        top.append({"name": key[1], "kind": key[0], "cause": cls, "extra_us": round(v / 1e3 / n_steps, 3),
                    "share": round(min(1.0, v / extra), 4)})
    kind = max(classes.items(), key=lambda kv: kv[1])[0]
    lead = top[0]
    per_step = extra / 1e3 / n_steps
    where = "" if late_steps is None else " (in " + ", ".join(f"ProfilerStep#{s}" for s in sorted(late_steps)) + ")"
    if lead["share"] >= CAUSE_SHARE:
        label = (cat_of.get((lead["kind"], lead["name"])) or lead["kind"]).replace("_", " ")
        verdict = (f"rank {rank} is late to {len(kept)} of {len(instances)} collectives{where} because of `{lead['name']}` "
                   f"({label}): {lead['extra_us'] / 1e3:,.1f} ms per step more than the median rank, "
                   f"{lead['share']:.0%} of its {per_step / 1e3:,.1f} ms of extra time; {kind}")
    else:
        verdict = (f"rank {rank} is late to {len(kept)} of {len(instances)} collectives{where} by {per_step / 1e3:,.1f} ms "
                   f"per step, and no single op explains it: the most, `{lead['name']}`, accounts for "
                   f"{lead['share']:.0%} ({lead['extra_us'] / 1e3:,.1f} ms); {kind}")
    if gpu and span:
        verdict += f": its GPU was idle {100 * idle / span:.0f}% of that time"
    return {"rank": rank, "compared_with": int(pd.Series(medians).mode().min()), "collectives_late": len(kept),
            "extra_us": round(per_step, 3), "kind": kind, "op": lead["name"] if lead["share"] >= CAUSE_SHARE else None,
            "top": top, "verdict": verdict}


def _cause_class(kind: str, name: str, n_mine: int, n_theirs: int) -> str:
    if kind == "kernel":
        return "more work" if n_mine > n_theirs else "slower kernels"
    if kind == "cpu_op" and name in _BLOCKING:
        return "memcpy or data loading" if name in BLOCKING_COPIES else "synchronisation"
    return _CAUSES.get(kind, "host-bound")


def trace_marks(path: pd.DataFrame, origin_ns: int, bases_ns: Mapping[int, int], offsets_ns: Mapping[int, float],
                straggler: Mapping[str, Any] | None = None) -> dict[int, Marks]:
    """What ``analyze --critical-path-trace`` adds to each rank's events in the merged trace.

    ``flows``: an arrow (``s``/``f``, cat and name ``critical_path``) from each event of the path to the next
    one on the same rank, bound to both events (at their ``ts``, as they are in the file), so that Perfetto draws
    the chain; arrows never cross ranks. ``track``: the path's segments as slices of the "critical path" process
    (``CRITICAL_PATH_PID``), one thread per rank, on that rank's own clock, so that each slice lies over the work
    it names. ``straggler`` (``summary.json``'s): each named straggler's late steps, as slices of that process's
    "straggler what-if" thread (``WHAT_IF_TID``) over the step, named by the rank and what fixing it would save,
    the what-if's figures in their args. Times are ns in each rank's file's frame (``Marks``).
    """
    off = {int(r): round(v) for r, v in offsets_ns.items()}
    flows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    track: dict[int, list[dict[str, Any]]] = defaultdict(list)
    last: tuple[Any, ...] | None = None  # the previous event-backed segment: (step, rank, pid, tid, ts)
    for row in path.itertuples(index=False):
        r = int(row.rank)
        t0 = origin_ns + round(row.start_us * 1e3) + off.get(r, 0) - bases_ns[r]
        track[r].append({"ph": "X", "cat": "critical_path", "name": row.name, "pid": CRITICAL_PATH_PID, "tid": r,
                         "ts": t0, "dur": row.dur_us, "args": {"step": int(row.step), "order": int(row.order),
                                                                "kind": row.kind}})
        if row.pid == "":  # a transfer or a wait between events: the chain goes on past it, on its rank
            if last is not None and last[1] != r:
                last = None
            continue
        here = (int(row.step), r, orjson.loads(row.pid), orjson.loads(row.tid), to_ns(row.event_ts))
        if last is not None and last[:2] == here[:2] and last[2:] != here[2:]:
            k = len(flows[r]) // 2
            flows[r] += [{"ph": "s", "cat": "critical_path", "name": "critical_path", "id": k, "pid": last[2],
                          "tid": last[3], "ts": last[4]},
                         {"ph": "f", "bp": "e", "cat": "critical_path", "name": "critical_path", "id": k,
                          "pid": here[2], "tid": here[3], "ts": here[4]}]
        last = here
    for r, events in track.items():
        events += [{"ph": "M", "name": "thread_name", "pid": CRITICAL_PATH_PID, "tid": r,
                    "args": {"name": f"rank {r}"}},
                   {"ph": "M", "name": "thread_sort_index", "pid": CRITICAL_PATH_PID, "tid": r,
                    "args": {"sort_index": r}}]
    what_if = (straggler or {}).get("what_if") or {}
    for n in (straggler or {}).get("ranks") or []:
        r = int(n["rank"])
        for st in what_if["steps"]:
            if st["step"] in n["late_steps"]:
                track[r].append({
                    "ph": "X", "cat": "critical_path", "pid": CRITICAL_PATH_PID, "tid": WHAT_IF_TID,
                    "name": f"straggler rank {r} ({n['pattern']}): {st['measured_us'] / 1e3:,.1f} ms, "
                            f"what-if {st['predicted_us'] / 1e3:,.1f} ms",
                    "ts": st["start_ns"] + off.get(r, 0) - bases_ns[r], "dur": st["measured_us"],
                    "args": {"step": st["step"], "rank": r, "pattern": n["pattern"], "measured_us": st["measured_us"],
                             "predicted_us": st["predicted_us"], "gain_us": st["by_rank"].get(str(r), st["gain_us"]),
                             "assumes": what_if["assumes"]}})
        if r == int(straggler["ranks"][0]["rank"]):
            track[r] += [{"ph": "M", "name": "thread_name", "pid": CRITICAL_PATH_PID, "tid": WHAT_IF_TID,
                          "args": {"name": "straggler what-if"}},
                         {"ph": "M", "name": "thread_sort_index", "pid": CRITICAL_PATH_PID, "tid": WHAT_IF_TID,
                          "args": {"sort_index": -1}}]
    if track:
        track[min(track)] += [
            {"ph": "M", "name": "process_name", "pid": CRITICAL_PATH_PID, "args": {"name": "critical path"}},
            {"ph": "M", "name": "process_sort_index", "pid": CRITICAL_PATH_PID, "args": {"sort_index": -1}}]
    return {r: Marks(flows[r], track[r]) for r in sorted(track)}


def path_line(steps: list[dict[str, Any]]) -> str:
    """One line on the slowest step's critical path: its length, and what takes most of it."""
    slow = max(steps, key=lambda p: p["duration_us"])
    top = ", ".join(f"`{kernel_label(t['name'], 80)}` on rank {t['rank']} ({t['kind']}) {t['share']:.0%}"
                    for t in slow["top"][:3])
    kinds = ", ".join(f"{k} {v / slow['path_us']:.0%}" for k, v in list(slow["by_kind"].items())[:3])
    return (f"critical path of the slowest step ({_step_name(slow)}, {slow['duration_us'] / 1e3:,.1f} ms, across "
            f"ranks {', '.join(slow['by_rank'])}): {kinds}; most of it: {top}")


def bound(steps: list[dict[str, Any]], launches: Mapping[str, Any] | None,
          idle_pct: float | None) -> dict[str, Any] | None:
    """What bounds the slowest step, from its critical path (``summary.json``'s ``bound``): GPU-bound when most of
    the path is GPU work (kernels, copies, collectives and the GPU's gaps between them, ``GPU_KINDS``), else
    host-bound, with the evidence (the GPU work by kernel category, or the host's biggest items, and the blocking
    calls that waited for the GPU); ``why``, a line where the launches (``launch_summary``) or the breakdown (the
    median rank's GPU idle %, ``idle_pct``) seem to say otherwise. None without a path."""
    if not steps:
        return None
    slow = max(steps, key=lambda p: p["duration_us"])
    total = slow["path_us"]
    share = slow["gpu_us"] / total if total else 0.0
    which = f"{_step_name(slow)}, {slow['duration_us'] / 1e3:,.1f} ms"
    delay = launches["median_launch_delay_us"] if launches else None
    why = None
    if share >= 0.5:
        transfer = slow["by_kind"].get("collective transfer", 0.0)
        gaps = slow["gpu_us"] - sum(slow["by_category"].values()) - transfer  # GPU idle between queued work, waits
        parts = sorted([*slow["by_category"].items(), ("collectives", transfer), ("gaps between GPU work", gaps)],
                       key=lambda kv: -kv[1])
        work = ", ".join(f"{c} {v / total:.0%}" for c, v in parts[:3] if v > 0)
        text = f"GPU-bound: {share:.0%} of the slowest step's critical path ({which}) is GPU work: {work}"
        if slow["syncs"]:
            text += f"; the host waits in `{slow['syncs'][0]}` for it"
        if idle_pct is not None and idle_pct > 50:
            why = (f"the GPU is idle {idle_pct:.0f}% of the trace (breakdown), yet the step waited for it: "
                   + (f"{gaps / total:.0%} of the path is gaps between GPU work already queued, held by what the "
                      f"trace does not show (another stream's event, the network, a copy), not by the host"
                      if gaps / total > 0.25 else "its idle time is in other steps, or in gaps the step's end did "
                                                   "not wait for"))
    else:
        host = [t for t in slow["top"] if t["kind"] not in GPU_KINDS and t["name"] != "GPU idle"][:3]
        items = ", ".join(f"`{kernel_label(t['name'], 80)}` {t['share']:.0%}" for t in host)
        text = f"host-bound: {1 - share:.0%} of the slowest step's critical path ({which}) is on the host: {items}"
        if delay is not None and delay > launches["cutoffs"]["launch_delay_us"]:
            why = (f"kernels wait {delay:,.0f} µs in their launch queues (median, launches), so the GPU is behind the "
                   f"host at times; yet the step's end waited for the host, not for that GPU work")
    return {"bound": "GPU" if share >= 0.5 else "host", "step": slow["step"], "gpu_share": round(share, 4),
            "text": text, "why": why}


def _step_name(step: Mapping[str, Any]) -> str:
    return "the whole trace" if step["step"] < 0 else f"ProfilerStep#{step['step']}"
