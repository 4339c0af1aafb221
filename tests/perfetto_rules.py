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
    return pid_rank


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
