"""The merged trace's layout (spec §6): which pid holds which rank's process, what Perfetto accepts as a tid, and
which threads are lanes (``merge.lanes``).

A rank's processes get the pids ``2**22 + rank*64 + slot``: unique across ranks, below 2**31, and the
rank can be read back from the pid. ``tracefuse analyze --critical-path-trace`` adds one process below
them, ``CRITICAL_PATH_PID``, the "critical path" track, which belongs to no rank. The merge writes this
layout; the analysis and ``tracefuse info`` read it to split a merged trace back into its ranks.
"""
from __future__ import annotations

import re
import zlib
from collections import Counter
from typing import Any

__all__ = ["CRITICAL_PATH_PID", "LANE_OF", "LANE_TID", "MAX_RANK", "PID_BASE", "SLOTS_PER_RANK", "U32", "is_merged",
           "map_tid", "out_pid", "split_merged"]


PID_BASE = 1 << 22
SLOTS_PER_RANK = 64
MAX_RANK = ((1 << 31) - PID_BASE) // SLOTS_PER_RANK - 1
U32 = (1 << 32) - 1
CRITICAL_PATH_PID = PID_BASE - 1
LANE_TID = 1 << 31  # lanes' tids count up from here, above the tids that string tids become (map_tid)
LANE_OF = "lane_of"  # in a lane's thread_name args: the tid of its thread
_STREAM = re.compile(r"(\d+)\s*$")


def out_pid(rank: int, slot: int) -> int:
    """The merged pid of a rank's ``slot``: ``2**22 + rank*64 + slot``."""
    return PID_BASE + rank * SLOTS_PER_RANK + slot


def is_merged(metadata: Any) -> bool:
    """True when a trace's ``metadata`` says tracefuse wrote it (a merged trace)."""
    return isinstance(metadata, dict) and "tracefuse" in metadata


def split_merged(events: list[Any], lane_metadata: Counter[int] | None = None) -> dict[int, list[Any]]:
    """A tracefuse-merged trace's events per rank: ``args.rank``, else the rank its pid encodes.

    Events that the merge moved to a lane (``merge.lanes``: a thread whose ``thread_name`` has ``LANE_OF``) go
    back to their thread, and the lanes' own metadata is left out, so that a rank reads as its input did;
    ``lane_metadata``, where given, counts those left out per rank.
    """
    lanes = {(ev.get("pid"), ev.get("tid")): ev["args"][LANE_OF] for ev in events
             if type(ev) is dict and ev.get("ph") == "M" and ev.get("name") == "thread_name"
             and type(ev.get("args")) is dict and LANE_OF in ev["args"]}
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
        if lanes and (ev.get("pid"), ev.get("tid")) in lanes:
            if ev.get("ph") == "M":
                if lane_metadata is not None:
                    lane_metadata[rank] += 1
                continue
            ev["tid"] = lanes[(ev["pid"], ev["tid"])]
        parts.setdefault(rank, []).append(ev)
    return parts


def map_tid(tid: Any) -> Any:
    """A tid Perfetto accepts: ints in [0, 2**32-1] stay; others become a stable int."""
    if type(tid) is int and 0 <= tid <= U32:
        return tid
    if isinstance(tid, str):
        m = _STREAM.search(tid)
        if m and int(m.group(1)) <= U32:
            return int(m.group(1))
    return zlib.crc32(str(tid).encode()) & 0x7FFFFFFF
