"""One rank's events, read as the merge and the analysis both must: validated, classified, selected.

``RankEvents`` is the general path over parsed dicts: it checks every field that is read or
rewritten (with an error that names the file, the rank and the event), tells host from device
events, and applies the filters. ``decode_or_none`` is the entry of the fast paths, which decode
into msgspec structs of the same rules and hand anything else to the general path.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..errors import MergeError, TraceFormatError
from ..model import MergeOptions
from .times import MAX_US, to_ns
from .vocabulary import (
    STEP,
    host_category,
    is_collective_call,
    is_comm_kernel,
    on_device,
)

__all__ = ["FLOW_PH", "RankEvents", "begin_end_pairs", "decode_or_none", "is_device_event", "is_gpu_label"]


FLOW_PH = frozenset({"s", "t", "f"})


def is_device_event(ev: dict[str, Any]) -> bool:
    """True for events that live on a device's timeline: kernels, memcpy/memset, GPU annotations, and events of
    another accelerator's category on a device stream (``vocabulary.on_device``)."""
    return on_device(ev.get("cat"), ev.get("args"))


def is_gpu_label(name: Any, args: Any) -> bool:
    """True for a process M event that names or labels its pid as a GPU (``"GPU 0"``)."""
    label = next(iter(args.values()), "") if type(args) is dict else ""
    return name in ("process_labels", "process_name") and type(label) is str and label.startswith("GPU")


def begin_end_pairs(marks: list[tuple[int, str, Any, Any, Any, Any, Any]]
                    ) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Chrome's duration events paired as Perfetto pairs them (``SliceTracker::End``): on each thread, in time order
    (ties in file order), an ``E`` closes the latest ``B`` still open whose name and category match its own, where
    it has them; an ``E`` that matches none closes nothing.

    ``marks`` holds ``(index, ph, pid, tid, ts, name, cat)`` of the ``B`` and ``E`` events in file order. Returns
    the pairs ``(B, E)``, the ``B`` left open (their ``E`` comes after the trace: it was cut, or the span outlives
    it) and the ``E`` that close nothing (their ``B`` came before the trace began), as indices.
    """
    open_: dict[tuple[Any, Any], list[tuple[int, Any, Any]]] = {}
    pairs: list[tuple[int, int]] = []
    unopened: list[int] = []
    for i, ph, pid, tid, _, name, cat in sorted(marks, key=lambda m: (m[4], m[0])):
        stack = open_.setdefault((pid, tid), [])
        if ph == "B":
            stack.append((i, name, cat))
            continue
        for k in range(len(stack) - 1, -1, -1):
            _, b_name, b_cat = stack[k]
            if (not cat or b_cat == cat) and (not name or not b_name or b_name == name):
                pairs.append((stack.pop(k)[0], i))
                break
        else:
            unopened.append(i)
    unclosed = sorted(b for stack in open_.values() for b, _, _ in stack)
    return sorted(pairs), unclosed, unopened


def _is_comm(ev: dict[str, Any], dev: bool) -> bool:
    name = ev.get("name")
    if not isinstance(name, str):
        return False
    return is_collective_call(name) or (dev and is_comm_kernel(name, ev.get("args")))


_ID_TYPES = (int, str)  # what a pid, a tid and an id may be


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

    After the scan, ``dev[i]`` says whether event ``i`` is device work, ``keep[i]``
    whether it passes the filters, ``pids`` holds the host, device and other
    (string or negative) pids, and ``dev_tids`` the ``(pid, tid)`` of device work.
    ``left_out`` counts the events left out by each filter (``model.LEFT_OUT``'s names).
    """

    events: list[Any]
    base: int
    options: MergeOptions
    who: str
    window_abs_ns: tuple[int, int] | None = None
    link_flows: bool = True
    dev: list[bool] = field(init=False)
    keep: list[bool] = field(init=False)
    pids: tuple[set[int], set[int], set[Any]] = field(init=False)
    dev_tids: set[tuple[Any, Any]] = field(init=False)
    left_out: Counter[str] = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        self._scan()
        self._select()

    def _bad(self, i: int, what: str) -> TraceFormatError:
        return TraceFormatError(f"{self.who}: event #{i} {what}. Fix or drop that event, or drop this file")

    def _bad_field(self, i: int, ev: dict[str, Any]) -> TraceFormatError:
        """The error of an event with a field of the wrong type, the first in the order ``_scan`` reads them."""
        ph, pid, tid = ev.get("ph"), ev.get("pid"), ev.get("tid")
        if type(ph) is not str:
            return self._bad(i, f"has ph={ph!r}; expected a one-letter string such as \"X\"")
        if type(pid) not in _ID_TYPES:
            return self._bad(i, f"has pid={pid!r}; expected an int or a string")
        if tid is not None and type(tid) not in _ID_TYPES:
            return self._bad(i, f"has tid={tid!r}; expected an int or a string")
        if "id" in ev and type(ev["id"]) not in _ID_TYPES:
            return self._bad(i, f"has id={ev['id']!r}; expected an int or a string")
        key = "name" if "name" in ev and type(ev["name"]) is not str else "cat"
        return self._bad(i, f"has {key}={ev[key]!r}; expected a string")

    def _negative(self, i: int, dur: Any, ph: str) -> bool:
        """Whether event ``i``'s ``dur`` is negative, in a complete slice (then counted as left out for it); a
        ``dur`` that is not a number of µs, or negative in another event, is an error."""
        td = type(dur)
        if (td is float or td is int) and 0 <= dur < MAX_US:
            return False
        if not ((td is float or td is int) and -MAX_US < dur < 0):
            raise self._bad(i, f"has a bad dur={dur!r}; expected a finite number of µs >= 0")
        if ph != "X":
            raise self._bad(i, f"has a negative dur={dur!r} on a ph={ph!r} event; only a complete slice (X) may have "
                               "one (it is then left out)")
        self.left_out["negative_dur"] += 1
        return True

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
                self.left_out["python_function"] += 1
                continue
            ph = ev.get("ph")
            pid = ev.get("pid")
            tid = ev.get("tid")
            if (type(ph) is not str or type(pid) not in _ID_TYPES or (tid is not None and type(tid) not in _ID_TYPES)
                    or ("id" in ev and type(ev["id"]) not in _ID_TYPES)
                    or ("name" in ev and type(ev["name"]) is not str) or ("cat" in ev and type(ev["cat"]) is not str)):
                raise self._bad_field(i, ev)
            ts = ev.get("ts")
            tt = type(ts)
            if not (((tt is float or tt is int) and -MAX_US < ts < MAX_US) or (ts is None and ph == "M")):
                raise self._bad(i, f"has ts={ts!r}; expected a number of µs within ±2**63 ns")
            if "dur" in ev and self._negative(i, ev["dur"], ph):
                keep[i] = False  # no viewer draws it: left out, an anomaly (kineto.anomalies); its flows go with it
            if type(pid) is str or pid < 0:
                other.add(pid)
            elif ph == "M":  # a pid named, labelled or with named threads but no events still has a slot
                labelled[pid] = labelled.get(pid, False) or is_gpu_label(ev.get("name"), ev.get("args"))
            if ph == "M":
                continue
            if ph in FLOW_PH:
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
            if type(pid) is int and pid >= 0 and pid not in device:
                host.add(pid)
        self.pids = (host, device, other)
        self.dev_tids = dev_tids
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

    def _left_out_by(self, i: int, ev: dict[str, Any], spans: list[tuple[int, int]] | None,
                     launches: dict[Any, int] | None, flow: bool) -> str | None:
        """The first filter that leaves event ``i`` out (``LEFT_OUT``'s name), or None when it is kept."""
        opts = self.options
        dev = self.dev[i]
        if not flow:
            if not opts.include_pyfunc and ev.get("cat") == "python_function":
                return "python_function"
            if opts.keep and not (
                ("gpu" in opts.keep and dev)
                or ("cpu" in opts.keep and not dev)
                or ("comm" in opts.keep and _is_comm(ev, dev))
            ):
                return "keep"
        t = to_ns(ev["ts"])
        if spans is not None:
            if dev and launches:
                args = ev.get("args")
                corr = args.get("correlation") if type(args) is dict else None
                if type(corr) is int or type(corr) is str:
                    t = launches.get(corr, t)
            if not any(s <= t < e for s, e in spans):
                return "steps"
        if self.window_abs_ns is not None:
            w0, w1 = self.window_abs_ns
            if not w0 <= self.base + to_ns(ev["ts"]) < w1:
                return "window"
        if opts.filter_fn is not None:
            try:
                return None if opts.filter_fn(ev) else "filter_fn"
            except MergeError:
                raise
            except Exception as e:
                raise MergeError(f"{self.who}: filter_fn raised {type(e).__name__}: {e} on event #{i}; "
                                 "fix the filter function") from e
        return None

    def _select(self) -> None:
        events, keep, dev = self.events, self.keep, self.dev
        opts = self.options
        anchors, twins, flows = self._anchors
        why: dict[int, str] = {}
        if opts.keep or opts.steps or self.window_abs_ns is not None or opts.filter_fn:
            spans = self._step_spans() if opts.steps else None
            launches = self._launch_times() if spans is not None else None
            for i, ev in enumerate(events):
                if keep[i] and ev["ph"] != "M" and ev["ph"] not in FLOW_PH:
                    reason = self._left_out_by(i, ev, spans, launches, False)
                    if reason is not None:
                        keep[i] = False
                        why[i] = reason
            marks = [(i, ev["ph"], ev["pid"], ev.get("tid"), ev["ts"], ev.get("name"), ev.get("cat"))
                     for i, ev in enumerate(events)
                     if ev.get("ph") in ("B", "E") and ev.get("cat") != "python_function"]  # others unread
            for b, e in begin_end_pairs(marks)[0]:  # a pair stays whole: its B decides
                keep[e] = keep[b]
                if keep[b]:
                    why.pop(e, None)
                else:
                    why[e] = why[b]
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
                ok = self._left_out_by(i, ev, spans, launches, True) is None
            fkey = (ev.get("cat"), ev.get("name"), ev.get("id"))
            alive[fkey] = alive.get(fkey, True) and ok
        for i in flows:
            ev = events[i]
            keep[i] = alive[(ev.get("cat"), ev.get("name"), ev.get("id"))]
            if not keep[i]:
                why[i] = "flow_end_left_out"
        self.left_out.update(why.values())

    def earliest_ns(self, kept_only: bool) -> int | None:
        """The earliest absolute time (ns) over kept, or all read, non-metadata events."""
        unread = None if self.options.include_pyfunc else "python_function"
        times = (to_ns(ev["ts"]) for i, ev in enumerate(self.events)
                 if ev["ph"] != "M" and (self.keep[i] or (not kept_only and ev.get("cat") != unread)))
        best = min(times, default=None)
        return None if best is None else self.base + best


def decode_or_none(data: bytes, *decoders: msgspec.json.Decoder) -> Any:
    """``data`` decoded by the first of ``decoders`` whose type it fits, or None when it is not valid UTF-8 JSON
    of any of their types."""
    if not data.isascii():
        try:
            data.decode()  # the decoder does not check the text of what it skips or keeps raw
        except UnicodeDecodeError:
            return None
    for decoder in decoders:
        try:
            return decoder.decode(data)
        except msgspec.ValidationError:
            continue
        except msgspec.DecodeError:
            return None
    return None
