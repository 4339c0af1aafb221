"""What the report and the CLI show of the critical path: its marks in the critical-path trace
(``trace_marks``) and its one-line summary (``path_line``)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import orjson
import pandas as pd

from ...kineto.layout import CRITICAL_PATH_PID, MAX_RANK
from ...kineto.times import to_ns
from ...kineto.vocabulary import kernel_label
from ...model import Marks
from ..schema import step_name

__all__ = ["WHAT_IF_TID", "path_line", "trace_marks"]

WHAT_IF_TID = MAX_RANK + 1  # the critical-path process's thread of the straggler what-if, after every rank's


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
    return (f"critical path of the slowest step ({step_name(slow)}, {slow['duration_us'] / 1e3:,.1f} ms, across "
            f"ranks {', '.join(slow['by_rank'])}): {kinds}; most of it: {top}")
