"""Per-rank analysis: call tree, GPU time attribution, breakdowns. Pure functions, no IO, no Dask.

One rank's events go in; small tables come out. The numbers follow
HolisticTraceAnalysis's definitions where it has them (temporal breakdown,
kernel breakdown, idle time breakdown), so that the two agree.

A trace's text decodes straight into msgspec structs (``decode.decode_trace``) whose
types check what ``RankEvents`` checks and whose ``args`` hold only the keys
read here. Columns come out in C-level passes, rules run once per distinct
name, cat or pid, and subtree totals are prefix sums over the call tree's order.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from itertools import compress
from operator import attrgetter
from typing import Any

import numpy as np
import orjson
import pandas as pd
from msgspec import Raw

from ...kineto.collectives import group_spec
from ...kineto.events import RankEvents
from ...kineto.layout import map_tid
from ...kineto.times import to_ns, to_ns_array
from ...kineto.vocabulary import (
    KERNEL_WAIT_NS,
    LAUNCH_CALLS,
    QUEUE_CALLS,
    STEP,
    device_kind,
    host_category,
    is_correlation_flow,
    is_cpu_op_category,
    is_op_category,
    kernel_category,
    kernel_type,
    on_device,
)
from ...model import MergeOptions
from ...perf import category, has_model
from ...perf.devices import Device, detect
from ..schema import Cutoffs, RankTables
from .account import event_kinds, events_account
from .collectives import rank_collectives
from .counters import LAUNCH_COLUMNS, launch_stats, memory_bw, memory_kind, queue_length
from .decode import NO_ARGS, Args, Event, durations, events_decoder
from .model import CallTree, GpuWork, RankModel, codes, factorized, first_seen
from .op_perf import backward_links, op_perf_table, owners
from .ops import op_keys, op_tables
from .sequences import SEQUENCE_COLUMNS, rank_sequences
from .walker import rank_pieces

__all__ = ["analyze_events", "analyze_rank", "rows_for", "union_length"]

_FLOW_OR_M = frozenset({"s", "t", "f", "M"})


def _merged(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals as disjoint sorted ``(starts, ends)``."""
    if len(starts) == 0:
        return starts, ends
    order = np.lexsort((ends, starts))
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], reach[last]


def union_length(starts: np.ndarray, ends: np.ndarray) -> int:
    """The total length of the union of intervals ``[starts, ends)``."""
    s, e = _merged(starts, ends)
    return int((e - s).sum())


_CORRELATION_TYPES = frozenset({int, str})
_CAT, _NAME, _PID, _TID, _TS, _DUR, _ARGS, _CORRELATION = map(attrgetter, ("cat", "name", "pid", "tid", "ts", "dur",
                                                                          "args", "correlation"))


def _breakdown(g: GpuWork, mask: np.ndarray | None = None) -> dict[str, float]:
    """HTA's temporal breakdown, plus the per-category unions and the exposed communication (µs)."""
    if mask is not None:
        start, end, ktype, kinds = g.start[mask], g.end[mask], g.ktype[mask], g.kind[mask]
    else:
        start, end, ktype, kinds = g.start, g.end, g.ktype, g.kind
    nan = float("nan")
    if len(start) == 0:
        return {k: nan for k in ("gpu_span_us", "idle_us", "computation_us", "non_compute_us",
                                 "communication_us", "memcpy_us", "memset_us", "exposed_comm_us",
                                 "comm_comp_overlap_pct", "idle_pct", "computation_pct")} | {"kernel_count": 0}
    span = int(end.max() - start.min())
    comp = ktype == "COMPUTATION"
    comm = ktype == "COMMUNICATION"
    busy = union_length(start, end)
    computation = union_length(start[comp], end[comp])
    communication = union_length(start[comm], end[comm])
    both = union_length(start[comp | comm], end[comp | comm])
    overlap = computation + communication - both
    memcpy = kinds == "memcpy"
    memset = kinds == "memset"
    us = 1e3
    return {
        "gpu_span_us": span / us,
        "idle_us": (span - busy) / us,
        "computation_us": computation / us,
        "non_compute_us": (span - computation - (span - busy)) / us,
        "communication_us": communication / us,
        "memcpy_us": union_length(start[memcpy], end[memcpy]) / us,
        "memset_us": union_length(start[memset], end[memset]) / us,
        "exposed_comm_us": (communication - overlap) / us,
        "comm_comp_overlap_pct": 100.0 * overlap / communication if communication else nan,
        "idle_pct": 100.0 * (span - busy) / span if span else nan,
        "computation_pct": 100.0 * computation / span if span else nan,
        "kernel_count": int(len(start)),
    }


def _call_tree(pids: np.ndarray, tids: np.ndarray, host: np.ndarray, start: np.ndarray, end: np.ndarray) -> CallTree:
    """Nest host events per (pid, tid) by (ts, -dur).

    The innermost enclosing event is the parent. Equal timestamps nest the
    longer event outside; a zero-length event at another's start is its child.
    A subtree is the run of positions until its root is left: the stack pops it.
    """
    pid_code = codes(pids[host])
    thread = pid_code * (int(pid_code.max(initial=0)) + 1) + codes(tids[host])
    by = np.lexsort((host, -end[host], start[host], thread))
    order, thread = host[by], thread[by]
    m = len(order)
    ends = end[order].tolist()
    parent = [-1] * m
    stop = [m] * m
    cuts = [0, *(np.flatnonzero(thread[1:] != thread[:-1]) + 1).tolist(), m]
    for a, b in zip(cuts, cuts[1:]):  # one thread each
        stack: list[int] = []
        for k in range(a, b):
            e = ends[k]
            while stack and e > ends[stack[-1]]:
                stop[stack.pop()] = k
            if stack:
                parent[k] = stack[-1]
            stack.append(k)
        for k in stack:
            stop[k] = b
    pos = np.full(len(end), -1, dtype=np.int64)
    pos[order] = np.arange(m)
    return CallTree(order, parent, np.array(stop, dtype=np.int64), pos, thread)


def analyze_rank(events: list[Any], rank: int, path: str, steps: tuple[int, int] | None = None, *, base: int = 0,
                 header: Mapping[str, Any] | None = None, keep_unlaunched_gpu: bool = False,
                 devices: tuple[Device, ...] = (), cutoffs: Cutoffs = Cutoffs(),
                 sequences_of: str | None = None, read_before: Mapping[str, int] | None = None) -> RankTables:
    """Analyse one rank's events (``traceEvents``, as parsed).

    The events are validated as ``merge`` validates them, then analysed as
    ``analyze_events`` does.

    Parameters
    ----------
    events
        The rank's events.
    rank
        The rank, for messages.
    path
        The file, for messages.
    steps
        Only the inclusive ``ProfilerStep#N`` range ``(lo, hi)``; GPU work counts in
        the step whose CPU span holds its launch.
    base
        The file's ``baseTimeNanoseconds``: collective times are absolute.
    header
        The file's other top-level keys (``distributedInfo.pg_config``, ``host_name``, ``deviceProperties``).
    keep_unlaunched_gpu
        Keep the device work that HTA leaves out (``_launched_only``).
    devices
        The device table (``perf.devices.load_devices``) for ``op_perf``'s roofline; empty: no roofline.
    cutoffs
        HTA's thresholds for the launch statistics and the queue length (``schema.Cutoffs``).
    sequences_of
        The operator whose frequent kernel sequences to find (``sequences.rank_sequences``); None: none.
    read_before
        As for ``analyze_events``: the rank's events left out before ``events`` (a merged trace's lanes'
        metadata).

    Returns
    -------
    RankTables

    Raises
    ------
    TraceFormatError
        When an event is malformed.
    """
    sel = RankEvents(events, 0, MergeOptions(), f"{path} (rank {rank})", link_flows=False)
    used, before = [], Counter(read_before)
    before["negative_dur"] += sel.left_out["negative_dur"]
    for ev, keep in zip(events, sel.keep):
        if keep and ev.get("ts") is not None:
            used.append(ev)
        elif ev.get("ph") == "M":  # metadata without a time (the only events the check lets go without one)
            before["metadata"] += 1
        elif ev.get("cat") == "python_function":
            before["python_function"] += 1
    return analyze_events(events_decoder.decode(orjson.dumps(used)), rank, path, steps, base=base, header=header,
                          keep_unlaunched_gpu=keep_unlaunched_gpu, devices=devices, cutoffs=cutoffs,
                          sequences_of=sequences_of, read_before=before)


def analyze_events(events: list[Event], rank: int, path: str, steps: tuple[int, int] | None = None, *,
                   base: int = 0, header: Mapping[str, Any] | None = None, keep_unlaunched_gpu: bool = False,
                   devices: tuple[Device, ...] = (), cutoffs: Cutoffs = Cutoffs(),
                   sequences_of: str | None = None, read_before: Mapping[str, int] | None = None) -> RankTables:
    """Analyse one rank's events as ``decode_trace`` gives them: already validated, with ``args`` as structs.

    Parameters
    ----------
    events
        ``Trace.traceEvents``; ``python_function`` events are skipped. Their ``args``' list texts (``Input Dims``,
        ``Input type``, ``Concrete Inputs``) are emptied once read (``_forget_list_texts``), so that the file's text
        they point into can be freed before the critical path's walks.
    rank, path, steps, base, header, keep_unlaunched_gpu, devices, cutoffs, sequences_of
        As for ``analyze_rank``.
    read_before
        The rank's events that were read and left out before ``events`` (by reason, ``schema.LEFT_OUT``'s), for
        its account.

    Returns
    -------
    RankTables
    """
    kinds = event_kinds(events)
    m = rank_model(events, steps, base, keep_unlaunched_gpu,
                   pairs=any(ph in ("B", "E") and cat != "python_function" for ph, cat in kinds))
    g, tree, names, name_code = m.gpu, m.tree, m.names, m.name_code
    tables: dict[str, pd.DataFrame] = {}
    numbers = _breakdown(g) | {"gpu_events_left_out": m.left_out, "kernels_clipped": g.clipped}
    tables["breakdown"] = pd.DataFrame([numbers])
    tables["breakdown_by_step"] = _by_step(g, m.steps, m.start)
    tables["kernels"], tables["kernel_categories"] = _kernel_tables(g, names)
    is_op = ((np.array([is_op_category(c) for c in m.cats], dtype=bool)[m.cat_code] | m.is_span)
             & (m.step_of[name_code] < 0))
    is_cpu_op = np.array([is_cpu_op_category(c) for c in m.cats], dtype=bool)[m.cat_code]
    tables["ops"], tables["kernel_launchers"], leaf_at = op_tables(m, is_op, is_cpu_op)
    header = header or {}
    props = header.get("deviceProperties")
    device, called = detect(props, devices)
    launched = m.launch_pos >= 0
    modelled = np.array([has_model(nm) for nm in names], dtype=bool)[name_code] & is_cpu_op
    links = backward_links(m, is_cpu_op, leaf_at)
    own_backward = np.array([has_model(nm) and category(nm).endswith("_bwd") for nm in names], dtype=bool)[
        name_code] & is_cpu_op if links else modelled
    tables["op_perf"] = op_perf_table(owners(leaf_at, tree.parent, modelled[tree.order], tree.stop, links,
                                             own_backward[tree.order]),
                                      g.start[launched], g.end[launched], g.name[launched].tolist(),
                                      op_keys(m, links), device)
    tables["idle"] = _idle_table(g, m.start)
    tables["launch_stats"], tables["launch_worst"], tables["queue_length"], tables["memory_bw"] = _counter_tables(
        m, cutoffs)
    tables["kernel_sequences"] = rank_sequences(sequences_of, m) if sequences_of else pd.DataFrame(
        columns=SEQUENCE_COLUMNS)
    info = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}
    pgs = {str(pg["pg_name"]): spec for pg in info.get("pg_config") or []
           if isinstance(pg, dict) and "pg_name" in pg and (spec := group_spec(pg.get("ranks")))}
    tables["collectives"] = rank_collectives(m, pgs)
    _forget_list_texts(events)
    tables["path_anchors"], tables["path_segments"], tables["path_work"], texts = rank_pieces(
        m, tables["collectives"])
    host_name = header.get("host_name")
    return RankTables(rank, path, tables, numbers, [s for s, _, _ in m.steps],
                      host=host_name if isinstance(host_name, str) else None, pg_config=pgs, base=base, texts=texts,
                      begin_end=m.begin_end,
                      device=(device.name if device else None, called, len(props) if isinstance(props, list) else 0),
                      account=events_account(events, m, read_before or {}, kinds))


def _forget_list_texts(events: list[Event]) -> None:
    """Empty the list arguments' JSON texts (``Input Dims``, ``Input type``, ``Concrete Inputs``) of every event's
    ``args`` (those ``--steps`` leaves out too) once the op tables and the collectives have read them. Each is a
    view into the whole text of the file it was decoded from (``msgspec.Raw``), which stays in memory as long as one
    of them does: through the critical path's walks, the peak of a rank's analysis, 50 MB of an A100 rank's."""
    empty = Raw()
    for e in events:
        a = e.args
        if type(a) is Args:
            a.input_dims = a.input_types = a.concrete_inputs = empty


def rank_model(events: list[Event], steps: tuple[int, int] | None = None, base: int = 0,
               keep_unlaunched_gpu: bool = False, pairs: bool = True) -> RankModel:
    """One rank's events, as ``decode_trace`` gives them, as the model the per-rank analyses read; ``steps``,
    ``base`` and ``keep_unlaunched_gpu`` as for ``analyze_rank``; ``pairs``: whether there may be ``B``/``E``
    events (outside ``python_function``), which ``durations`` pairs (one pass over all events, skipped without)."""
    spans, unclosed, unopened = durations(events) if pairs else ([], 0, 0)
    xs = [e for e in events if e.ph == "X" and e.cat != "python_function"] + spans
    # the events each slice stands for: a B/E pair is two, a B left open one (``durations`` gives the pairs first)
    weight = np.ones(len(xs), dtype=np.int64)
    weight[len(xs) - len(spans):len(xs) - unclosed] = 2
    is_span = np.zeros(len(xs), dtype=bool)
    is_span[len(xs) - len(spans):] = True
    account = {"steps": 0, "unlaunched_gpu": 0}  # events left out
    if steps is not None:
        inside = _in_steps(events, xs, steps)
        kept = set(map(id, inside))
        within = np.fromiter((id(e) in kept for e in xs), bool, len(xs))
        account["steps"] = int(weight[~within].sum())
        xs, weight, is_span = inside, weight[within], is_span[within]
    n = len(xs)
    durs = np.fromiter(map(_DUR, xs), object, n)  # as parsed: ops sum them as Python does
    start = to_ns_array(np.fromiter(map(_TS, xs), np.float64, n))
    end = start + to_ns_array(durs.astype(np.float64))
    name_code, names = factorized(list(map(_NAME, xs)))
    cat_code, cats = factorized(list(map(_CAT, xs)))
    args = [a if type(a) is Args else NO_ARGS for a in map(_ARGS, xs)]
    pids = np.fromiter(map(_PID, xs), object, n)
    tids = np.fromiter(map(_TID, xs), object, n)
    dev = _device(cat_code, cats, pids, args)
    corr = np.fromiter(map(_CORRELATION, args), object, n)
    # as Kineto writes it (not a bool, a float or null); an array of types would be slow to build
    has_corr = np.fromiter(map(_CORRELATION_TYPES.__contains__, map(type, corr.tolist())), bool, n)
    step_of = np.array([int(m.group(1)) if (m := STEP.match(nm)) else -1 for nm in names], dtype=np.int64)
    left_out = 0
    keep = None if keep_unlaunched_gpu else _launched_only(dev, start, end, np.where(step_of[name_code] >= 0,
                                                                                    name_code, -1), corr, has_corr)
    if keep is not None:
        left_out = n - int(keep.sum())
        account["unlaunched_gpu"] = int(weight[~keep].sum())
        xs, args = list(compress(xs, keep)), list(compress(args, keep))
        durs, start, end, name_code, cat_code, pids, tids, dev, corr, has_corr, is_span = (
            v[keep] for v in (durs, start, end, name_code, cat_code, pids, tids, dev, corr, has_corr, is_span))
    host = np.flatnonzero(~dev)
    tree = _call_tree(pids, tids, host, start, end)
    g = _gpu_arrays(events, xs, dev, host, cat_code, cats, name_code, names, args, tids, start, end,
                    np.where(has_corr, corr, None))
    step_events = host[step_of[name_code[host]] >= 0]
    return RankModel(start, end, durs, name_code, names, cat_code, cats, args, pids, tids, is_span, step_of, tree, g,
                     launch_pos=np.where(g.launch >= 0, tree.pos[np.maximum(g.launch, 0)], -1),
                     steps=sorted((int(step_of[name_code[i]]), int(start[i]), int(end[i])) for i in step_events),
                     step_event={int(step_of[name_code[i]]): int(i) for i in step_events}, base=base,
                     left_out=left_out, begin_end=(len(spans) - unclosed, unclosed, unopened),
                     events_left_out=account)


def _counter_tables(m: RankModel, cutoffs: Cutoffs) -> tuple[pd.DataFrame, ...]:
    """HTA's launch statistics (and the longest launch delays), queue length and memory bandwidth of the rank
    (``counters``); the series stay here."""
    g, start, end, name_code, names, tree, launch_pos = m.gpu, m.start, m.end, m.name_code, m.names, m.tree, \
        m.launch_pos
    has = g.launch >= 0
    call = np.maximum(g.launch, 0)
    code = name_code[call]
    launch = np.flatnonzero(has & np.array([n in LAUNCH_CALLS for n in names], dtype=bool)[code])

    def described(k: np.ndarray) -> tuple[np.ndarray, ...]:
        """The kernels, calls and ops (the calls' parents) of the launches at ``k``: names for a few rows only."""
        j = launch[k]
        parent = np.where(launch_pos[j] >= 0, np.asarray(tree.parent, dtype=np.int64)[np.maximum(launch_pos[j], 0)],
                          -1)
        op = np.where(parent >= 0, names[name_code[tree.order[np.maximum(parent, 0)]]], "")
        return g.name[j], names[code[j]], op

    row, worst = launch_stats(start[call[launch]], end[call[launch]], g.start[launch], g.end[launch], described,
                              cutoffs)
    queued = np.flatnonzero(has & np.array([n in QUEUE_CALLS for n in names], dtype=bool)[code])
    queue = queue_length(start[call[queued]], g.start[queued],
                         np.array([g.stream[i] for i in queued.tolist()], dtype=object), cutoffs)
    copies = np.flatnonzero(g.ktype == "MEMORY")
    gbps = np.array([_number(g.args[i].memory_bw) for i in copies.tolist()], dtype=np.float64)
    memory = memory_bw(g.start[copies], g.end[copies], np.array([memory_kind(n) for n in g.name[copies]],
                                                                dtype=object), gbps)
    return pd.DataFrame([row], columns=LAUNCH_COLUMNS), worst, queue, memory


def _number(value: Any) -> float:
    """A number from the trace's args, NaN when it is none."""
    return float(value) if type(value) in (int, float) else float("nan")


def _device(cat_code: np.ndarray, cats: np.ndarray, pids: np.ndarray, args: list[Args]) -> np.ndarray:
    """Which X events are on a device's timeline (``_on_gpu``), decided once per distinct ``cat`` and pid, and by
    each event's ``args.stream`` for a category the vocabulary does not know."""
    pid_code, distinct = pd.factorize(pids)
    device: dict[Any, bool | None] = {}
    on_gpu = np.array([[_on_gpu(c, p, device) for p in distinct] for c in cats], dtype=object)
    dev = on_gpu.reshape(len(cats), len(distinct))[cat_code, pid_code]
    for i in np.flatnonzero(dev == None).tolist():  # noqa: E711 (elementwise)
        dev[i] = on_device(cats[cat_code[i]], args[i])
    return dev.astype(bool)


def _in_steps(events: list[Event], xs: list[Event], steps: tuple[int, int]) -> list[Event]:
    """The events of ``xs`` in the steps: a host event by its start, GPU work by its launch's (``RankEvents``)."""
    lo, hi = steps
    spans: list[tuple[int, int]] = []
    launches: dict[Any, int] = {}
    device: dict[Any, bool] = {}
    for e in events:
        if e.cat == "python_function" or (e.ph not in _FLOW_OR_M and _is_gpu(e, device)):
            continue
        if e.ph == "X" and (m := STEP.match(e.name)) and lo <= int(m.group(1)) <= hi:
            s = to_ns(e.ts)
            spans.append((s, s + to_ns(e.dur)))
        c = e.args.correlation if type(e.args) is Args else None
        if type(c) is int or type(c) is str:
            launches.setdefault(c, to_ns(e.ts))
    union: list[list[int]] = []  # the steps' spans as disjoint [start, end), by start
    for s, end in sorted(spans):
        if union and s <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([s, end])
    starts = [s for s, _ in union]
    out = []
    for e in xs:
        t = to_ns(e.ts)
        c = e.args.correlation if type(e.args) is Args and _is_gpu(e, device) else None
        if type(c) is int or type(c) is str:
            t = launches.get(c, t)
        k = bisect_right(starts, t) - 1
        if k >= 0 and t < union[k][1]:
            out.append(e)
    return out


def _launched_only(dev: np.ndarray, start: np.ndarray, end: np.ndarray, step: np.ndarray, corr: np.ndarray,
                   has: np.ndarray) -> np.ndarray | None:
    """Which events to keep without the device work HTA leaves out; None to keep them all.

    HTA's rule (``hta/common/trace.py``, ``_filter_irrelevant_gpu_kernels``, as ``TraceAnalysis`` calls it with
    ``include_last_profiler_step=True``): when a trace has two or more ``ProfilerStep#N``, device work with a
    correlation is kept only when a host event that starts by the end of the last step has that correlation
    (work queued before the profiler started has none), and device work without one only when it starts by
    that end. Host events are all kept.

    Parameters
    ----------
    dev, start, end, step, corr, has
        Per X event: on a device, its times (ns), its name's code when it is a ``ProfilerStep#N`` (else -1),
        ``args.correlation``, and whether that is an int or a string.
    """
    steps = ~dev & (step >= 0)
    if len(np.unique(step[steps])) < 2:
        return None
    last = end[steps].max()
    launched = pd.unique(corr[~dev & has & (start <= last)])
    return ~dev | np.where(has, pd.Index(launched).get_indexer(corr) >= 0, start <= last)


def _on_gpu(cat: Any, pid: Any, device: dict[Any, bool | None]) -> bool | None:
    """As ``RankEvents`` decides for an event that is not metadata or a flow: a device ``cat``, a pid int >= 0;
    None for a category the vocabulary does not know, whose events are device work by their ``args.stream``.

    ``device`` caches the category's answer.
    """
    if type(pid) is not int or pid < 0:
        return False
    if cat not in device:
        host = host_category(cat)
        device[cat] = None if host is None else not host
    return device[cat]


def _is_gpu(e: Event, device: dict[Any, bool | None]) -> bool:
    """``_on_gpu`` of one event, its ``args.stream`` included."""
    dev = _on_gpu(e.cat, e.pid, device)
    return on_device(e.cat, e.args if type(e.args) is Args else None) if dev is None else dev


def _gpu_arrays(events: list[Event], xs: list[Event], dev: np.ndarray, host: np.ndarray, cat_code: np.ndarray,
                cats: np.ndarray, name_code: np.ndarray, names: np.ndarray, args: list[Args], tids: np.ndarray,
                start: np.ndarray, end: np.ndarray, corr: np.ndarray) -> GpuWork:
    """The GPU events (a stream, not -1: ``args.stream``, else the tid) and the host events that launched them."""
    kinds = np.array([device_kind(c) for c in cats], dtype=object)[cat_code]
    by_name = np.array([host_category(c) is None for c in cats], dtype=bool)[cat_code] & dev
    for i in np.flatnonzero(by_name).tolist():  # another accelerator's work: its kind by name (dma*: memory)
        kinds[i] = device_kind(cats[cat_code[i]], names[name_code[i]], args[i])
    gpu: list[int] = []
    streams: list[Any] = []
    for i in np.flatnonzero(dev & (kinds != None)).tolist():  # noqa: E711 (elementwise)
        s = args[i].stream
        s = s if type(s) is int else map_tid(tids[i])
        if s != -1:
            gpu.append(i)
            streams.append(s)
    code = name_code[gpu]
    stream_code = factorized(streams)[0]
    dur, clipped = _clipped(start[gpu], end[gpu], stream_code, kinds[gpu] != "sync")
    return GpuWork(
        start=start[gpu],
        end=end[gpu],
        stream=streams,
        stream_code=stream_code,
        name=names[code],
        code=code,
        kind=kinds[gpu],
        ktype=np.array([kernel_type(nm) for nm in names], dtype=object)[code],
        launch=_launches(events, xs, host, np.array(gpu, dtype=np.int64), corr),
        dur=dur,
        clipped=clipped,
        args=[args[i] for i in gpu],
        index=np.array(gpu, dtype=np.int64),
    )


def _clipped(start: np.ndarray, end: np.ndarray, stream_code: np.ndarray,
             work: np.ndarray) -> tuple[np.ndarray, int]:
    """Each event's duration, ended at the next start on its stream where it runs past it, and how many were;
    only the ``work`` events (kernels, memcpy, memset: not stream waits) clip or are clipped.

    A stream runs one thing at a time, so an end after the next start is a clock quirk (thousands of them in
    a real MTIA trace; TraceLens issue #669). Per-kernel durations (the kernel and op tables, the launch
    statistics) use these; the interval unions of the breakdowns keep the raw ends, as HTA does.
    """
    dur = end - start
    if int(work.sum()) < 2:
        return dur, 0
    idx = np.flatnonzero(work)
    n = len(idx)
    start, end = start[idx], end[idx]
    stream = stream_code[idx]
    order = np.lexsort((start, stream))
    s, e, st = start[order], end[order], stream[order]
    limit = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    same = st[1:] == st[:-1]
    limit[:-1][same] = s[1:][same]
    over = e > limit
    clipped = np.empty(n, dtype=np.int64)
    clipped[order] = np.minimum(e, limit) - s
    dur[idx] = clipped
    return dur, int(over.sum())


def _launches(events: list[Event], xs: list[Event], host: np.ndarray, gpu: np.ndarray,
              corr: np.ndarray) -> np.ndarray:
    """Per GPU event, the host event that launched it (-1: none): by ``args.correlation`` (``corr``, None where it
    is not an int or a string), the first host event's that has it, else by the ac2g flow."""
    mine = host[pd.notna(corr[host])]
    first = ~pd.Index(corr[mine]).duplicated()
    at = pd.Index(corr[mine][first]).get_indexer(corr[gpu])
    out = np.append(mine[first], -1)[np.where(pd.notna(corr[gpu]), at, -1)]
    missing = np.flatnonzero(out < 0)
    if len(missing):
        flows = _flow_launches(events, xs, host.tolist(), gpu[missing].tolist())
        out[missing] = [flows.get(i, -1) for i in gpu[missing].tolist()]
    return out


def _flow_launches(events: list[Event], xs: list[Event], host: list[int], gpu: list[int]) -> dict[int, int]:
    """Link GPU events to launches through ac2g flows: the start binds to the launch, the end to the kernel.

    A graph launch's flow has one start and an end on each of its kernels: every one of them links to it.
    """
    at = {(xs[i].pid, xs[i].tid, xs[i].ts): i for i in host}
    at_gpu = {(xs[i].pid, xs[i].tid, xs[i].ts): i for i in gpu}
    starts: dict[Any, int] = {}
    ends: list[tuple[Any, int]] = []
    for ev in events:
        if ev.ph in ("s", "f") and is_correlation_flow(ev.cat):
            key = (ev.pid, ev.tid, ev.ts)
            if ev.ph == "s" and key in at:
                starts[ev.id] = at[key]
            elif ev.ph == "f" and key in at_gpu:
                ends.append((ev.id, at_gpu[key]))
    return {k: starts[fid] for fid, k in ends if fid in starts}


def _by_step(g: GpuWork, spans: list[tuple[int, int, int]], start: np.ndarray) -> pd.DataFrame:
    """The breakdown per ``ProfilerStep#N``; GPU work belongs to the step whose CPU span holds its launch."""
    rows = []
    if spans:
        launched = np.where(g.launch >= 0, start[g.launch], g.start)
        for step, s, e in spans:
            row = {"step": step, "step_us": (e - s) / 1e3}
            row.update(_breakdown(g, (launched >= s) & (launched < e)))
            rows.append(row)
    return pd.DataFrame(rows, columns=["step", "step_us", *_breakdown(g, np.zeros(0, dtype=bool))])


def _kernel_tables(g: GpuWork, names: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per kernel name and per category, over HTA's kernel breakdown set: every GPU event but type OTHER.
    ``names``: what ``g.code`` stands for. The sums are pandas' (compensated, as HTA's are), the rest numpy's."""
    use = g.ktype != "OTHER"
    dur = g.dur[use] / 1e3
    if not len(dur):
        kernels = pd.DataFrame(columns=["name", "category", "count", "total_us", "mean_us", "min_us", "max_us",
                                        "pct", "clipped_us"])
        return kernels, pd.DataFrame(columns=["category", "count", "total_us", "pct"])
    cut = (g.end[use] - g.start[use] - g.dur[use]) / 1e3
    kind = g.kind[use]
    group, first = first_seen(g.code[use], pd.factorize(kind)[0])  # per (name, kind)
    sums = pd.DataFrame({"dur": dur, "cut": cut}).groupby(group, sort=False).sum()
    count = np.bincount(group)
    by = np.argsort(group, kind="stable")
    at = np.searchsorted(group[by], np.arange(len(first)))
    total_us, clipped_us = sums["dur"].to_numpy(), sums["cut"].to_numpy()
    name = names[g.code[use][first]]
    total = dur.sum()
    order = np.lexsort((name, -total_us))  # the longest first, then by name
    category = np.array([kernel_category(n, k) for n, k in zip(name.tolist(), kind[first].tolist())],
                        dtype=object)[order]
    kernels = pd.DataFrame({"name": name[order], "category": category, "count": count[order],
                            "total_us": total_us[order], "mean_us": (total_us / count)[order],
                            "min_us": np.minimum.reduceat(dur[by], at)[order],
                            "max_us": np.maximum.reduceat(dur[by], at)[order],
                            "pct": 100.0 * total_us[order] / total if total else 0.0,
                            "clipped_us": clipped_us[order]})
    code, cats = pd.factorize(category, sort=True)
    cats = np.asarray(cats, dtype=object)
    cat_total = pd.Series(total_us[order]).groupby(code, sort=True).sum().to_numpy()
    cat_count = np.zeros(len(cats), dtype=np.int64)
    np.add.at(cat_count, code, count[order])
    cat_order = np.lexsort((cats, -cat_total))
    return kernels, pd.DataFrame({"category": cats[cat_order],
                                  "count": cat_count[cat_order], "total_us": cat_total[cat_order],
                                  "pct": 100.0 * cat_total[cat_order] / total if total else 0.0})


def _idle_table(g: GpuWork, start: np.ndarray) -> pd.DataFrame:
    """HTA's idle time breakdown per stream, over kernels, memcpy and memset.

    Each gap before a GPU event on its stream is host wait when the event's
    launch started after the previous event ended, kernel wait when shorter
    than 30 µs, else other. As in HTA, gaps are taken between consecutive
    events by start time, so overlapping events give negative gaps.
    """
    rows = []
    has_launch = g.launch >= 0
    launch_ts = np.where(has_launch, start[g.launch], 0)
    streams: dict[int, list[int]] = defaultdict(list)
    for k, (s, kind) in enumerate(zip(g.stream, g.kind)):
        if kind != "sync":
            streams[s].append(k)
    for stream in sorted(streams):
        ks = np.array(streams[stream], dtype=np.int64)
        ks = ks[np.argsort(g.start[ks], kind="stable")]
        prev_end = g.end[ks][:-1]
        gap = g.start[ks][1:] - prev_end
        host = has_launch[ks][1:] & (launch_ts[ks][1:] > prev_end)
        kernel = ~host & (gap < KERNEL_WAIT_NS)
        other = ~host & ~kernel
        sums = [int(gap[m].sum()) / 1e3 for m in (host, kernel, other)]
        total = sum(sums)
        rows.append([stream, total, *sums, *((100.0 * x / total if total else 0.0) for x in sums)])
    return pd.DataFrame(rows, columns=["stream", "idle_us", "host_wait_us", "kernel_wait_us", "other_us",
                                       "host_wait_pct", "kernel_wait_pct", "other_pct"])


def rows_for(ranks: Iterable[RankTables], table: str) -> pd.DataFrame:
    """One cross-rank table: each rank's rows with a leading ``rank`` column."""
    ranks = list(ranks)
    non_empty = [rt for rt in ranks if len(rt.tables[table])]
    if not non_empty:
        return pd.DataFrame(columns=["rank", *(ranks[0].tables[table].columns if ranks else [])])
    out = pd.concat([rt.tables[table] for rt in non_empty], ignore_index=True)
    out.insert(0, "rank", np.repeat([rt.rank for rt in non_empty], [len(rt.tables[table]) for rt in non_empty]))
    return out
