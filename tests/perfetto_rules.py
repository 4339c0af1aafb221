"""Checks that a merged trace obeys Perfetto's JSON import rules (spec §3) and keeps its inputs exactly.

Numbers are parsed as Decimal here, independently of the code under test, so
times are compared to the nanosecond.
"""
from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

U32 = (1 << 32) - 1
_NAME = re.compile(r"^rank (\d+) · ")


def load_exact(path: str | Path) -> dict[str, Any]:
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw, parse_float=Decimal)


def ns(value: Any) -> int:
    return int(Decimal(value) * 1000)


def assert_perfetto_rules(merged: dict[str, Any]) -> dict[int, int]:
    """Assert the import rules; return the pid -> rank map."""
    events = merged["traceEvents"]
    pid_rank: dict[int, int] = {}
    for ev in events:
        if ev["ph"] == "M" and ev["name"] == "process_name":
            m = _NAME.match(ev["args"]["name"])
            assert m, f"process_name {ev['args']['name']!r} names no rank"
            assert ev["pid"] not in pid_rank, f"pid {ev['pid']} named twice"
            pid_rank[ev["pid"]] = int(m.group(1))
    flow_rank: dict[tuple[Any, ...], int] = {}
    starts: Counter[tuple[Any, ...]] = Counter()
    for ev in events:
        pid, tid = ev["pid"], ev.get("tid", 0)
        assert type(pid) is int and 1 <= pid <= U32, f"bad pid {pid!r}"
        assert type(tid) is int and 0 <= tid <= U32, f"bad tid {tid!r}"
        assert pid in pid_rank, f"pid {pid} has no process_name"
        if "ts" in ev:
            assert ev["ts"] >= 0, f"negative ts in {ev}"
        if ev["ph"] != "M" and "rank" in (ev.get("args") or {}):  # --annotate-rank
            assert ev["args"]["rank"] == pid_rank[pid], f"args.rank disagrees with the process name: {ev}"
        assert (pid - 2**22) // 64 == pid_rank[pid], f"pid {pid} does not encode rank {pid_rank[pid]}"
        if ev["ph"] in ("s", "t", "f"):
            key = (ev["id"], ev.get("cat"), ev.get("name"))
            assert flow_rank.setdefault(key, pid_rank[pid]) == pid_rank[pid], f"flow {key} spans ranks"
            if ev["ph"] == "s":
                starts[key] += 1
        if ev.get("ph") in ("i", "I"):
            assert ev.get("s") != "g", "global instants must become per-process"
    dup = [k for k, n in starts.items() if n > 1]
    assert not dup, f"duplicated flow starts: {dup[:5]}"
    bad = misnested(events)
    assert not bad, f"{len(bad)} slices Perfetto cannot nest on their thread, e.g. {bad[:3]}"
    return pid_rank


def misnested(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The slices that Perfetto's JSON importer cannot nest on their thread, as ``(pid, tid, name, ts, dur)``.

    Perfetto's rule (``SliceTracker``; the Chrome JSON spec): on one thread (a tid 0, or none, is the pid's),
    slices sorted by start, ties broken complete slices first, the longer first, then the other phases in file
    order; each slice closes the open ones that ended by its start, and must end by the end of the slice it starts
    in. A ``B``/``E`` pair is one slice: an ``E`` closes the latest open ``B`` of its thread whose name and category
    match its own where it has them; a ``B`` that no ``E`` closes stays open to the end. A slice that cannot nest
    is counted and left off the stack (so one crossing counts once).
    """
    never = Decimal("Infinity")
    tracks: dict[tuple[Any, Any], list[tuple[Any, ...]]] = {}
    open_b: dict[tuple[Any, Any], list[list[Any]]] = {}
    def thread(ev: dict[str, Any]) -> tuple[Any, Any]:
        return ev["pid"], ev.get("tid") or ev["pid"]

    for i, ev in enumerate(events):
        ph, key = ev["ph"], thread(ev)
        if ph == "X":
            ts, dur = ns(ev["ts"]), ns(ev.get("dur", 0))
            tracks.setdefault(key, []).append((ts, 0, -dur, i, ts + dur, ev.get("name")))
        elif ph in ("B", "E"):
            open_b.setdefault(key, [])
    pairs: dict[tuple[Any, Any], list[list[Any]]] = {}
    for i, ev in sorted(((i, ev) for i, ev in enumerate(events) if ev["ph"] in ("B", "E")),
                        key=lambda p: (ns(p[1]["ts"]), p[0])):
        key = thread(ev)
        stack = open_b[key]
        if ev["ph"] == "B":
            pair = [ns(ev["ts"]), never, i, ev.get("name"), ev.get("cat")]
            stack.append(pair)
            pairs.setdefault(key, []).append(pair)
            continue
        for k in range(len(stack) - 1, -1, -1):
            _, _, _, name, cat = stack[k]
            if (not ev.get("cat") or cat == ev["cat"]) and (not ev.get("name") or not name or name == ev["name"]):
                stack.pop(k)[1] = ns(ev["ts"])
                break
    for key, got in pairs.items():
        for start, end, i, name, _ in got:
            tracks.setdefault(key, []).append((start, 1, 0, i, end, name))  # B events at one time: file order
    bad = []
    for key, slices in tracks.items():
        stack: list[Any] = []
        for start, _, _, _, end, name in sorted(slices, key=lambda s: s[:4]):
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1]:
                bad.append((*key, name, start, end - start))
                continue
            stack.append(end)
    return bad


def event_keys(events: list[dict[str, Any]], base: int, rank: int) -> Counter[tuple[Any, ...]]:
    """Comparable identity of non-M events: rank, ph, cat, name, absolute ns, dur ns."""
    keys: Counter[tuple[Any, ...]] = Counter()
    for ev in events:
        if ev["ph"] == "M":
            continue
        keys[(rank, ev["ph"], ev.get("cat"), ev.get("name"), base + ns(ev["ts"]),
              ns(ev["dur"]) if "dur" in ev else None)] += 1
    return keys


def assert_inputs_kept(merged: dict[str, Any], inputs: dict[int, dict[str, Any]], keep=lambda ev: True) -> None:
    """Every input event that ``keep`` accepts is in the merge exactly once, at the same absolute ns."""
    base_out = merged["baseTimeNanoseconds"]
    pid_rank = {ev["pid"]: int(_NAME.match(ev["args"]["name"]).group(1))
                for ev in merged["traceEvents"] if ev["ph"] == "M" and ev["name"] == "process_name"}
    got: Counter[tuple[Any, ...]] = Counter()
    for ev in merged["traceEvents"]:
        if ev["ph"] != "M":
            got.update(event_keys([ev], base_out, pid_rank[ev["pid"]]))
    want: Counter[tuple[Any, ...]] = Counter()
    for rank, doc in inputs.items():
        want.update(event_keys([e for e in doc["traceEvents"] if keep(e)], doc.get("baseTimeNanoseconds", 0), rank))
    missing = want - got
    extra = got - want
    assert not missing, f"{sum(missing.values())} input events missing, e.g. {list(missing)[:3]}"
    assert not extra, f"{sum(extra.values())} unexpected events, e.g. {list(extra)[:3]}"


LANE = re.compile(r"^(.*) · overlap(?: (\d+))?$")


def lane_owners(events: list[dict[str, Any]]) -> dict[tuple[int, int], int]:
    """Each lane's thread: ``{(pid, lane tid): tid}``. A lane is a thread named ``<its thread's name> · overlap``
    (then ``… · overlap 2``) sorted right after its thread (or its thread's previous lane)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    lanes = {key: LANE.match(name) for key, name in names.items() if LANE.match(name)}
    lane_of = {(e["pid"], e["tid"]): e["args"].get("lane_of") for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    owners = {}
    for pid in {pid for pid, _ in lanes}:
        sort = {e["tid"]: e["args"]["sort_index"] for e in events
                if e["ph"] == "M" and e["name"] == "thread_sort_index" and e["pid"] == pid}
        order = sorted(sort, key=sort.get)
        for k, tid in enumerate(order):
            m = lanes.get((pid, tid))
            if m is None:
                continue
            lane_no = int(m.group(2) or 1)
            owner = order[k - lane_no]
            assert k >= lane_no and (pid, owner) not in lanes, f"pid {pid}: lane {tid} does not follow its thread"
            own = names.get((pid, owner), "").strip()
            assert m.group(1) in (own, f"stream {owner}", f"thread {owner}"), (m.group(1), own, owner)
            assert lane_of[(pid, tid)] == owner, f"pid {pid}: lane {tid} names {lane_of[(pid, tid)]} as its thread"
            owners[(pid, tid)] = owner
    assert len(owners) == len(lanes), "a lane has no sort index"
    return owners


def assert_lanes(merged: dict[str, Any]) -> set[int]:
    """The lanes of slices that could not nest (``tracefuse_dask.merge.lanes``) are where they must be; returns the
    pids that have lanes.

    Each lane follows its thread (``lane_owners``). In a process with lanes every thread with events has one
    ``thread_sort_index``, no two alike, and lanes hold only slices and the flows bound to them.
    """
    events = merged["traceEvents"]
    owners = lane_owners(events)
    pids = {pid for pid, _ in owners}
    for pid in pids:
        sorts = [e for e in events if e["ph"] == "M" and e["name"] == "thread_sort_index" and e["pid"] == pid]
        sort = {e["tid"] or pid: e["args"]["sort_index"] for e in sorts}  # Perfetto: tid 0 is the pid's thread
        assert len(sorts) == len(sort), f"pid {pid}: a thread with two sort indices"
        used = {e.get("tid") or pid for e in events if e["pid"] == pid and e["ph"] not in ("M", "C")}
        assert used <= set(sort), f"pid {pid}: threads {used - set(sort)} have no sort index beside lanes"
        assert len(set(sort.values())) == len(sort), f"pid {pid}: two threads share a sort index"
    for pid, tid in owners:
        held = {e["ph"] for e in events if e["pid"] == pid and e.get("tid") == tid and e["ph"] != "M"}
        assert held and held <= {"X", "B", "E", "s", "t", "f"}, f"pid {pid}: lane {tid} holds {held}"
    return pids


def is_lane_metadata(ev: dict[str, Any], pid_rank: dict[int, int], laned: set[int]) -> bool:
    """Thread metadata the lanes gave: a lane's name, or a sort index in a rank with lanes."""
    if ev["name"] == "thread_name":
        return bool(LANE.match(ev["args"]["name"]))
    return ev["name"] == "thread_sort_index" and pid_rank[ev["pid"]] in laned
