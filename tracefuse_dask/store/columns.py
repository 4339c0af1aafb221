"""One rank's merged events as the store's columns (``schema.EVENTS``, ``schema.FLOWS``): pure functions, no IO.

The events come as the merge's rank rewrite leaves them (pids, tids and ids as the merged trace has them); their
times come apart, as absolute ns taken before the rewrite, so that no rounding of the merged trace's µs text
reaches the store.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import orjson
import pyarrow as pa

from ..kineto.vocabulary import STEP, device_kind, is_cpu_op_category
from .schema import EVENTS, FLOWS

__all__ = ["rank_tables"]

# args that have a column of their own: (column, the trace's key, the column's check of a value)
_INT = (int,)
_TYPED = (
    ("stream", "stream", _INT),
    ("correlation", "correlation", _INT),
    ("external_id", "External id", _INT),
    ("collective", "Collective name", (str,)),
    ("process_group", "Process Group Name", (str,)),
    ("group_size", "Group size", _INT),
    ("in_nelems", "In msg nelems", _INT),
    ("out_nelems", "Out msg nelems", _INT),
    ("dtype", "dtype", (str,)),
    ("bytes", "bytes", _INT),
)
_FLOW_PHASES = frozenset({"s", "t", "f"})


def _ints(v: Any) -> bool:
    return type(v) is list and all(type(x) is int for x in v)


def _texts(v: Any) -> bool:
    return type(v) is list and all(type(x) is str for x in v)


def rank_tables(rank: int, events: Sequence[dict[str, Any]], ts_ns: Sequence[int | None],
                dur_ns: Sequence[int | None], dev: Sequence[bool]) -> dict[str, pa.Table]:
    """The rank's ``events`` and ``flows`` tables, from its merged ``events`` in order, each event's absolute
    time and duration in ns (None where it has none) and whether it is device work."""
    cols: dict[str, list[Any]] = {f.name: [] for f in EVENTS}
    flows: dict[str, list[Any]] = {f.name: [] for f in FLOWS}
    for ev, ts, dur, on_device in zip(events, ts_ns, dur_ns, dev):
        ph = ev.get("ph")
        if ph in _FLOW_PHASES:
            for key, value in (("rank", rank), ("id", ev.get("id")), ("ph", ph), ("cat", ev.get("cat")),
                               ("name", ev.get("name")), ("ts_ns", ts), ("pid", ev.get("pid")),
                               ("tid", ev.get("tid")), ("bp", ev.get("bp"))):
                flows[key].append(value)
            continue
        args = ev.get("args")
        rest = dict(args) if type(args) is dict else ({} if args is None else {"": args})
        cols["rank"].append(rank)
        cols["pid"].append(ev.get("pid"))
        cols["tid"].append(ev.get("tid"))
        cols["ph"].append(ph)
        cols["cat"].append(ev.get("cat"))
        cols["name"].append(ev.get("name"))
        cols["ts_ns"].append(ts)
        cols["dur_ns"].append(dur)
        cols["kind"].append(device_kind(ev.get("cat"), ev.get("name"), args) if on_device else None)
        for column, key, types in _TYPED:
            v = rest.get(key)
            if type(v) in types:
                del rest[key]
                cols[column].append(v)
            else:
                cols[column].append(None)
        dims = rest.get("Input Dims")
        ok = type(dims) is list and all(_ints(d) for d in dims)
        cols["input_dims"].append(rest.pop("Input Dims") if ok else None)
        for column, key in (("input_types", "Input type"), ("concrete_inputs", "Concrete Inputs")):
            ok = _texts(rest.get(key))
            cols[column].append(rest.pop(key) if ok else None)
        ranks = rest.pop("Process Group Ranks", None)
        cols["group_ranks"].append(None if ranks is None else ranks if type(ranks) is str
                                   else orjson.dumps(ranks).decode())
        cols["args"].append(orjson.dumps(rest, option=orjson.OPT_SORT_KEYS).decode() if rest else None)
    cols["step"], cols["launch_op"] = _steps_and_launches(cols, dev_of=[d for ev, d in zip(events, dev)
                                                                       if ev.get("ph") not in _FLOW_PHASES])
    return {"events": pa.Table.from_pydict(cols, schema=EVENTS), "flows": pa.Table.from_pydict(flows, schema=FLOWS)}


def _steps_and_launches(cols: dict[str, list[Any]], dev_of: list[bool]) -> tuple[list[Any], list[Any]]:
    """Each event's step (the ``ProfilerStep#N`` whose span holds its start; device work: its launch's, else its
    own start's) and each device event's launching op (the innermost CPU op on the launch's thread around it)."""
    ts, dur, names, phs = cols["ts_ns"], cols["dur_ns"], cols["name"], cols["ph"]
    n = len(ts)
    spans = sorted((ts[i], ts[i] + (dur[i] or 0), int(m.group(1))) for i in range(n)
                   if phs[i] == "X" and ts[i] is not None and isinstance(names[i], str)
                   and (m := STEP.fullmatch(names[i])))
    starts = [s for s, _, _ in spans]

    def step_at(t: int | None) -> int | None:
        if t is None or not spans:
            return None
        k = bisect.bisect_right(starts, t) - 1
        return spans[k][2] if k >= 0 and t < spans[k][1] else None

    # the host call of each correlation id, and the innermost CPU op around it
    corr = cols["correlation"]
    launches = {corr[i]: i for i in range(n) if not dev_of[i] and corr[i] is not None and phs[i] == "X"}
    enclosing = _innermost_ops(cols, dev_of, set(launches.values()))
    step = [None] * n
    op: list[Any] = [None] * n
    for i in range(n):
        j = launches.get(corr[i]) if dev_of[i] else None
        if j is not None:
            step[i] = step_at(ts[j])
            op[i] = enclosing.get(j)
        else:
            step[i] = step_at(ts[i])
    return step, op


def _innermost_ops(cols: dict[str, list[Any]], dev_of: list[bool], calls: set[int]) -> dict[int, str]:
    """For each event of ``calls``, the name of the innermost CPU op on its thread whose span holds it."""
    ts, dur, names, cats, pids, tids, phs = (cols[k] for k in ("ts_ns", "dur_ns", "name", "cat", "pid", "tid", "ph"))
    threads: dict[Any, list[int]] = {}
    for i in range(len(ts)):
        if not dev_of[i] and phs[i] == "X" and ts[i] is not None and (i in calls or is_cpu_op_category(cats[i])):
            threads.setdefault((pids[i], tids[i]), []).append(i)
    out: dict[int, str] = {}
    for members in threads.values():
        members.sort(key=lambda i: (ts[i], -(dur[i] or 0), i not in calls))
        stack: list[int] = []  # the open CPU ops, outermost first
        for i in members:
            while stack and ts[stack[-1]] + (dur[stack[-1]] or 0) <= ts[i]:
                stack.pop()
            if i in calls and stack:
                out[i] = names[stack[-1]]
            if is_cpu_op_category(cats[i]):
                stack.append(i)
    return out
