"""Per-rank rewrite rules of the merge (spec §6): pure functions, no IO, no Dask.

One rank's events go in; its filtered, re-identified, time-aligned events come
out. Nothing here knows about other ranks beyond the numbers the plan hands in
(the rank, its base time and the common output base).
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import numpy as np
import orjson

from .errors import MergeError, TraceFormatError
from .kineto.vocabulary import STEP, host_category, is_collective_call, is_comm_kernel, on_device
from .model import MergeOptions

__all__ = [
    "PID_BASE",
    "SLOTS_PER_RANK",
    "MAX_RANK",
    "RankEvents",
    "IdMap",
    "fmt_us",
    "is_device_event",
    "is_gpu_label",
    "is_merged",
    "out_pid",
    "split_merged",
    "to_ns",
    "to_ns_array",
    "us_text",
    "map_tid",
    "order_slots",
    "pid_maps",
    "process_metadata",
]

PID_BASE = 1 << 22
SLOTS_PER_RANK = 64
MAX_RANK = ((1 << 31) - PID_BASE) // SLOTS_PER_RANK - 1
_U32 = (1 << 32) - 1
_EXACT_FLOAT = float(1 << 43)  # below this a float's µs fraction still resolves 1 ns
_EXACT_NS = (1 << 43) * 1000
_MAX_US = 2**63 // 1000  # ns must fit Perfetto's int64
_FLOW_PH = frozenset({"s", "t", "f"})
_PROCESS_M = frozenset({"process_name", "process_labels", "process_sort_index"})
_STREAM = re.compile(r"(\d+)\s*$")
_ID_FIELDS = ("External id", "correlation")


def to_ns(value: Any) -> int:
    """Exact integer nanoseconds of a µs value as Kineto writes it (``%d.%03d``).

    ``round(v * 1000)`` is off by 1 ns for about 1% of real values; this is not.
    Below 2**43 µs (101 days) the float's fractional part is exact and within
    0.49 ns of the decimal text, so rounding the fraction alone is exact; above
    it, the shortest repr of the float is used.
    """
    t = type(value)
    if t is int:
        return value * 1000
    if t is float:
        if -_EXACT_FLOAT < value < _EXACT_FLOAT:
            i = int(value)
            return i * 1000 + round((value - i) * 1000)
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("not a finite number")
        return int((Decimal(repr(value)) * 1000).to_integral_value(ROUND_HALF_EVEN))
    raise TypeError(f"expected a number, got {t.__name__}")


def to_ns_array(us: np.ndarray) -> np.ndarray:
    """``to_ns`` of every value of a float64 array, as int64.

    Below 2**43 µs ``to_ns``'s float rule runs as array operations, which round as
    Python's do; the rare larger values go through ``to_ns`` itself.
    """
    whole = np.trunc(us)
    ns = whole.astype(np.int64) * 1000 + np.rint((us - whole) * 1000).astype(np.int64)
    big = np.flatnonzero(np.abs(us) >= _EXACT_FLOAT)
    if len(big):
        ns[big] = [to_ns(v) for v in us[big].tolist()]
    return ns


def us_text(ns: int) -> bytes:
    """Nanoseconds as µs text with exactly three decimals, Kineto's ``fmtTs``."""
    return b"%d.%03d" % divmod(ns, 1000)


def fmt_us(ns: int) -> orjson.Fragment:
    """``us_text`` as a value orjson writes as it is."""
    return orjson.Fragment(us_text(ns))


def out_pid(rank: int, slot: int) -> int:
    """The merged pid of a rank's ``slot``: ``2**22 + rank*64 + slot``."""
    return PID_BASE + rank * SLOTS_PER_RANK + slot


def is_merged(metadata: Any) -> bool:
    """True when a trace's ``metadata`` says tracefuse wrote it (a merged trace)."""
    return isinstance(metadata, dict) and "tracefuse" in metadata


def split_merged(events: list[Any]) -> dict[int, list[Any]]:
    """A tracefuse-merged trace's events per rank: ``args.rank``, else the rank its pid encodes."""
    parts: dict[int, list[Any]] = {}
    for ev in events:
        if type(ev) is not dict:
            continue
        args = ev.get("args")
        rank = args.get("rank") if type(args) is dict else None
        if type(rank) is not int:
            pid = ev.get("pid")
            if type(pid) is not int or pid < PID_BASE:
                continue
            rank = (pid - PID_BASE) // SLOTS_PER_RANK
        parts.setdefault(rank, []).append(ev)
    return parts


def map_tid(tid: Any) -> Any:
    """A tid Perfetto accepts: ints in [0, 2**32-1] stay; others become a stable int."""
    if type(tid) is int and 0 <= tid <= _U32:
        return tid
    if isinstance(tid, str):
        m = _STREAM.search(tid)
        if m and int(m.group(1)) <= _U32:
            return int(m.group(1))
    return zlib.crc32(str(tid).encode()) & 0x7FFFFFFF


def is_device_event(ev: dict[str, Any]) -> bool:
    """True for events that live on a device's timeline: kernels, memcpy/memset, GPU annotations, and events of
    another accelerator's category on a device stream (``vocabulary.on_device``)."""
    return on_device(ev.get("cat"), ev.get("args"))


def is_gpu_label(name: Any, args: Any) -> bool:
    """True for a process M event that names or labels its pid as a GPU (``"GPU 0"``)."""
    label = next(iter(args.values()), "") if type(args) is dict else ""
    return name in ("process_labels", "process_name") and type(label) is str and label.startswith("GPU")


def _is_comm(ev: dict[str, Any], dev: bool) -> bool:
    name = ev.get("name")
    if not isinstance(name, str):
        return False
    return is_collective_call(name) or (dev and is_comm_kernel(name, ev.get("args")))


@dataclass
class RankEvents:
    """One rank's events, scanned once: validated times, device flags and keep decisions.

    Parameters
    ----------
    events
        The rank's ``traceEvents``, as parsed.
    base
        The rank's ``baseTimeNanoseconds`` (0 for absolute-time traces).
    options
        The merge options (filters).
    who
        ``"<path> (rank N)"``, for error messages.
    window_abs_ns
        Absolute ``[start, end)`` in ns to keep, or None.
    link_flows
        Also link flow events to their anchors and decide which survive (what a
        merge needs). Without it (the analysis) flows stay kept and unlinked.
    """

    events: list[Any]
    base: int
    options: MergeOptions
    who: str
    window_abs_ns: tuple[int, int] | None = None
    link_flows: bool = True
    dev: list[bool] = field(init=False)
    keep: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self._scan()
        self._select()

    def _bad(self, i: int, what: str) -> TraceFormatError:
        return TraceFormatError(f"{self.who}: event #{i} {what}. Fix or drop that event, or drop this file")

    def _scan(self) -> None:
        """Validate the fields we read or rewrite, take exact ns times, classify pids."""
        events = self.events
        n = len(events)
        self.dev = dev = [False] * n
        host: set[int] = set()
        device: set[int] = set()
        other: set[Any] = set()  # string and negative pids
        labelled: dict[int, bool] = {}  # pids seen in M events -> labelled "GPU n"
        dev_tids: set[tuple[Any, Any]] = set()
        cat_dev: dict[Any, bool | None] = {}
        self.keep = keep = [True] * n
        drop_pyfunc = not self.options.include_pyfunc
        anchors: dict[tuple[Any, Any, Any], int] = {}
        twins: dict[tuple[Any, Any, Any], list[int]] = {}
        flows: list[int] = []
        link = self.link_flows
        for i, ev in enumerate(events):
            if type(ev) is not dict:
                raise self._bad(i, f"is a JSON {type(ev).__name__}, not an object")
            if drop_pyfunc and ev.get("cat") == "python_function":
                keep[i] = False  # dropped unread: nothing of it is used or rewritten
                continue
            ph = ev.get("ph")
            pid = ev.get("pid")
            tid = ev.get("tid")
            if type(ph) is not str:
                raise self._bad(i, f"has ph={ph!r}; expected a one-letter string such as \"X\"")
            if type(pid) is not int and type(pid) is not str:
                raise self._bad(i, f"has pid={pid!r}; expected an int or a string")
            if tid is not None and type(tid) is not int and type(tid) is not str:
                raise self._bad(i, f"has tid={tid!r}; expected an int or a string")
            if "id" in ev and type(ev["id"]) is not int and type(ev["id"]) is not str:
                raise self._bad(i, f"has id={ev['id']!r}; expected an int or a string")
            for key in ("name", "cat"):
                if key in ev and type(ev[key]) is not str:
                    raise self._bad(i, f"has {key}={ev[key]!r}; expected a string")
            ts = ev.get("ts")
            tt = type(ts)
            if not (((tt is float or tt is int) and -_MAX_US < ts < _MAX_US) or (ts is None and ph == "M")):
                raise self._bad(i, f"has ts={ts!r}; expected a number of µs within ±2**63 ns")
            if "dur" in ev:
                d = ev["dur"]
                td = type(d)
                if not ((td is float or td is int) and 0 <= d < _MAX_US):
                    why = "a negative" if (td is float or td is int) and d < 0 else "a bad"
                    raise self._bad(i, f"has {why} dur={d!r}; expected a finite number of µs >= 0")
            if type(pid) is str or pid < 0:
                other.add(pid)
            elif ph == "M":  # a pid named, labelled or with named threads but no events still has a slot
                labelled[pid] = labelled.get(pid, False) or is_gpu_label(ev.get("name"), ev.get("args"))
            if ph == "M":
                continue
            if ph in _FLOW_PH:
                flows.append(i)
                continue
            cat = ev.get("cat")
            if cat not in cat_dev:
                host_cat = host_category(cat)
                cat_dev[cat] = None if host_cat is None else not host_cat
            is_dev = cat_dev[cat]
            if is_dev is None:  # a category the vocabulary does not know: device work on a device stream
                is_dev = on_device(cat, ev.get("args"))
            if type(pid) is str or pid < 0:
                pass
            elif is_dev:
                dev[i] = True
                device.add(pid)
                dev_tids.add((pid, tid))
            else:
                host.add(pid)
            if ph == "X" and link:
                key = (pid, tid, ts)
                if anchors.setdefault(key, i) != i:
                    twins.setdefault(key, []).append(i)
        for pid, is_gpu in labelled.items():
            if pid not in host and pid not in device:
                (device if is_gpu else host).add(pid)
        for i in flows:  # a pid that carries only flow events still needs a process
            pid = events[i]["pid"]
            if type(pid) is int and pid >= 0 and pid not in host and pid not in device:
                host.add(pid)
        self._pids = (host, device, other)
        self._dev_tids = dev_tids
        self._anchors = (anchors, twins, flows)

    def _step_spans(self) -> list[tuple[int, int]]:
        lo, hi = self.options.steps  # type: ignore[misc]
        spans = []
        for i, ev in enumerate(self.events):
            name = ev.get("name")
            if self.keep[i] and ev["ph"] == "X" and type(name) is str and not self.dev[i]:
                m = STEP.match(name)
                if m and lo <= int(m.group(1)) <= hi:
                    start = to_ns(ev["ts"])
                    spans.append((start, start + to_ns(ev.get("dur", 0))))
        return spans

    def _launch_times(self) -> dict[Any, int]:
        launches: dict[Any, int] = {}
        for i, ev in enumerate(self.events):
            args = ev.get("args")
            if self.keep[i] and not self.dev[i] and type(args) is dict and "ts" in ev:
                corr = args.get("correlation")
                if type(corr) is int or type(corr) is str:
                    launches.setdefault(corr, to_ns(ev["ts"]))
        return launches

    def _passes(self, i: int, ev: dict[str, Any], spans: list[tuple[int, int]] | None,
                launches: dict[Any, int] | None, flow: bool) -> bool:
        opts = self.options
        dev = self.dev[i]
        if not flow:
            if not opts.include_pyfunc and ev.get("cat") == "python_function":
                return False
            if opts.keep and not (
                ("gpu" in opts.keep and dev)
                or ("cpu" in opts.keep and not dev)
                or ("comm" in opts.keep and _is_comm(ev, dev))
            ):
                return False
        t = to_ns(ev["ts"])
        if spans is not None:
            if dev and launches:
                args = ev.get("args")
                corr = args.get("correlation") if type(args) is dict else None
                if type(corr) is int or type(corr) is str:
                    t = launches.get(corr, t)
            if not any(s <= t < e for s, e in spans):
                return False
        if self.window_abs_ns is not None:
            w0, w1 = self.window_abs_ns
            if not w0 <= self.base + to_ns(ev["ts"]) < w1:
                return False
        if opts.filter_fn is not None:
            try:
                return bool(opts.filter_fn(ev))
            except MergeError:
                raise
            except Exception as e:
                raise MergeError(f"{self.who}: filter_fn raised {type(e).__name__}: {e} on event #{i}; "
                                 "fix the filter function") from e
        return True

    def _select(self) -> None:
        events, keep, dev = self.events, self.keep, self.dev
        opts = self.options
        anchors, twins, flows = self._anchors
        if opts.keep or opts.steps or self.window_abs_ns is not None or opts.filter_fn:
            spans = self._step_spans() if opts.steps else None
            launches = self._launch_times() if spans is not None else None
            for i, ev in enumerate(events):
                if keep[i] and ev["ph"] != "M" and ev["ph"] not in _FLOW_PH:
                    keep[i] = self._passes(i, ev, spans, launches, False)
        else:
            spans = launches = None
        if not self.link_flows:
            return
        # A flow survives only when every one of its ends survives.
        alive: dict[tuple[Any, Any, Any], bool] = {}
        for i in flows:
            ev = events[i]
            key = (ev["pid"], ev.get("tid"), ev["ts"])
            a = anchors.get(key)
            if a is not None:
                ok = keep[a] or any(keep[j] for j in twins.get(key, ()))
                dev[i] = dev[a]
            else:
                ok = self._passes(i, ev, spans, launches, True)
            fkey = (ev.get("cat"), ev.get("name"), ev.get("id"))
            alive[fkey] = alive.get(fkey, True) and ok
        for i in flows:
            ev = events[i]
            keep[i] = alive[(ev.get("cat"), ev.get("name"), ev.get("id"))]

    def earliest_ns(self, kept_only: bool) -> int | None:
        """The earliest absolute time (ns) over kept, or all read, non-metadata events."""
        unread = None if self.options.include_pyfunc else "python_function"
        times = (to_ns(ev["ts"]) for i, ev in enumerate(self.events)
                 if ev["ph"] != "M" and (self.keep[i] or (not kept_only and ev.get("cat") != unread)))
        best = min(times, default=None)
        return None if best is None else self.base + best

    def rewrite(self, rank: int, base_out: int) -> tuple[list[Any], list[Any]]:
        """The rank's merged events, as ``(head, body)``.

        ``head`` holds the process metadata (names and sort order of the pids
        that are shown); ``body`` the thread metadata, then the kept events in
        input order.

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
            raise MergeError(f"{self.who}: rank {rank} is outside 0..{MAX_RANK}, the range the pid layout holds")
        events, keep, dev = self.events, self.keep, self.dev
        slots = order_slots(*self._pids, self.who)
        host_map, dev_map = pid_maps(rank, slots)
        dev_tids = self._dev_tids
        shift = self.base - base_out
        exact = _EXACT_NS
        id_map = IdMap(rank, (ev["id"] for i, ev in enumerate(events) if keep[i] and "id" in ev))
        field_maps = (
            {f: IdMap(rank, (ev["args"][f] for i, ev in enumerate(events) if keep[i]
                              and type(ev.get("args")) is dict and type(ev["args"].get(f)) in (int, str)))
             for f in _ID_FIELDS}
            if self.options.rewrite_ids
            else None
        )
        annotate = self.options.annotate_rank
        used: set[int] = set()
        body: list[Any] = []
        threads: list[Any] = []
        seen_thread_names: set[tuple[int, Any]] = set()
        u32 = _U32
        for i, ev in enumerate(events):
            if not keep[i]:
                continue
            ph = ev["ph"]
            pid = ev["pid"]
            if ph == "M":
                if ev.get("name") in _PROCESS_M:
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
                        raise self._early(i, ev, -out)
                    ev["ts"] = out / 1000 if out < exact else fmt_us(out)
                elif ts < 0:
                    raise self._early(i, ev, -to_ns(ts))
            if "id" in ev:
                ev["id"] = id_map[ev["id"]]
            if ph == "M":
                if ev.get("name") == "thread_name":
                    key = (new_pid, ev.get("tid"))
                    if key in seen_thread_names:
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
        head, shown_pids = process_metadata(rank, slots, used, self.options.keep_empty_processes)
        return head, [ev for ev in threads if ev["pid"] in shown_pids] + body

    def _early(self, i: int, ev: dict[str, Any], ns: int) -> MergeError:
        return MergeError(
            f"{self.who}: event #{i} ({ev.get('name')!r}) would land {ns} ns before the merged base time; its "
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
        if all(type(v) is int and 0 <= v <= _U32 for v in distinct):
            self.dense = None
        else:
            order = sorted(distinct, key=lambda v: (type(v).__name__, v))
            self.dense = {v: k for k, v in enumerate(order)}

    def __getitem__(self, value: Any) -> int:
        return self.high | (value if self.dense is None else self.dense[value])
