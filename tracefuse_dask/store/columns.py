"""One rank's merged events as the store's columns (``schema.EVENTS``, ``schema.FLOWS``): pure functions, no IO.

The events come as the merge's rank rewrite leaves them (pids, tids and ids as the merged trace has them), from its
fast path (msgspec structs whose ``args`` is raw JSON text) or its general path (dicts): ``Fields`` holds either,
field by field, with each event's absolute time in ns. The arguments are decoded once, all together, into the keys
that have columns of their own; the whole ``args`` stays as its JSON text.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import compress, repeat
from operator import attrgetter, is_not, not_
from typing import Any

import msgspec
import numpy as np
import orjson
import pyarrow as pa

from ..kineto.times import EXACT_FLOAT, to_ns, to_ns_array
from ..kineto.vocabulary import STEP, device_kind, host_category, is_cpu_op_category
from .schema import EVENTS, FLOWS

__all__ = ["Fields", "fields_of_dicts", "fields_of_structs", "joined", "rank_tables"]

_FLOW_PHASES = frozenset({"s", "t", "f"})
_I64 = 1 << 63


class _Typed(msgspec.Struct, gc=False):
    """The arguments that have columns of their own, as the trace spells them: scalars of any type (checked per
    column), lists as raw text (decoded, and checked, only where there is one)."""

    stream: Any = None
    correlation: Any = None
    external_id: Any = msgspec.field(default=None, name="External id")
    collective: Any = msgspec.field(default=None, name="Collective name")
    process_group: Any = msgspec.field(default=None, name="Process Group Name")
    group_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    group_size: Any = msgspec.field(default=None, name="Group size")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None
    bytes: Any = None
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input Dims")
    input_types: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input type")
    concrete_inputs: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Concrete Inputs")


_NO_ARGS = _Typed()
# each column's key in ``args``
_KEYS = [(f.name, f.encode_name) for f in msgspec.structs.fields(_Typed)]
_INTS = ("stream", "correlation", "external_id", "group_size", "in_nelems", "out_nelems", "bytes")
_TEXTS = ("collective", "process_group", "dtype")
_LISTS = {"input_dims": list[list[int]], "input_types": list[str], "concrete_inputs": list[str]}


def _lists(raws: list[msgspec.Raw], tp: Any) -> list[Any]:
    """A list argument's values (None where an event has none, or one not of type ``tp``, which stays in
    ``args``): those present decoded in one call, one by one when one of them is not of the type."""
    at = [i for i, r in enumerate(raws) if len(r)]
    out: list[Any] = [None] * len(raws)
    try:
        values = msgspec.json.decode(b"[" + b",".join(bytes(raws[i]) for i in at) + b"]", type=list[tp])
    except msgspec.ValidationError:
        decoder = msgspec.json.Decoder(tp)
        values = []
        for i in at:
            try:
                values.append(decoder.decode(raws[i]))
            except msgspec.ValidationError:
                values.append(None)
    for i, v in zip(at, values):
        out[i] = v
    return out


@dataclass
class Fields:
    """A rank's kept events in output order, field by field (None where an event has none); ``args`` as JSON text,
    ``ts_ns`` as absolute integer ns."""

    ph: list[Any]
    cat: list[Any]
    name: list[Any]
    pid: list[Any]
    tid: list[Any]
    ts_ns: list[int | None]
    dur_ns: list[int | None]
    id: list[Any]
    bp: list[Any]
    args: list[bytes | None]


def joined(first: Fields, then: Fields) -> Fields:
    """The events of ``first``, then those of ``then``."""
    return Fields(*(getattr(first, f.name) + getattr(then, f.name) for f in fields(Fields)))


def _ns_of(values: list[Any], offset: int) -> list[int | None]:
    """µs values as the rewrite leaves them (a float, an int, the raw text of exact µs, or None), as integer ns
    plus ``offset``: ints as ``to_ns`` takes them (``v * 1000``), floats under 2**43 µs (the fast path's common
    case) as arrays (``to_ns_array``), anything else value by value."""
    kinds = set(map(type, values)) - {type(None)}
    if kinds <= {int}:
        return [None if v is None else v * 1000 + offset for v in values]
    if kinds <= {int, float} and (fast := _ns_as_arrays(values, offset)) is not None:
        return fast
    out: list[int | None] = []
    for v in values:
        if v is None:
            out.append(None)
        elif type(v) is msgspec.Raw:
            whole, _, frac = bytes(v).partition(b".")
            out.append(int(whole) * 1000 + int(frac.ljust(3, b"0")[:3] or 0) + offset)
        else:
            out.append(to_ns(v) + offset)
    return out


def _ns_as_arrays(values: list[Any], offset: int) -> list[int | None] | None:
    """``_ns_of`` of numbers (or None) as arrays, exactly as ``to_ns`` per value; None where one is at or over
    2**43 µs, or NaN, or a result is beyond int64."""
    present = values if None not in values else list(compress(values, map(is_not, values, repeat(None))))
    try:
        us = np.array(present, dtype=np.float64)
    except OverflowError:  # an int beyond a float's range, which ``to_ns`` takes as it is
        return None
    if not np.abs(us).max() < EXACT_FLOAT:  # ints exact as floats below it; NaN and infinity fail it
        return None
    ns = to_ns_array(us)
    if not (-_I64 <= offset < _I64 and -_I64 <= int(ns.min()) + offset and int(ns.max()) + offset < _I64):
        return None
    ns += offset
    if present is values:
        return ns.tolist()
    got = iter(ns.tolist())
    return [None if v is None else next(got) for v in values]


def fields_of_structs(events: list[Any], base_out: int) -> Fields:
    """``Fields`` of the merge fast path's events (``merge.fastpath.rewritten_fast``), whose times are µs after
    ``base_out``."""
    unset = msgspec.UNSET
    cols = [[None if v is unset else v for v in map(attrgetter(k), events)]
            for k in ("ph", "cat", "name", "pid", "tid", "ts", "dur", "id", "bp", "args")]
    ph, cat, name, pid, tid, ts, dur, ids, bp, args = cols
    return Fields(ph, cat, name, pid, tid, _ns_of(ts, base_out), _ns_of(dur, 0), ids, bp,
                  [None if a is None else bytes(a) for a in args])


def fields_of_dicts(events: list[dict[str, Any]], ts_ns: list[int | None]) -> Fields:
    """``Fields`` of the merge general path's events (dicts), with their absolute times ``ts_ns``."""
    get = [[ev.get(k) for ev in events] for k in ("ph", "cat", "name", "pid", "tid", "dur", "id", "bp", "args")]
    ph, cat, name, pid, tid, dur, ids, bp, args = get
    return Fields(ph, cat, name, pid, tid, ts_ns, _ns_of(dur, 0), ids, bp,
                  [None if a is None else orjson.dumps(a) for a in args])


def _typed(args: list[bytes | None]) -> list[_Typed]:
    """Each event's typed arguments: all decoded in one call, one by one when some ``args`` is not an object."""
    texts = [b"{}" if a is None else a for a in args]
    try:
        return msgspec.json.decode(b"[" + b",".join(texts) + b"]", type=list[_Typed])
    except msgspec.DecodeError:
        out = []
        for t in texts:
            try:
                out.append(msgspec.json.decode(t, type=_Typed))
            except msgspec.DecodeError:
                out.append(_NO_ARGS)
        return out


def _rest(args: list[bytes | None], cols: dict[str, list[Any]]) -> list[str | None]:
    """Each event's arguments but those its typed columns hold, as JSON text (None for an event without ``args``):
    the trace's keys in its order, without the repeated ids and shapes that would double the part."""
    held: list[list[str]] = [[] for _ in args]  # per event, the keys its typed columns hold
    for column, key in _KEYS:
        values = cols.get(column)
        if values is not None and values.count(None) < len(values):
            for i in compress(range(len(values)), map(is_not, values, repeat(None))):
                held[i].append(key)
    out: list[str | None] = []
    for a, keys in zip(args, held):
        if a is None:
            out.append(None)
            continue
        rest = orjson.loads(a)
        if type(rest) is not dict:
            out.append(a.decode())
            continue
        for key in keys:
            if key != "Process Group Ranks" or type(rest.get(key)) is str:
                del rest[key]  # ranks given as a list stay too: the column has them as text
        out.append(orjson.dumps(rest).decode())
    return out


def rank_tables(rank: int, f: Fields) -> dict[str, pa.Table]:
    """The rank's ``events`` and ``flows`` tables."""
    n = len(f.ph)
    flow = [p in _FLOW_PHASES for p in f.ph]
    keep = list(map(not_, flow))
    ev = {k: list(compress(getattr(f, k), keep))
          for k in ("ph", "cat", "name", "pid", "tid", "ts_ns", "dur_ns", "args")}
    typed = _typed(ev["args"])
    cols: dict[str, Any] = {"rank": [rank] * len(typed), **{k: ev[k] for k in ("pid", "tid", "ph", "cat", "name",
                                                                               "ts_ns", "dur_ns")}}
    for column in _INTS:  # an int beyond int64 stays in args
        cols[column] = [v if type(v) is int and -_I64 <= v < _I64 else None for v in map(attrgetter(column), typed)]
    for column in _TEXTS:
        cols[column] = [v if type(v) is str else None for v in map(attrgetter(column), typed)]
    for column, tp in _LISTS.items():
        cols[column] = _lists(list(map(attrgetter(column), typed)), tp)
    cols["group_ranks"] = [None if (r := t.group_ranks) is None else r if type(r) is str else
                           orjson.dumps(r).decode() for t in typed]
    cols["kind"] = [device_kind(c, nm, t) for c, nm, t in zip(ev["cat"], ev["name"], typed)]
    cols["args"] = _rest(ev["args"], cols)
    cols["step"], cols["launch_op"] = _steps_and_launches(cols)
    flows = {k: list(compress(getattr(f, k), flow)) for k in ("id", "ph", "cat", "name", "ts_ns", "pid", "tid", "bp")}
    flows["rank"] = [rank] * (n - len(typed))
    return {"events": pa.Table.from_pydict(cols, schema=EVENTS), "flows": pa.Table.from_pydict(flows, schema=FLOWS)}


def _steps_and_launches(cols: dict[str, list[Any]]) -> tuple[list[Any], list[Any]]:
    """Each event's step (the ``ProfilerStep#N`` whose span holds its start; device work: its launch's, else its
    own start's) and each device event's launching op (the innermost CPU op on the launch's thread around it)."""
    ts, dur, names, phs, kinds, corr = (cols[k] for k in ("ts_ns", "dur_ns", "name", "ph", "kind", "correlation"))
    n = len(ts)
    t = np.array([-1 if v is None else v for v in ts], dtype=np.int64)
    # the host's steps (a device's copies of them, gpu_user_annotation, are not the step's span)
    steps = sorted((ts[i], ts[i] + (dur[i] or 0), int(m.group(1))) for i in range(n)
                   if phs[i] == "X" and ts[i] is not None and type(names[i]) is str
                   and host_category(cols["cat"][i]) and (m := STEP.fullmatch(names[i])))
    step: list[Any] = [None] * n
    if steps:
        starts, ends, numbers = (np.array(x, dtype=np.int64) for x in zip(*steps))
        k = np.searchsorted(starts, t, side="right") - 1  # the latest step begun by the event's start
        inside = (k >= 0) & (t < ends[np.maximum(k, 0)]) & (t >= 0)
        step = [None if s < 0 else s for s in np.where(inside, numbers[np.maximum(k, 0)], -1).tolist()]
        reach = np.maximum.accumulate(ends)  # an earlier step may still hold it when steps overlap
        for i in np.flatnonzero(~inside & (k >= 0) & (t >= 0) & (t < reach[np.maximum(k, 0)])).tolist():
            step[i] = next((int(numbers[j]) for j in range(int(k[i]) - 1, -1, -1) if t[i] < ends[j]), None)
    calls = {corr[i]: i for i in range(n) if kinds[i] is None and corr[i] is not None and phs[i] == "X"}
    device = [i for i in range(n) if kinds[i] is not None and corr[i] in calls]
    around = _innermost_ops(cols, {calls[corr[i]] for i in device})
    op: list[Any] = [None] * n
    for i in device:
        j = calls[corr[i]]
        step[i], op[i] = step[j], around.get(j)
    return step, op


def _innermost_ops(cols: dict[str, list[Any]], calls: set[int]) -> dict[int, str]:
    """For each event of ``calls``, the name of the innermost CPU op on its thread whose span holds it."""
    ts, dur, names, cats, pids, tids, phs = (cols[k] for k in ("ts_ns", "dur_ns", "name", "cat", "pid", "tid", "ph"))
    rows = [i for i in range(len(ts)) if ts[i] is not None and phs[i] == "X"
            and (i in calls or (cols["kind"][i] is None and is_cpu_op_category(cats[i])))]
    # by thread, then start, the longer first, an op before a call that starts with it
    rows.sort(key=lambda i: (str(pids[i]), str(tids[i]), ts[i], -(dur[i] or 0), i in calls))
    out: dict[int, str] = {}
    stack: list[int] = []  # the open CPU ops of the thread, outermost first
    thread = None
    for i in rows:
        if (pids[i], tids[i]) != thread:
            thread, stack = (pids[i], tids[i]), []
        while stack and ts[stack[-1]] + (dur[stack[-1]] or 0) <= ts[i]:
            stack.pop()
        if i in calls:
            if stack:
                out[i] = names[stack[-1]]
        else:
            stack.append(i)
    return out
