"""Lanes for the slices that Perfetto cannot nest on their thread (``--keep-overlaps`` leaves them as they are).

Perfetto's JSON importer draws a thread's slices as one stack: sorted by start (ties: complete slices first, the
longer first; then the others in file order), a slice closes every open slice that ended by its start and must
end by the end of the slice it then starts in. One that ends after it (a kernel under programmatic dependent
launch starts before the previous one ends on its stream) is drawn cut short or dropped. Here each such slice,
with the ``B``/``E`` pair it is, if it is one, moves to a lane: a thread of its own in the same process, named
after its thread (``stream 7 · overlap``, then ``stream 7 · overlap 2``), sorted right after it. A slice takes
the first lane (its own thread first) where it nests, so a second lane exists only when the first is taken. A
flow event moves with the slice that it binds to (the last slice to start at its time on its thread). Nothing
else changes: no slice moves in time, and a rank without such slices is written as before.

This runs on a rank's rewritten events, structs on the fast path and dicts on the general one, before they are
encoded; one pass of array operations finds the threads with a crossing, and only their slices are placed one by
one.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal
from itertools import compress
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import orjson
from msgspec import UNSET

from ..kineto.events import FLOW_PH, begin_end_pairs
from ..kineto.layout import LANE_OF, LANE_TID
from ..kineto.times import EXACT_FLOAT, to_ns, to_ns_array

__all__ = ["Kinds", "Slices", "column", "get", "slices", "starts_ns", "to_lanes", "tracks_of"]

_MARKS = frozenset(("s", "f", "t", "i", "I"))



@dataclass
class Kinds:
    """What the merge's fast path knows of a rank's events from their distinct ``(ph, pid, tid, cat)``: the events
    after the leading thread metadata (``body[first:]``) are of kind ``codes[i]``, kind ``k`` is ``keys[k]`` as
    read, and ``tracks[k]`` is the thread (``tracks_of``) of the complete slices of that kind after the rewrite (None:
    not known from the kinds alone, see ``fastpath._tracks``; the slices' own pid and tid are read)."""

    first: int
    codes: np.ndarray
    keys: list[tuple[Any, Any, Any, Any]]
    tracks: np.ndarray | None

    def present(self) -> list[tuple[Any, Any, Any, Any]]:
        """The kinds of the events (not every kind read is kept), in the order of ``keys``."""
        return self.present_in(self.codes, self.keys)

    @staticmethod
    def present_in(codes: np.ndarray, keys: list[tuple[Any, Any, Any, Any]]) -> list[tuple[Any, Any, Any, Any]]:
        """The ``keys`` that ``codes`` number, in their order."""
        return [keys[k] for k in np.flatnonzero(np.bincount(codes, minlength=len(keys))).tolist()]


@dataclass
class Slices:
    """A rank's slices after the merge's rewrite, as the lanes and the anomalies read them (``slices``): its ``X``
    events, then its ``B``/``E`` pairs (``_pairs``: ``(B, E, start ns, end ns)``), with their times in ns.
    ``tie`` orders the slices that open at one time (complete ones, the longer first, then ``B`` events); ``last``
    is the latest end of a closed slice or start of a pair: a ``B`` that no ``E`` closes ends at ``last + 1``, after
    every other slice (the anomalies end it as the analysis does); ``marks`` holds the flow and instant events.
    Where the fast path's ``kinds`` tell them: ``x_tracks``, the ``X`` events' threads (``tracks_of``), and
    ``mark_codes``, the marks' kinds."""

    x: list[Any]
    pairs: list[tuple[Any, Any, int, int | None]]
    start: np.ndarray
    end: np.ndarray
    tie: np.ndarray
    last: int
    marks: list[Any]  # the flow and instant events, which the anomalies read
    kinds: Kinds | None = None
    x_tracks: np.ndarray | None = None
    mark_codes: np.ndarray | None = None


def slices(body: list[Any], structs: bool, shifted: bool = True, kinds: Kinds | None = None) -> Slices:
    """The slices of ``body`` (one rank's events after the merge's rewrite). ``structs``: the events are the fast
    path's structs, not dicts; ``shifted``: whether the rewrite moved the rank's times (only then can a time be
    exact text); ``kinds``: the fast path's kinds of the events, which tell their phases and the slices' threads
    without a look at each event."""
    x_tracks = mark_codes = None
    if kinds is not None:
        rest, codes = body[kinds.first:], kinds.codes
        begins = any(k[0] == "B" for k in kinds.present())
        is_x = np.array([k[0] == "X" for k in kinds.keys], dtype=bool)[codes]
        is_mark = np.array([k[0] in _MARKS for k in kinds.keys], dtype=bool)[codes]
        x = rest if is_x.all() else list(compress(rest, is_x.tolist()))  # all X (the a100 shape): rest itself
        marks = list(compress(rest, is_mark.tolist())) if is_mark.any() else []
        mark_codes = codes[is_mark]
        if kinds.tracks is not None:
            x_tracks = kinds.tracks[codes[is_x]]
    else:
        phs = list(map(attrgetter("ph") if structs else itemgetter("ph"), body))
        begins = "B" in set(phs)
        x = list(compress(body, map("X".__eq__, phs)))
        marks = list(compress(body, map(_MARKS.__contains__, phs)))
    start = column(x, "ts", structs, shifted)
    end = start + column(x, "dur", structs)
    tie = start - end  # at one start: complete slices, the longer first, then B events (1) in file order
    pairs = _pairs([e for e in body if get(e, "ph") in ("B", "E")]) if begins else []
    last = max([int(end.max(initial=0)), *(t if t is not None else s for _, _, s, t in pairs)])
    if pairs:  # a B/E pair is a slice from its B to its E (a B that no E closes: to after every other slice)
        start = np.concatenate([start, np.array([s for _, _, s, _ in pairs], dtype=np.int64)])
        end = np.concatenate([end, np.array([last + 1 if t is None else t for *_, t in pairs], dtype=np.int64)])
        tie = np.concatenate([tie, np.ones(len(pairs), dtype=np.int64)])
    return Slices(x, pairs, start, end, tie, last, marks, kinds, x_tracks, mark_codes)


def to_lanes(body: list[Any], s: Slices, device_pids: set[int], structs: bool) -> tuple[int, list[dict[str, Any]]]:
    """Move the slices of ``body`` (one rank's events after the merge's rewrite; ``s``, its ``slices``) that cannot
    nest to lanes.

    Returns the number of slices moved (a B/E pair is one) and the thread metadata to add. The moved events get
    their lane's tid in place; ``thread_sort_index`` events of processes with lanes are dropped from ``body`` and
    given anew in the returned metadata (every thread of such a process gets one, so that its lanes sort after it).
    ``device_pids``: the merged pids of the rank's devices (their threads are streams); ``structs``: the events
    are the fast path's structs, not dicts.
    """
    x, pairs, start, end, tie = s.x, s.pairs, s.start, s.end, s.tie
    track = s.x_tracks if s.x_tracks is not None else tracks_of(column(x, "pid", structs), column(x, "tid", structs))
    if pairs:
        track = np.concatenate([track, tracks_of(np.array([get(b, "pid") for b, *_ in pairs], dtype=np.int64),
                                                 np.array([get(b, "tid") or 0 for b, *_ in pairs], dtype=np.int64))])
    bad = _crossed(track, start, end, tie)
    if not len(bad):
        return 0, []
    lanes = _place(np.flatnonzero(np.isin(track, bad)), track, start, end, tie)
    moved: dict[tuple[int, int, int], list[Any]] = defaultdict(list)  # (pid, tid, lane): the events it holds
    for i, k in sorted(lanes.items()):
        t = int(track[i])
        moved[(t >> 32, t & 0xFFFFFFFF, k)] += [x[i]] if i < len(x) else [e for e in pairs[i - len(x)][:2]
                                                                           if e is not None]
    pids = {pid for pid, _, _ in moved}
    mine = [e for e, pid in zip(body, map(attrgetter("pid") if structs else itemgetter("pid"), body)) if pid in pids]
    rows = list(map(attrgetter("ph", "pid", "tid"), mine)) if structs else [
        (e.get("ph"), e.get("pid"), e.get("tid")) for e in mine]
    rows = [(ph, p, p if not t else t) for ph, p, t in rows]  # Perfetto's thread of a tid 0 (or none): the pid's
    flows = _bound(mine, rows, lanes, (track, start, tie), structs)
    return len(lanes), _apply(body, mine, rows, moved, flows, device_pids)


def tracks_of(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """The thread of each slice as one int64, ``pid << 32 | tid``, where a tid 0 (or none) is the pid's, as in
    Perfetto."""
    return (pid << 32) | np.where(tid == 0, pid, tid)


def _crossed(track: np.ndarray, start: np.ndarray, end: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """The tracks where two slices cross (one starts inside the other and ends after it).

    Perfetto's order of opening and closing, as array operations: a track is properly nested when every slice
    is at the same depth of the stack at its close as at its open. Slices open in Perfetto's order; at one time
    the slices that end close first, the innermost (the last opened) first. A slice of no duration never crosses
    one. Opens and closes are placed among each other by one int64 key of (track, time).
    """
    keep = np.flatnonzero(end > start)
    if not len(keep):
        return keep
    track, start, end, tie = track[keep], start[keep], end[keep], tie[keep]
    by_track = np.argsort(track, kind="stable")  # few distinct values, mostly in runs: quick
    code = np.empty(len(track), dtype=np.int64)
    code[by_track] = np.concatenate([[0], np.cumsum(track[by_track][1:] != track[by_track][:-1])])
    t0 = int(start.min())
    span = int(end.max()) - t0 + 1
    if code.max() > 0 and (int(code.max()) + 1) * span >= 1 << 62:  # too far apart to share an int64 with the track
        return np.unique(np.concatenate([_crossed(track[code == c], start[code == c], end[code == c], tie[code == c])
                                         for c in range(int(code.max()) + 1)]))
    k_open = code * span + (start - t0)
    opens = np.argsort(k_open, kind="stable")
    tied = k_open[opens][1:] == k_open[opens][:-1]
    if tied.any():  # slices that open at one time: complete ones first, the longer first, then B events
        at = np.flatnonzero(np.concatenate([tied, [False]]) | np.concatenate([[False], tied]))
        rows = opens[at]
        opens[at] = rows[np.lexsort((rows, tie[rows], k_open[rows]))]
    n = len(start)
    k_open, k_end, track = k_open[opens], (code * span + (end - t0))[opens], track[opens]
    later_first = np.arange(n - 1, -1, -1)
    closes = later_first[np.argsort(k_end[later_first], kind="stable")]
    k_close = k_end[closes]
    after_open = np.arange(1, n + 1) - np.searchsorted(k_close, k_open, side="right")
    before_close = np.empty(n, dtype=np.int64)
    before_close[closes] = np.searchsorted(k_open, k_close, side="left") - np.arange(n)
    moved = after_open != before_close
    return np.unique(track[moved]) if moved.any() else track[:0]


def _place(rows: np.ndarray, track: np.ndarray, start: np.ndarray, end: np.ndarray,
           tie: np.ndarray) -> dict[int, int]:
    """The lane (1, 2, ...) of each of ``rows`` that cannot stay on its thread: each slice in Perfetto's order
    takes the first lane where it nests."""
    order = rows[np.lexsort((rows, tie[rows], start[rows], track[rows]))]
    lanes: dict[int, int] = {}
    stacks: list[list[int]] = []
    current = None
    for i, t, s, e in zip(order.tolist(), track[order].tolist(), start[order].tolist(), end[order].tolist()):
        if t != current:
            current, stacks = t, [[]]
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= s:
                stack.pop()
            if not stack or e <= stack[-1]:
                break
        else:
            k = len(stacks)
            stacks.append([])
        stacks[k].append(e)
        if k:
            lanes[i] = k
    return lanes


def _bound(mine: list[Any], rows: list[tuple[Any, Any, Any]], lanes: dict[int, int],
           slices: tuple[np.ndarray, ...], structs: bool) -> dict[int, int]:
    """The flow events among ``mine`` (the events of the processes with lanes, whose ``(ph, pid, tid)`` are
    ``rows``) that bind to a moved slice: ``id`` of the event to the slice's lane.

    Perfetto binds a flow event to the last slice to open at its time on its thread: complete slices open first,
    the longer first, then B events in file order. ``slices``: the track, start and tie (``to_lanes``) of every
    slice.
    """
    track, start, tie = slices
    tracks = {int(track[i]) for i in lanes}
    flows, keys = [], []
    for e, (ph, pid, tid) in zip(mine, rows):
        if ph in FLOW_PH and type(tid) is int and (pid << 32 | tid) in tracks:
            flows.append(e)
            keys.append(pid << 32 | tid)
    if not flows:
        return {}
    at = list(zip(keys, column(flows, "ts", structs).tolist()))
    found = np.flatnonzero(np.isin(track, list(tracks)) & np.isin(start, [ts for _, ts in at]))
    opener: dict[tuple[int, int], tuple[tuple[int, int, int], int]] = {}
    for i in found.tolist():
        key, opens = (int(track[i]), int(start[i])), (int(tie[i]), i)
        if key not in opener or opens > opener[key][0]:
            opener[key] = (opens, i)
    return {id(e): lanes[opener[key][1]] for e, key in zip(flows, at) if key in opener and opener[key][1] in lanes}


def _apply(body: list[Any], mine: list[Any], rows: list[tuple[Any, Any, Any]],
           moved: dict[tuple[int, int, int], list[Any]], flows: dict[int, int],
           device_pids: set[int]) -> list[dict[str, Any]]:
    """Give the ``moved`` events and the ``flows`` bound to them (``_bound``) their lanes' tids; the thread
    metadata to add: a name for each lane, and a sort index for each thread of a process with lanes (in place of
    its own, which this drops from ``body``), so that each lane sorts right after its thread. ``mine``: the
    events of those processes, whose ``(ph, pid, tid)`` are ``rows``."""
    pids = {pid for pid, _, _ in moved}
    tids: dict[int, set[int]] = {pid: set() for pid in pids}  # every tid of the processes with lanes
    for pid, tid in {(pid, tid) for _, pid, tid in rows if type(tid) is int}:
        tids[pid].add(tid)
    names: dict[tuple[int, Any], str] = {}
    sort_at: dict[tuple[int, Any], Any] = {}
    metas = [e for e, (ph, _, _) in zip(mine, rows) if ph == "M"]
    for e in metas:
        key, name, args = (get(e, "pid"), get(e, "tid")), get(e, "name"), _args(e)
        if name == "thread_name" and isinstance(args.get("name"), str):
            names.setdefault(key, args["name"].strip())
        elif name == "thread_sort_index" and type(args.get("sort_index")) in (int, float):
            sort_at.setdefault(key, args["sort_index"])
    lane_tid: dict[tuple[int, int, int], int] = {}
    by_track: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)  # each thread's lanes
    for pid in sorted(pids):
        free = LANE_TID
        for key in sorted(k for k in moved if k[0] == pid):
            while free in tids[pid]:
                free += 1
            lane_tid[key] = free
            by_track[key[:2]].append(key)
            free += 1
    for e, (_, pid, tid) in zip(mine, rows):
        lane = flows.get(id(e))
        if lane is not None:
            _set(e, "tid", lane_tid[(pid, tid, lane)])
    for key, events in moved.items():
        for e in events:
            _set(e, "tid", lane_tid[key])
    drop = {id(e) for e in metas if get(e, "name") == "thread_sort_index"}
    if drop:
        body[:] = [e for e in body if id(e) not in drop]
    meta: list[dict[str, Any]] = []
    for pid in sorted(pids):
        placed: list[tuple[int, str | None, int]] = []
        for tid in sorted(tids[pid], key=lambda t: (sort_at.get((pid, t), t), t)):
            placed.append((tid, None, tid))
            own = names.get((pid, tid)) or (f"stream {tid}" if pid in device_pids else f"thread {tid}")
            placed += [(lane_tid[key], f"{own} · overlap" + (f" {key[2]}" if key[2] > 1 else ""), tid)
                       for key in by_track.get((pid, tid), ())]
        for index, (tid, name, of) in enumerate(placed):
            if name is not None:
                meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                             "args": {"name": name, LANE_OF: of}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                         "args": {"sort_index": index}})
    return meta


def _pairs(marks: list[Any]) -> list[tuple[Any, Any, int, int | None]]:
    """The B/E pairs among ``marks`` as Perfetto pairs them, in the file order of their B: ``(B, E, start ns,
    end ns)``, where a B that no E closes has the E and the end None. Pairs on no thread (a pid or tid that is not
    an int) are left out."""
    times = [_ns1(get(e, "ts")) for e in marks]
    rows = [(i, get(e, "ph"), get(e, "pid"), get(e, "tid"), t, get(e, "name"), get(e, "cat"))
            for i, (e, t) in enumerate(zip(marks, times))]
    closed, unclosed, _ = begin_end_pairs(rows)
    ends: dict[int, int | None] = {b: e for b, e in closed}
    ends.update((b, None) for b in unclosed)
    return [(marks[b], None if e is None else marks[e], times[b], None if e is None else times[e])
            for b, e in sorted(ends.items())
            if type(get(marks[b], "pid")) is int and type(get(marks[b], "tid")) in (int, type(None))]


def starts_ns(events: list[Any], structs: bool) -> np.ndarray:
    """The exact ns of each event's ``ts``, as the merge rewrote it (structs or dicts; 0 where absent)."""
    return column(events, "ts", structs)


def column(events: list[Any], key: str, structs: bool, texts: bool = True) -> np.ndarray:
    """``key`` of every event as int64: pids and tids as they are, times as exact ns (0 where absent); ``texts``:
    whether a time may be exact text, which the merge writes for shifted times beyond 2**43 µs."""
    def values() -> Any:
        return map(attrgetter(key), events) if structs else (e.get(key) for e in events)

    times = key in ("ts", "dur")
    try:
        got = np.fromiter(values(), dtype=np.float64 if times else np.int64, count=len(events))
        if not times:
            return got
        # Beyond 2**43 µs the merge writes exact text (msgspec.Raw, orjson.Fragment), which a float cannot hold.
        if not texts or not len(got) or np.abs(got).max() < EXACT_FLOAT or set(map(type, values())) <= {int, float}:
            return to_ns_array(got)
    except (TypeError, ValueError, OverflowError):  # absent, or beyond int64
        pass
    return np.array([_ns1(v) for v in values()] if times else [_get_int(v) for v in values()], dtype=np.int64)


def _ns1(value: Any) -> int:
    """Exact ns of one µs time: a number, the exact text the merge writes above 2**43 µs, or absent (0)."""
    if value is None or value is UNSET:
        return 0
    if type(value) is int or type(value) is float:
        return to_ns(value)
    text = orjson.dumps(value) if isinstance(value, orjson.Fragment) else bytes(value)
    return int(Decimal(text.decode()) * 1000)


def _get_int(value: Any) -> int:
    return 0 if value is None or value is UNSET else value


def get(e: Any, key: str) -> Any:
    """``key`` of a struct or a dict event, None where absent."""
    if type(e) is dict:
        return e.get(key)
    value = getattr(e, key)
    return None if value is UNSET else value


def _set(e: Any, key: str, value: Any) -> None:
    if type(e) is dict:
        e[key] = value
    else:
        setattr(e, key, value)


def _args(e: Any) -> dict[str, Any]:
    """An event's args as a dict (the fast path keeps them as raw text)."""
    args = get(e, "args")
    if type(args) is not dict and args is not None:
        args = orjson.loads(bytes(args))
    return args if type(args) is dict else {}
