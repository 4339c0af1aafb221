"""The fast path of the per-rank rewrite: msgspec structs, ``args`` kept as raw JSON text.

Parsing every event into a dict (and its ``args`` into another) is most of the
cost of a merge. Here events decode into slotted structs that the garbage
collector does not track, and each ``args`` object stays the exact text of the
input: only ``"rank":N`` is spliced in. The rules are those of ``rewrite.py``,
whose helpers this module shares.

The fast path takes only what it can rewrite exactly as the general path does:
the default filters (``include_pyfunc`` and ``keep_empty_processes`` aside) and
well-formed events with no field beyond Kineto's. For anything else
``rewrite_fast`` returns None and the caller runs the general path, which also
gives the error messages. Which path runs depends only on the input and the
options, so the output stays deterministic.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress, count
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import orjson
from msgspec import UNSET, Raw, Struct, UnsetType

from ..errors import MergeError
from ..kineto.events import FLOW_PH, decode_or_none, is_gpu_label
from ..kineto.layout import MAX_RANK, U32, map_tid
from ..kineto.times import (
    EXACT_FLOAT,
    EXACT_NS,
    Duration,
    Micros,
    to_ns,
    to_ns_array,
    us_text,
)
from ..kineto.vocabulary import KnownCategory, KnownPhase, host_category, on_device
from ..model import MergeOptions
from .anomalies import rank_anomalies
from .lanes import Kinds, slices, to_lanes, tracks_of
from .rewrite import (
    PROCESS_M,
    IdMap,
    device_pids,
    estimates,
    order_slots,
    pid_maps,
    process_metadata,
)

__all__ = ["account_fast", "handles", "rewrite_fast", "rewritten_fast"]


class _Event(Struct, kw_only=True, gc=False, forbid_unknown_fields=True, omit_defaults=True):
    """One Kineto event; any other field, a missing ``ts`` or a wrong type sends the rank to the general path."""

    ph: str
    cat: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    pid: int | str
    tid: int | str | UnsetType = UNSET
    ts: Micros
    dur: Duration | UnsetType = UNSET
    id: int | str | UnsetType = UNSET
    bp: str | UnsetType = UNSET
    s: str | UnsetType = UNSET
    args: Raw | UnsetType = UNSET


class _Trace(Struct, gc=False):
    traceEvents: list[_Event]


class _KinetoEvent(_Event):
    """An event whose ph and cat are among the vocabulary's Literals: decoded as their shared strings."""

    ph: KnownPhase  # type: ignore[assignment]
    cat: KnownCategory | UnsetType = UNSET  # type: ignore[assignment]


class _KinetoTrace(_Trace):
    traceEvents: list[_KinetoEvent]  # type: ignore[assignment]


_decoders = (msgspec.json.Decoder(_KinetoTrace), msgspec.json.Decoder(_Trace))
_encoder = msgspec.json.Encoder()
_PH_PID_TID_CAT = attrgetter("ph", "pid", "tid", "cat")
_TID, _TS, _ID = attrgetter("tid"), attrgetter("ts"), attrgetter("id")
_INSTANT_PH = ("i", "I")


def handles(options: MergeOptions, window_abs_ns: tuple[int, int] | None) -> bool:
    """True when ``options`` keep every event but ``python_function`` ones and add none: what the fast path does
    (``counters`` adds counter events, which the general path computes from the events as dicts)."""
    return not (options.keep or options.steps or options.filter_fn or options.rewrite_ids or options.counters
                or window_abs_ns is not None)


def rewrite_fast(data: bytes, rank: int, base: int, base_out: int, options: MergeOptions, who: str,
                 left_out: Counter[str], anomalies: dict[str, int], estimate_keep: bool = False
                 ) -> tuple[bytes, bytearray, int, int, int, tuple[int, dict[int, int]] | None] | None:
    """Rewrite one rank's trace text as ``RankEvents.rewrite`` would (``rewritten_fast``), with the slices that
    cannot nest on lanes (``lanes.to_lanes``, unless ``options.keep_overlaps``), as JSON text; or None to use the
    general path. ``left_out`` counts the events left out by each reason (``model.LEFT_OUT``'s names) and
    ``anomalies`` gets those of the events kept (``anomalies.rank_anomalies``); ``estimate_keep`` also measures
    the JSON that ``--keep gpu,comm`` and each step's ``--steps`` would write (``rewrite.estimates``).

    Returns
    -------
    tuple or None
        ``(head, body, events_in, events_out, on_lanes, estimates)``: the process metadata events and
        the other events, each as JSON array text (``body`` in a bytearray, which the
        caller may change in place), the number of slices moved to lanes, and with ``estimate_keep`` the sizes of
        what ``--keep gpu,comm`` and each step would write (``rewrite.estimates``; else None); None when the input needs the general path.
    """
    got = rewritten_fast(data, rank, base, base_out, options, who, left_out=left_out)
    if got is None:
        return None
    head, body, n_in, slots, kinds = got
    moved = _lanes(body, rank, slots, kinds, base != base_out, left_out, anomalies, not options.keep_overlaps)
    text = bytearray()
    _encoder.encode_into(body, text)
    narrower = estimates(head, body, device_pids(rank, slots), _encoder.encode, True) if estimate_keep else None
    return orjson.dumps(head), text, n_in, len(head) + len(body), moved, narrower


def _lanes(body: list[Any], rank: int, slots: list[tuple[str, Any]], kinds: Kinds, shifted: bool,
           left_out: Counter[str], anomalies: dict[str, int], lanes: bool) -> int:
    """The anomalies of ``rewritten_fast``'s events (``kinds``, their kinds), into ``anomalies``, and with
    ``lanes`` their slices that cannot nest moved to lanes (``lanes.to_lanes``), in place: the number of slices
    moved."""
    n = len(body)
    s = slices(body, structs=True, shifted=shifted, kinds=kinds)
    devices = device_pids(rank, slots)
    anomalies.update(rank_anomalies(body, s, devices, True, shifted, 0))
    if not lanes:
        return 0
    moved, threads = to_lanes(body, s, devices, structs=True)
    left_out["thread_metadata"] += n - len(body)
    body += threads
    return moved


def account_fast(data: bytes, who: str, before: Callable[[list[Any]], None] | None = None
                 ) -> tuple[int, int, int, Counter[str], dict[str, int]] | None:
    """What a merge with the default options would make of one rank's trace text, without encoding it
    (``tracefuse info``'s account): ``(events_in, events_out, on_lanes, left_out, anomalies)``; None when the
    input needs the general path. ``before`` as for ``rewritten_fast``."""
    left_out: Counter[str] = Counter()
    anomalies: dict[str, int] = {}
    got = rewritten_fast(data, 0, 0, 0, MergeOptions(), who, before, left_out)
    if got is None:
        return None
    head, body, n_in, slots, kinds = got
    moved = _lanes(body, 0, slots, kinds, False, left_out, anomalies, True)
    return n_in, len(head) + len(body), moved, left_out, anomalies


def rewritten_fast(data: bytes, rank: int, base: int, base_out: int, options: MergeOptions,
                   who: str, before: Callable[[list[Any]], None] | None = None, left_out: Counter[str] | None = None
                   ) -> tuple[list[dict[str, Any]], list[Any], int, list[tuple[str, Any]], Kinds] | None:
    """Rewrite one rank's trace text as ``RankEvents.rewrite`` would, or None to use the general path.

    Parameters
    ----------
    data
        The rank's whole trace, uncompressed.
    rank, base, base_out
        The rank, its ``baseTimeNanoseconds`` (0 without one) and the merged base time.
    options
        Merge options for which ``handles`` is true.
    who
        ``"<path> (rank N)"``, for error messages.
    before
        Called with the decoded events before any is dropped or rewritten (``tracefuse index`` takes ``info``'s
        figures of them there).
    left_out
        Where given, counts the events left out by each reason (``model.LEFT_OUT``'s names).

    Returns
    -------
    tuple or None
        ``(head, body, events_in, slots, kinds)``: the process metadata events (dicts) and the other events
        (structs whose ``args`` is raw JSON text and whose ``ts`` is a float, an int or the raw text of exact µs), in
        output order: the thread metadata kept (``ph`` "M"), then the events that are not metadata; the rank's pid
        slots (``rewrite.order_slots``: slot ``j``'s pid became ``out_pid(rank, j)``) and the kinds of those events
        that are not metadata (``lanes.Kinds``: each distinct ``(ph, pid, tid, cat)`` as read, ``UNSET`` where
        absent, and its thread after the rewrite). None when the input needs the general path (a decoding or
        validation failure, an odd field, a time that needs the general path's checks or formatting).

    Raises
    ------
    MergeError
        When the rank is out of range or has more than 64 processes, as the general path does.
    """
    if not 0 <= rank <= MAX_RANK:
        raise MergeError(f"{who}: rank {rank} is outside 0..{MAX_RANK}, the range the pid layout holds")
    trace = decode_or_none(data, *_decoders)
    if trace is None:
        return None
    events = trace.traceEvents
    del trace
    if before is not None:
        before(events)
    n_in = len(events)
    # Each event's kind, a number for its (ph, pid, tid, cat): the filters, the pid layout and the lanes read the
    # few distinct kinds, not every event.
    number: defaultdict[tuple[Any, Any, Any, Any], int] = defaultdict(count().__next__)
    codes = np.fromiter(map(number.__getitem__, map(_PH_PID_TID_CAT, events)), dtype=np.intp, count=n_in)
    keys = list(number)
    meta = np.array([k[0] == "M" for k in keys], dtype=bool)
    left = (np.zeros(len(keys), dtype=bool) if options.include_pyfunc else
            np.array([k[3] == "python_function" for k in keys], dtype=bool))
    metas = list(compress(events, (meta & ~left)[codes].tolist()))
    kept = (~meta & ~left)[codes]
    events = list(compress(events, kept.tolist()))
    codes = codes[kept]
    found = _processes(events, metas, set(Kinds.present_in(codes, keys)))
    if found is None:
        return None
    slots = order_slots(found.host, found.device, found.other, who)
    maps = pid_maps(rank, slots)
    pid_map = _map_pids(events, metas, maps, found)
    used = ({pid_map[pid] for _, pid, _, _ in found.keys} if pid_map is not None else
            {e.pid for e in events})
    head, shown = process_metadata(rank, slots, used, options.keep_empty_processes)
    odd_tids = {t for t in {k[2] for k in found.keys} | set(map(_TID, metas))
                if t is not UNSET and (type(t) is not int or not 0 <= t <= U32)}
    if odd_tids:  # strings such as "stream 7": only their events are visited
        for group in (metas, events):
            for e in compress(group, map(odd_tids.__contains__, map(_TID, group))):
                e.tid = map_tid(e.tid)
    # A time before the merged base sends the rank to the general path, which says which event and why.
    if not all(_shift(group, base - base_out) for group in (metas, events)):
        return None
    ids = (set(map(_ID, events)) | set(map(_ID, metas))) - {UNSET}
    id_map = IdMap(rank, ids) if ids else None
    for e in metas:
        if e.id is not UNSET:
            e.id = id_map[e.id]  # type: ignore[index]
    _rewrite_events(events, pid_map, id_map, any(k[0] in _INSTANT_PH for k in found.keys))
    if options.annotate_rank and not _annotate_rank(events, rank, b"\\" not in data):
        return None
    threads = _thread_names(metas, shown)
    if left_out is not None:
        left_out["python_function"] += n_in - len(events) - len(metas)
        process = sum(e.name in PROCESS_M for e in metas)
        left_out["process_metadata"] += process
        left_out["thread_metadata"] += len(metas) - process - len(threads)
    return head, threads + events, n_in, slots, Kinds(len(threads), codes, keys,
                                                      _tracks(keys, pid_map, maps, found, odd_tids))


@dataclass
class _Processes:
    """What the pid layout, the tid check and the process metadata need of a rank's events (``_processes``)."""

    keys: set[tuple[Any, Any, Any, Any]]  # every distinct (ph, pid, tid, cat)
    host: set[Any] = field(default_factory=set)  # the pids of host events
    device: set[Any] = field(default_factory=set)  # of device events
    other: set[Any] = field(default_factory=set)  # string or negative pids
    dev_tids: set[tuple[Any, Any]] = field(default_factory=set)  # the (pid, tid) of device events
    cat_dev: dict[Any, bool | None] = field(default_factory=dict)  # None: device work by each event's args.stream
    streamed: set[int] = field(default_factory=set)  # id() of the events of an unknown category on a device stream
    both: set[Any] = field(default_factory=set)  # pids with host and device events: their flows go to their anchor


def _processes(events: list[_Event], metas: list[_Event], keys: set[tuple[Any, Any, Any, Any]]) -> _Processes | None:
    """Which pids carry host and which device events (and flows, and labels), in one pass over the distinct
    ``(ph, pid, tid, cat)`` of ``events`` (``keys``) and a second over the events of an unknown category only; None
    when an ``args`` that must be read is not JSON."""
    found = _Processes(keys)
    host, device, other, dev_tids, cat_dev = found.host, found.device, found.other, found.dev_tids, found.cat_dev
    flow_pids: set[Any] = set()
    by_args = False
    for ph, pid, tid, cat in found.keys:
        if ph in FLOW_PH:
            flow_pids.add(pid)
            continue
        if cat not in cat_dev:
            host_cat = host_category(cat)
            cat_dev[cat] = None if host_cat is None else not host_cat
        is_dev = cat_dev[cat]
        if is_dev is None:
            by_args = True
        elif type(pid) is str or pid < 0:
            other.add(pid)
        elif is_dev:
            device.add(pid)
            dev_tids.add((pid, tid))
        else:
            host.add(pid)
    if by_args:
        for e in events:
            if e.ph in FLOW_PH or cat_dev[e.cat] is not None:
                continue
            try:
                is_dev = on_device(e.cat, orjson.loads(bytes(e.args)) if e.args is not UNSET else None)
            except orjson.JSONDecodeError:
                return None
            if is_dev:
                found.streamed.add(id(e))
            if type(e.pid) is str or e.pid < 0:
                other.add(e.pid)
            elif is_dev:
                device.add(e.pid)
                dev_tids.add((e.pid, e.tid))
            else:
                host.add(e.pid)
    labelled: dict[int, bool] = {}
    for e in metas:
        if type(e.pid) is str or e.pid < 0:
            other.add(e.pid)
        else:
            try:
                args = orjson.loads(bytes(e.args)) if e.args is not UNSET else None
            except orjson.JSONDecodeError:
                return None
            labelled[e.pid] = labelled.get(e.pid, False) or is_gpu_label(e.name, args)
    for pid, is_gpu in labelled.items():
        if pid not in host and pid not in device:
            (device if is_gpu else host).add(pid)
    for pid in flow_pids:  # a pid that carries only flow events still needs a process
        if type(pid) is str or pid < 0:
            other.add(pid)
        elif pid not in host and pid not in device:
            host.add(pid)
        elif pid in host and pid in device:
            found.both.add(pid)
    return found


def _map_pids(events: list[_Event], metas: list[_Event], maps: tuple[dict[Any, int], dict[Any, int]],
              found: _Processes) -> dict[Any, int] | None:
    """The events' and metadata's pids mapped where a pid carries both host and device events (then None), or
    else the one map to apply (``_rewrite_events`` does, in its pass); ``maps``: the host and the device map."""
    host_map, dev_map = maps
    pid_map = host_map if host_map == dev_map else None
    if pid_map is None:
        def on_dev(e: _Event) -> bool:
            is_dev = found.cat_dev[e.cat]
            return id(e) in found.streamed if is_dev is None else is_dev

        anchor_dev = _anchor_kinds(events, found.both, on_dev) if found.both else {}
        for e in events:
            if e.ph not in FLOW_PH:
                e.pid = (dev_map if on_dev(e) else host_map)[e.pid]
            else:
                e.pid = (dev_map if anchor_dev.get((e.pid, e.tid, e.ts)) else host_map)[e.pid]
    for e in metas:
        e.pid = (dev_map if (e.pid, e.tid) in found.dev_tids else host_map)[e.pid]
    return pid_map


def _tracks(keys: list[tuple[Any, Any, Any, Any]], pid_map: dict[Any, int] | None,
            maps: tuple[dict[Any, int], dict[Any, int]], found: _Processes, odd_tids: set[Any]) -> np.ndarray | None:
    """The thread of each complete slice of a kind (``keys[k]``: its ``(ph, pid, tid, cat)`` as read) as the lanes
    number it (``lanes.tracks_of``), after the rewrite maps its pid and tid. None, for the whole rank, when some pid
    carries host and device events and a kind of complete slices is of a category that only each event's args
    place (``_map_pids``): then the lanes read each slice's pid and tid."""
    host_map, dev_map = maps
    pids, tids = [], []
    for key in keys:
        ph, pid, tid, cat = key
        if ph != "X" or key not in found.keys:  # not a complete slice the merge keeps: never read
            pid = tid = 0
        elif pid_map is not None:
            pid = pid_map[pid]
        elif found.cat_dev[cat] is None:
            return None
        else:
            pid = (dev_map if found.cat_dev[cat] else host_map)[pid]
        pids.append(pid)
        tids.append(0 if tid is UNSET else map_tid(tid) if tid in odd_tids else tid)
    return tracks_of(np.array(pids, dtype=np.int64), np.array(tids, dtype=np.int64))


def _shift(group: list[_Event], shift: int) -> bool:
    """The events' times moved by ``shift`` ns; False when one falls before the merged base."""
    if not group:
        return True
    if not shift:  # the common case: a job's ranks share their base (the start of a quarter)
        return min(map(_TS, group)) >= 0
    ts = _shifted(list(map(_TS, group)), shift)
    if ts is None:
        return False
    for e, t in zip(group, ts):
        e.ts = t
    return True


def _thread_names(metas: list[_Event], shown: set[int]) -> list[_Event]:
    """The metadata events kept: not the process ones (``process_metadata`` writes those), not those of a process
    not shown, and one ``thread_name`` per thread."""
    threads = []
    named: set[tuple[int, Any]] = set()
    for e in metas:
        if e.name in PROCESS_M or e.pid not in shown:
            continue
        if e.name == "thread_name":
            if (e.pid, e.tid) in named:
                continue
            named.add((e.pid, e.tid))
        threads.append(e)
    return threads


def _anchor_kinds(events: list[_Event], pids: set[Any],
                  on_dev: Callable[[_Event], bool]) -> dict[tuple[Any, Any, Any], bool]:
    """Whether the first complete event at each ``(pid, tid, ts)`` of ``pids`` is on a device: the process of a
    flow event there, as ``RankEvents`` links it (a flow without an anchor stays with the host)."""
    kinds: dict[tuple[Any, Any, Any], bool] = {}
    for e in events:
        if e.ph == "X" and e.pid in pids:
            kinds.setdefault((e.pid, e.tid, e.ts), on_dev(e))
    return kinds


def _shifted(ts: list[Any], shift: int) -> list[Any] | None:
    """Times moved by ``shift`` ns, as the general path writes them (``to_ns``, then ``/ 1000`` or exact text).

    None when one falls before 0. Times and results under 2**43 µs, the common case, are computed as arrays.
    """
    a = np.array(ts, dtype=np.float64)
    if abs(shift) < EXACT_NS and np.abs(a).max() < EXACT_FLOAT:  # exact as float64, no int64 overflow
        ns = to_ns_array(a) + shift
        if ns.min() < 0:
            return None
        if ns.max() < EXACT_NS:
            return (ns / 1000).tolist()
    out = [to_ns(v) + shift for v in ts]
    if min(out) < 0:
        return None
    return [t / 1000 if t < EXACT_NS else Raw(us_text(t)) for t in out]


def _rewrite_events(events: list[_Event], pid_map: dict[Any, int] | None, id_map: IdMap | None,
                    instants: bool) -> None:
    """One pass over the non-metadata events: pids, ids and global instants (if ``instants``).

    ``pid_map`` is None when the pids were mapped already.
    """
    if pid_map is None and id_map is None and not instants:
        return
    high = id_map.high if id_map is not None else 0
    dense = id_map.dense if id_map is not None else None
    for e in events:
        if pid_map is not None:
            e.pid = pid_map[e.pid]
        i = e.id
        if i is not UNSET:
            e.id = high | (i if dense is None else dense[i])
        if instants and e.s == "g" and e.ph in _INSTANT_PH:
            e.s = "p"


def _annotate_rank(events: list[_Event], rank: int, plain: bool) -> bool:
    """``"rank": rank`` spliced into the raw text of every event's ``args`` (``--annotate-rank``).

    ``args`` that may hold a rank already (``"rank"``, or an escape that may spell it) are
    parsed. ``plain`` says that the rank's text has no escape at all (one scan of it, cheaper
    than one per ``args``). Returns False when the general path must run.
    """
    only = Raw(b'{"rank":%d}' % rank)
    first = b'{"rank":%d,' % rank
    for e in events:
        a = e.args
        if a is UNSET:
            e.args = only
            continue
        text = bytes(a)
        if text[:2] == b'{"' and b'"rank"' not in text and (plain or b"\\" not in text):  # the common case
            e.args = Raw(first + text[1:])
        elif text[0] != 123:  # not an object: null gets the rank alone, other values stay as they are
            if text == b"null":
                e.args = only
        elif b'"' not in text:  # {} (a key would need a quote)
            e.args = only
        elif b'"rank"' in text or b"\\" in text:  # may hold a rank already: set it exactly
            try:
                args = orjson.loads(text)
            except orjson.JSONDecodeError:
                return False
            args["rank"] = rank
            e.args = Raw(orjson.dumps(args))
        else:
            e.args = Raw(first + text[1:])
    return True
