"""Per-rank rewrite rules of the merge (spec §6): pure functions, no IO, no Dask.

One rank's events go in, as ``kineto.events.RankEvents`` has read and selected them; its
re-identified, time-aligned events come out. Nothing here knows about other ranks beyond the
numbers the plan hands in (the rank, its base time and the common output base).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import MergeError
from ..kineto.events import RankEvents
from ..kineto.layout import MAX_RANK, SLOTS_PER_RANK, U32, map_tid, out_pid
from ..kineto.times import EXACT_NS, fmt_us, to_ns
from ..kineto.vocabulary import (
    QUEUE_CALLS,
    STEP,
    device_kind,
    is_collective_call,
    kernel_type,
)
from ..model import Marks
from .lanes import starts_ns

__all__ = ["PROCESS_M", "IdMap", "counter_events", "device_pids", "estimates", "order_slots", "pid_maps",
           "process_metadata", "rewrite"]

PROCESS_M = frozenset({"process_name", "process_labels", "process_sort_index"})
_ID_FIELDS = ("External id", "correlation")


def rewrite(sel: RankEvents, rank: int, base_out: int, marks: Marks | None = None,
            counter_series: Callable[..., tuple[Any, Any]] | None = None) -> tuple[list[Any], list[Any]]:
    """The rank's merged events, as ``(head, body)``.

    ``head`` holds the process metadata (names and sort order of the pids
    that are shown); ``body`` the thread metadata, then the kept events in
    input order, then the ``marks``, placed as the rank's events are, then
    with ``options.counters`` the counter tracks (``counter_events``, whose
    series ``counter_series`` computes).

    Times that need no shift keep their parsed value, which is already exact.
    Shifted times are written as the float nearest to the exact µs value,
    whose shortest text is that value while it is below 2**43 µs, and as
    ``%d.%03d`` text above that. ``dur`` never changes.

    Raises
    ------
    MergeError
        When the rank is too large, has more than 64 processes, or an event
        would land before the merged base time.
    """
    if not 0 <= rank <= MAX_RANK:
        raise MergeError(f"{sel.who}: rank {rank} is outside 0..{MAX_RANK}, the range the pid layout holds")
    events, keep, dev = sel.events, sel.keep, sel.dev
    slots = order_slots(*sel.pids, sel.who)
    host_map, dev_map = pid_maps(rank, slots)
    dev_tids = sel.dev_tids
    shift = sel.base - base_out
    exact = EXACT_NS
    id_map = IdMap(rank, (ev["id"] for i, ev in enumerate(events) if keep[i] and "id" in ev))
    field_maps = _field_maps(events, keep, rank) if sel.options.rewrite_ids else None
    annotate = sel.options.annotate_rank
    # from the events as read: the loop below rewrites them in place
    counters = counter_events(sel, dev_map, shift, counter_series) if sel.options.counters else []
    used: set[int] = set()
    body: list[Any] = []
    threads: list[Any] = []
    seen_thread_names: set[tuple[int, Any]] = set()
    u32 = U32
    for i, ev in enumerate(events):
        if not keep[i]:
            continue
        ph = ev["ph"]
        pid = ev["pid"]
        if ph == "M":
            if ev.get("name") in PROCESS_M:
                sel.left_out["process_metadata"] += 1
                continue
            new_pid = ev["pid"] = (dev_map if (pid, ev.get("tid")) in dev_tids else host_map)[pid]
        else:
            new_pid = ev["pid"] = (dev_map if dev[i] else host_map)[pid]
            used.add(new_pid)
        if "tid" in ev:
            tid = ev["tid"]
            if type(tid) is not int or not 0 <= tid <= u32:
                ev["tid"] = map_tid(tid)
        ts = ev.get("ts")
        if ts is not None:
            if shift:
                out = to_ns(ts) + shift
                if out < 0:
                    raise _early(sel, i, ev, -out)
                ev["ts"] = out / 1000 if out < exact else fmt_us(out)
            elif ts < 0:
                raise _early(sel, i, ev, -to_ns(ts))
        if "id" in ev:
            ev["id"] = id_map[ev["id"]]
        if ph == "M":
            if ev.get("name") == "thread_name":
                key = (new_pid, ev.get("tid"))
                if key in seen_thread_names:
                    sel.left_out["thread_metadata"] += 1
                    continue
                seen_thread_names.add(key)
            threads.append(ev)
            continue
        if (ph == "i" or ph == "I") and ev.get("s") == "g":
            ev["s"] = "p"
        args = ev.get("args")
        if annotate:
            if args is None:
                ev["args"] = {"rank": rank}
            elif type(args) is dict:
                args["rank"] = rank
        if field_maps is not None and type(args) is dict:
            for f, m in field_maps.items():
                v = args.get(f)
                if type(v) is int or type(v) is str:
                    args[f + "_raw"] = v
                    args[f] = m[v]
        body.append(ev)
    if marks is not None:
        body += _placed(marks, rank, (host_map, dev_map), dev_tids, shift)
    body.extend(counters)
    head, shown_pids = process_metadata(rank, slots, used, sel.options.keep_empty_processes)
    shown = [ev for ev in threads if ev["pid"] in shown_pids]
    sel.left_out["thread_metadata"] += len(threads) - len(shown)
    return head, shown + body


def _field_maps(events: list[Any], keep: Any, rank: int) -> dict[str, IdMap]:
    """``--rewrite-ids``: a map of each of ``_ID_FIELDS`` in the kept events' ``args`` (ints and strings)."""
    return {f: IdMap(rank, (ev["args"][f] for i, ev in enumerate(events) if keep[i]
                            and type(ev.get("args")) is dict and type(ev["args"].get(f)) in (int, str)))
            for f in _ID_FIELDS}


def _placed(marks: Marks, rank: int, maps: tuple[dict[Any, int], dict[Any, int]], dev_tids: Any,
            shift: int) -> list[dict[str, Any]]:
    """Copies of the ``marks`` (the task's stay as given), placed as the rank's events are: their pids and tids
    mapped, their flow ids made the rank's, their times moved by ``shift`` ns; ``maps``: the host and device pid
    maps."""
    host_map, dev_map = maps
    flows = [{**ev, "pid": (dev_map if (ev["pid"], ev["tid"]) in dev_tids else host_map)[ev["pid"]],
              "tid": map_tid(ev["tid"]), "id": (rank << 32) | ev["id"]} for ev in marks.flows]
    placed = [*flows, *(dict(ev) for ev in marks.track)]
    for ev in placed:
        if "ts" in ev:
            out = ev["ts"] + shift
            ev["ts"] = out / 1000 if out < EXACT_NS else fmt_us(out)
    return placed


def counter_events(sel: RankEvents, dev_map: dict[Any, int], shift: int,
                   counter_series: Callable[..., tuple[Any, Any]] | None) -> list[dict[str, Any]]:
    """The rank's counter tracks (``--counters``, as HTA's ``generate_trace_with_counters`` adds them) as Chrome
    ``C`` events, from its kept events before ``rewrite`` changes them.

    Per device pid, in order: each stream's queue length (name ``Queue length``, args ``{"stream 7": n}``), then
    each copy kind's memory bandwidth (``Memcpy BW (GB/s)``, args ``{"Memcpy HtoD": x}``); Perfetto names a track
    by the name and the arg's key, ``Queue length stream 7``, ``Memcpy BW (GB/s) Memcpy HtoD``.
    ``counter_series`` (the analysis's ``analysis.per_rank.counters.counter_series``) computes the series, so that they are those
    of the analysis's ``queue_length`` and ``memory_bw`` tables; this side only picks the events and places the
    samples. Perfetto keys a counter track by its process and its name plus the arg's key (``json_trace_parser.cc``,
    case ``'C'``): the event needs no tid and the device's merged pid makes each track the rank's own. A sample is
    shifted as the marks are, and one without a value (a copy whose bandwidth the trace does not give) is left
    out, as JSON has no NaN.

    The queue counts each device event whose launch (the first kept host event with its ``args.correlation``)
    is a ``QUEUE_CALLS`` call: both must be kept, so filters that drop the calls (``--keep gpu``) leave no queue.

    Raises
    ------
    MergeError
        When ``counter_series`` is missing.
    """
    if counter_series is None:
        raise MergeError(f"{sel.who}: counters=True needs the analysis's counter series; merge through "
                         "tracefuse_dask.merge_traces, which passes them")
    events, keep, dev = sel.events, sel.keep, sel.dev
    calls: dict[Any, int] = {}
    work: list[int] = []
    for i, ev in enumerate(events):
        if keep[i] and ev["ph"] == "X":
            if dev[i]:
                work.append(i)
                continue
            args = ev.get("args")
            corr = args.get("correlation") if type(args) is dict else None
            if type(corr) is int or type(corr) is str:
                calls.setdefault(corr, i)
    per_device: dict[int, tuple[list[Any], ...]] = {}
    for i in work:  # device work on a stream, as the analysis has it (``analysis.per_rank.rank._gpu_arrays``)
        ev = events[i]
        name, args = ev.get("name", ""), ev.get("args")
        if type(args) is not dict:
            args = {}
        stream = args.get("stream")
        stream = stream if type(stream) is int else map_tid(ev.get("tid"))
        if device_kind(ev.get("cat"), name, args) is None or stream == -1:
            continue
        q_call, q_gpu, q_stream, m_start, m_end, m_name, m_gbps = per_device.setdefault(
            ev["pid"], ([], [], [], [], [], [], []))
        start = to_ns(ev["ts"])
        corr = args.get("correlation")
        call = calls.get(corr) if type(corr) is int or type(corr) is str else None
        if call is not None and events[call].get("name") in QUEUE_CALLS:
            q_call.append(to_ns(events[call]["ts"]))
            q_gpu.append(start)
            q_stream.append(stream)
        if kernel_type(name) == "MEMORY":
            gbps = args.get("memory bandwidth (GB/s)")
            m_start.append(start)
            m_end.append(start + to_ns(ev.get("dur", 0)))
            m_name.append(name)
            m_gbps.append(float(gbps) if type(gbps) is int or type(gbps) is float else float("nan"))
    out: list[dict[str, Any]] = []
    exact = EXACT_NS
    for pid in sorted(per_device):
        q_call, q_gpu, q_stream, m_start, m_end, m_name, m_gbps = per_device[pid]
        queue, memory = counter_series(np.array(q_call, dtype=np.int64), np.array(q_gpu, dtype=np.int64), q_stream,
                                       np.array(m_start, dtype=np.int64), np.array(m_end, dtype=np.int64), m_name,
                                       np.array(m_gbps, dtype=np.float64))
        new_pid = dev_map[pid]
        for series, group, track, key in ((queue, "stream", "Queue length", "stream {}"),
                                          (memory, "kind", "Memcpy BW (GB/s)", "{}")):
            for g, t, value in zip(series[group].tolist(), series["t"].tolist(), series["value"].tolist()):
                if not math.isnan(value):
                    ts = t + shift
                    out.append({"ph": "C", "name": track, "pid": new_pid, "ts": ts / 1000 if ts < exact else fmt_us(ts),
                                "args": {key.format(g): value}})
    return out


def _early(sel: RankEvents, i: int, ev: dict[str, Any], ns: int) -> MergeError:
    return MergeError(
        f"{sel.who}: event #{i} ({ev.get('name')!r}) would land {ns} ns before the merged base time; its "
        "ts is earlier than its file's baseTimeNanoseconds allows. Check that the file's ts are relative "
        "to its baseTimeNanoseconds"
    )


def order_slots(host: set[int], device: set[int], other: set[Any], who: str) -> list[tuple[str, Any]]:
    """A rank's distinct pids as slots: host, device, string, negative; a pid with both kinds splits.

    Raises
    ------
    MergeError
        When the rank has more than ``SLOTS_PER_RANK`` processes.
    """
    strings = sorted(p for p in other if type(p) is str)
    negative = sorted((p for p in other if type(p) is int), reverse=True)
    slots = ([("h", p) for p in sorted(host)] + [("d", p) for p in sorted(device)]
             + [("s", p) for p in strings] + [("n", p) for p in negative])
    if len(slots) > SLOTS_PER_RANK:
        raise MergeError(f"{who}: {len(slots)} distinct processes, more than the {SLOTS_PER_RANK} "
                         "a rank can hold; is this a merged trace or several jobs in one file?")
    return slots


def pid_maps(rank: int, slots: list[tuple[str, Any]]) -> tuple[dict[Any, int], dict[Any, int]]:
    """The merged pid of each input pid, for host events and for device events.

    The two differ only for a pid that carries both kinds, which has a slot of each.
    """
    host_map: dict[Any, int] = {}
    dev_map: dict[Any, int] = {}
    for j, (kind, pid) in enumerate(slots):
        (dev_map if kind == "d" else host_map)[pid] = out_pid(rank, j)
    for pid, new in list(host_map.items()):
        dev_map.setdefault(pid, new)
    for pid, new in dev_map.items():
        host_map.setdefault(pid, new)
    return host_map, dev_map


def estimates(head: list[dict[str, Any]], body: list[Any], devices: set[int], encode: Callable[[Any], bytes],
              structs: bool) -> tuple[int, dict[int, int]]:
    """About how many bytes of JSON a narrower merge would write of a rank's merged ``head`` and events ``body``
    (structs or dicts), for a merge too big to open: ``--keep gpu,comm`` (its device work and collective calls,
    and the metadata of the processes that hold them; not the flows, whose launch end it leaves out), and
    ``--steps N-N`` for each ``ProfilerStep#N`` (the events that start in its span, device work too by its own
    start, not the launch's that ``--steps`` goes by; without the metadata)."""
    def get(e: Any, key: str) -> Any:
        return e.get(key) if type(e) is dict else getattr(e, key)

    work = [e for e in body if get(e, "ph") not in ("M", "s", "t", "f") and (
        get(e, "pid") in devices or (type(get(e, "name")) is str and is_collective_call(get(e, "name"))))]
    shown = {get(e, "pid") for e in work}
    meta = [e for e in head + [e for e in body if get(e, "ph") == "M"] if get(e, "pid") in shown]
    timed = [e for e in body if get(e, "ph") != "M"]
    at = starts_ns(timed, structs)
    spans = sorted(((int(m.group(1)), int(at[i]), int(at[i]) + to_ns(get(e, "dur") or 0))
                    for i, e in enumerate(timed) if get(e, "ph") == "X" and type(get(e, "name")) is str
                    and (m := STEP.match(get(e, "name")))), key=itemgetter(1))
    steps: dict[int, int] = {}
    if spans:
        begin = np.array([b for _, b, _ in spans], dtype=np.int64)
        k = np.searchsorted(begin, at, side="right") - 1
        inside = (k >= 0) & (at < np.array([e for _, _, e in spans], dtype=np.int64)[np.maximum(k, 0)])
        for j in np.unique(k[inside]).tolist():
            steps[spans[j][0]] = len(encode([timed[i] for i in np.flatnonzero(inside & (k == j)).tolist()]))
    return len(encode(meta + work)), steps


def device_pids(rank: int, slots: list[tuple[str, Any]]) -> set[int]:
    """The merged pids of the rank's devices."""
    return {out_pid(rank, j) for j, (kind, _) in enumerate(slots) if kind == "d"}


def process_metadata(rank: int, slots: list[tuple[str, Any]], used: set[int],
                     keep_empty: bool) -> tuple[list[dict[str, Any]], set[int]]:
    """The rank's ``process_name`` and ``process_sort_index`` events, and the pids they show.

    A slot is shown when one of its events is kept, or always with ``keep_empty``.
    """
    shown = range(len(slots)) if keep_empty else sorted(j for j in range(len(slots)) if out_pid(rank, j) in used)
    head: list[dict[str, Any]] = []
    for j in shown:
        pid = out_pid(rank, j)
        head.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                     "args": {"name": _process_name(rank, slots[j])}})
        head.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                     "args": {"sort_index": rank * SLOTS_PER_RANK + j}})
    return head, {out_pid(rank, j) for j in shown}


def _process_name(rank: int, slot: tuple[str, Any]) -> str:
    kind, pid = slot
    if kind == "h":
        return f"rank {rank} · CPU (pid {pid})"
    if kind == "d":
        return f"rank {rank} · GPU {pid}"
    if kind == "s":
        return f"rank {rank} · {pid or '(unnamed)'}"
    return f"rank {rank} · CPU overhead" if pid == -1 else f"rank {rank} · pid {pid}"


class IdMap:
    """``(rank << 32) | id`` when every id of the rank is an int below 2**32, else a dense remap."""

    def __init__(self, rank: int, ids: Any) -> None:
        self.high = rank << 32
        distinct = set(ids)
        if all(type(v) is int and 0 <= v <= U32 for v in distinct):
            self.dense = None
        else:
            order = sorted(distinct, key=lambda v: (type(v).__name__, v))
            self.dense = {v: k for k, v in enumerate(order)}

    def __getitem__(self, value: Any) -> int:
        return self.high | (value if self.dense is None else self.dense[value])
