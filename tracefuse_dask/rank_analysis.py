"""Per-rank analysis: call tree, GPU time attribution, breakdowns. Pure functions, no IO, no Dask.

One rank's events go in; small tables come out. The numbers follow
HolisticTraceAnalysis's definitions where it has them (temporal breakdown,
kernel breakdown, idle time breakdown), so that the two agree.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pandas as pd

from .collectives import rank_collectives
from .model import MergeOptions
from .rewrite import RankEvents, map_tid

__all__ = ["RankTables", "analyze_rank", "kernel_category", "kernel_type", "union_length"]

_STEP = re.compile(r"ProfilerStep#(\d+)$")
# GPU activity: kernels, memcpy, memset, and the waits of a stream (cuda_sync "Stream Sync"/"Stream Wait
# Event", which carry the stream they block), as HTA counts them; "Event/Context Sync" carry no stream.
_GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset", "cuda_sync": "sync"}
_OP_CATS = frozenset({"cpu_op", "user_annotation"})
_CATEGORY_RULES = [  # first match wins; names are lower-cased
    ("communication", re.compile(r"nccl|rccl|gloo|all_?reduce|all_?gather|reduce_?scatter|alltoall|broadcast")),
    ("memory", re.compile(r"^memcpy|^memset|memcpy|memset")),
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa|mha_")),
    ("GEMM", re.compile(r"gemm|matmul|cutlass|cublas|xmma|wgmma|nvjet|cijk_|triton_tem|_mm_|^mm_|bmm")),
    ("reduce", re.compile(r"reduce|reduction|softmax|norm|triton_red|triton_per|argmax|argmin|scan|sum_")),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_poi|fill|copy|cat_|index|"
                               r"scatter|gather|where|add|mul|div|sub|relu|gelu|silu|sigmoid|tanh|exp|neg")),
]
# HTA 0.5.0's kernel classes (hta/utils/utils.py), by name alone.
_HTA_COMM = re.compile(r"^nccl.*Kernel")
_HTA_MEMORY = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
# HTA's consecutive_kernel_delay=30, compared with µs timestamps (its docstring says ns): shorter gaps
# between kernels of a stream are launch overhead.
KERNEL_WAIT_NS = 30_000
TABLES = ("breakdown", "breakdown_by_step", "kernels", "kernel_categories", "ops", "kernel_launchers", "idle",
          "collectives")


def kernel_type(name: str) -> str:
    """HTA's kernel type of a GPU event name: COMMUNICATION, MEMORY, COMPUTATION or OTHER."""
    if _HTA_COMM.match(name):
        return "COMMUNICATION"
    if _HTA_MEMORY.match(name):
        return "MEMORY"
    if not _HTA_NOT_COMPUTE.match(name):
        return "COMPUTATION"
    return "OTHER"


def kernel_category(name: str, gpu_kind: str) -> str:
    """The finer category of the kernel summary: GEMM, attention, elementwise, reduce, communication, memory, other."""
    if gpu_kind in ("memcpy", "memset"):
        return "memory"
    if gpu_kind == "sync":
        return "other"
    low = name.lower()
    for category, rule in _CATEGORY_RULES:
        if rule.search(low):
            return category
    return "other"


def _ns(us: np.ndarray) -> np.ndarray:
    """Exact integer ns of µs values, as ``rewrite.to_ns`` (the fraction of a float below 2**52 is exact)."""
    whole = np.trunc(us)
    return whole.astype(np.int64) * 1000 + np.rint((us - whole) * 1000).astype(np.int64)


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


@dataclass
class RankTables:
    """What one rank's task returns: small tables, and the numbers ``summary.json`` holds."""

    rank: int
    path: str
    tables: dict[str, pd.DataFrame]
    numbers: dict[str, Any]
    steps: list[int]
    host: str | None = None
    pg_config: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class _Gpu:
    """A rank's GPU activity (kernels, memcpy, memset) as arrays, in input order."""

    idx: np.ndarray
    start: np.ndarray
    end: np.ndarray
    stream: list[Any]
    name: list[str]
    kind: list[str]
    ktype: np.ndarray  # HTA kernel type per event
    launch: np.ndarray  # index of the launching runtime event, or -1


def _breakdown(g: _Gpu, mask: np.ndarray | None = None) -> dict[str, float]:
    """HTA's temporal breakdown, plus the per-category unions and the exposed communication (µs)."""
    if mask is not None:
        start, end, ktype = g.start[mask], g.end[mask], g.ktype[mask]
    else:
        start, end, ktype = g.start, g.end, g.ktype
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
    kinds = np.array(g.kind if mask is None else [k for k, m in zip(g.kind, mask) if m])
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


def _call_tree(events: list[dict[str, Any]], host: list[int], start: dict[int, int],
               end: dict[int, int]) -> tuple[list[int], dict[int, int]]:
    """Nest host events per (pid, tid) by (ts, -dur): ``(order, parent)``.

    ``order`` lists every host event with each thread's parents before their
    children; ``parent`` maps an event to its innermost enclosing event (absent
    for roots). Equal timestamps nest the longer event outside; a zero-length
    event at another's start is its child.
    """
    threads: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for i in host:
        threads[(events[i]["pid"], events[i].get("tid"))].append(i)
    order: list[int] = []
    parent: dict[int, int] = {}
    for members in threads.values():
        members.sort(key=lambda i: (start[i], -end[i], i))
        stack: list[int] = []
        for i in members:
            e = end[i]
            while stack and e > end[stack[-1]]:
                stack.pop()
            if stack:
                parent[i] = stack[-1]
            stack.append(i)
        order.extend(members)
    return order, parent


def _shape_text(value: Any) -> str:
    return "" if value is None else orjson.dumps(value).decode()


def _top(counter: Counter[str], n: int = 3) -> str:
    return " | ".join(name for name, _ in counter.most_common(n))


def analyze_rank(events: list[Any], rank: int, path: str, steps: tuple[int, int] | None = None, *, base: int = 0,
                 header: Mapping[str, Any] | None = None) -> RankTables:
    """Analyse one rank's events (``traceEvents``, as parsed).

    Parameters
    ----------
    events
        The rank's events; validated as ``merge`` validates them.
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
        The file's other top-level keys (``distributedInfo.pg_config``, ``host_name``).

    Returns
    -------
    RankTables
    """
    who = f"{path} (rank {rank})"
    sel = RankEvents(events, 0, MergeOptions(steps=steps), who, link_flows=False)
    keep, dev = sel.keep, sel.dev
    xs = [i for i, ev in enumerate(events) if keep[i] and ev["ph"] == "X"]
    starts = _ns(np.array([events[i]["ts"] for i in xs], dtype=np.float64))
    ends = starts + _ns(np.array([events[i].get("dur", 0) for i in xs], dtype=np.float64))
    start: dict[int, int] = dict(zip(xs, starts.tolist()))
    end: dict[int, int] = dict(zip(xs, ends.tolist()))
    host = [i for i in xs if not dev[i]]
    gpu = [i for i in xs if dev[i] and events[i].get("cat", "").lower() in _GPU_CATS and _stream(events[i]) != -1]
    order, parent = _call_tree(events, host, start, end)
    launch_of = _launches(events, host, gpu, keep)
    g = _gpu_arrays(events, gpu, start, end, launch_of)
    step_spans = sorted((int(m.group(1)), start[i], end[i]) for i in host
                        if (m := _STEP.match(events[i].get("name", ""))))
    tables: dict[str, pd.DataFrame] = {}
    numbers = _breakdown(g)
    tables["breakdown"] = pd.DataFrame([numbers])
    tables["breakdown_by_step"] = _by_step(g, step_spans, start)
    tables["kernels"], tables["kernel_categories"] = _kernel_tables(g)
    tables["ops"], tables["kernel_launchers"] = _op_tables(events, order, parent, g)
    tables["idle"] = _idle_table(g, start)
    header = header or {}
    info = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}
    pgs = {str(pg["pg_name"]): list(pg["ranks"]) for pg in info.get("pg_config") or []
           if isinstance(pg, dict) and "pg_name" in pg and isinstance(pg.get("ranks"), list)}
    gpu_launch = [(int(j), int(a), int(b), s, n) for j, a, b, s, n in zip(g.launch, g.start, g.end, g.stream, g.name)
                  if j >= 0]
    tables["collectives"] = rank_collectives(events, order, parent, start, end, gpu_launch, step_spans, base, pgs)
    host = header.get("host_name")
    return RankTables(rank, path, tables, numbers, [s for s, _, _ in step_spans],
                      host=host if isinstance(host, str) else None, pg_config=pgs)


def _launches(events: list[dict[str, Any]], host: list[int], gpu: list[int], keep: list[bool]) -> dict[int, int]:
    """GPU event -> the host event that launched it: by ``args.correlation``, else by the ac2g flow."""
    by_corr: dict[Any, int] = {}
    for i in host:
        args = events[i].get("args")
        if type(args) is dict:
            c = args.get("correlation")
            if type(c) is int or type(c) is str:
                by_corr.setdefault(c, i)
    out: dict[int, int] = {}
    missing: list[int] = []
    for i in gpu:
        args = events[i].get("args")
        c = args.get("correlation") if type(args) is dict else None
        j = by_corr.get(c) if type(c) is int or type(c) is str else None
        if j is None:
            missing.append(i)
        else:
            out[i] = j
    if missing:
        out.update(_flow_launches(events, host, missing, keep))
    return out


def _flow_launches(events: list[dict[str, Any]], host: list[int], gpu: list[int], keep: list[bool]) -> dict[int, int]:
    """Link GPU events to launches through ac2g flows: the start binds to the launch, the end to the kernel."""
    at = {(events[i]["pid"], events[i].get("tid"), events[i]["ts"]): i for i in host}
    at_gpu = {(events[i]["pid"], events[i].get("tid"), events[i]["ts"]): i for i in gpu}
    starts: dict[Any, int] = {}
    ends: dict[Any, int] = {}
    for i, ev in enumerate(events):
        if keep[i] and ev["ph"] in ("s", "f") and ev.get("cat") == "ac2g":
            key = (ev["pid"], ev.get("tid"), ev["ts"])
            if ev["ph"] == "s" and key in at:
                starts[ev.get("id")] = at[key]
            elif ev["ph"] == "f" and key in at_gpu:
                ends[ev.get("id")] = at_gpu[key]
    return {k: starts[fid] for fid, k in ends.items() if fid in starts}


def _stream(ev: dict[str, Any]) -> int:
    """The GPU stream of a device event: ``args.stream``, else its tid (-1 when ``args.stream`` says none)."""
    args = ev.get("args")
    s = args.get("stream") if type(args) is dict else None
    return s if type(s) is int else map_tid(ev.get("tid"))


def _gpu_arrays(events: list[dict[str, Any]], gpu: list[int], start: dict[int, int], end: dict[int, int],
                launch_of: dict[int, int]) -> _Gpu:
    names = [events[i].get("name", "") for i in gpu]
    kinds = [_GPU_CATS[events[i]["cat"].lower()] for i in gpu]
    streams = [_stream(events[i]) for i in gpu]
    return _Gpu(
        idx=np.array(gpu, dtype=np.int64),
        start=np.array([start[i] for i in gpu], dtype=np.int64),
        end=np.array([end[i] for i in gpu], dtype=np.int64),
        stream=streams,
        name=names,
        kind=kinds,
        ktype=np.array([kernel_type(n) for n in names], dtype=object),
        launch=np.array([launch_of.get(i, -1) for i in gpu], dtype=np.int64),
    )


def _by_step(g: _Gpu, spans: list[tuple[int, int, int]], start: dict[int, int]) -> pd.DataFrame:
    """The breakdown per ``ProfilerStep#N``; GPU work belongs to the step whose CPU span holds its launch."""
    rows = []
    if spans:
        launched = np.array([start[int(j)] if j >= 0 else int(s) for j, s in zip(g.launch, g.start)],
                            dtype=np.int64)
        for step, s, e in spans:
            row = {"step": step, "step_us": (e - s) / 1e3}
            row.update(_breakdown(g, (launched >= s) & (launched < e)))
            rows.append(row)
    return pd.DataFrame(rows, columns=["step", "step_us", *_breakdown(g, np.zeros(0, dtype=bool))])


def _kernel_tables(g: _Gpu) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per kernel name and per category, over HTA's kernel breakdown set: every GPU event but type OTHER."""
    use = g.ktype != "OTHER"
    dur = (g.end[use] - g.start[use]) / 1e3
    df = pd.DataFrame({"name": [n for n, u in zip(g.name, use) if u], "kind": [k for k, u in zip(g.kind, use) if u],
                       "dur": dur})
    if df.empty:
        kernels = pd.DataFrame(columns=["name", "category", "count", "total_us", "mean_us", "min_us", "max_us",
                                        "pct"])
        return kernels, pd.DataFrame(columns=["category", "count", "total_us", "pct"])
    total = dur.sum()
    kernels = df.groupby(["name", "kind"], sort=False)["dur"].agg(
        count="count", total_us="sum", mean_us="mean", min_us="min", max_us="max").reset_index()
    kernels.insert(1, "category", [kernel_category(n, k) for n, k in zip(kernels["name"], kernels["kind"])])
    kernels = kernels.drop(columns="kind")
    kernels["pct"] = 100.0 * kernels["total_us"] / total if total else 0.0
    kernels = kernels.sort_values(["total_us", "name"], ascending=[False, True], ignore_index=True)
    cats = kernels.groupby("category")[["count", "total_us"]].sum().reset_index()
    cats["pct"] = 100.0 * cats["total_us"] / total if total else 0.0
    return kernels, cats.sort_values(["total_us", "category"], ascending=[False, True], ignore_index=True)


def _op_tables(events: list[dict[str, Any]], order: list[int], parent: dict[int, int],
               g: _Gpu) -> tuple[pd.DataFrame, pd.DataFrame]:
    """TreePerf-like tables: GPU time per op name over its subtree, and the leaf ops that launch kernels."""
    gpu_ns: dict[int, int] = defaultdict(int)
    n_kernels: dict[int, int] = defaultdict(int)
    durs = g.end - g.start
    for j, d in zip(g.launch.tolist(), durs.tolist()):
        if j >= 0:
            gpu_ns[j] += d
            n_kernels[j] += 1
    for i in reversed(order):  # children before parents: each node adds its total to its parent once, O(N)
        p = parent.get(i)
        if p is not None and i in gpu_ns:
            gpu_ns[p] += gpu_ns[i]
            n_kernels[p] += n_kernels[i]
    is_op = {i for i in order if events[i].get("cat") in _OP_CATS and not _STEP.match(events[i].get("name", ""))}
    # Which kernels each op name launched, through the tree: one walk up from each launch, O(kernels x depth).
    op_kernels: dict[str, Counter[str]] = defaultdict(Counter)
    launcher_kernels: dict[int, Counter[str]] = defaultdict(Counter)
    launcher_count: Counter[int] = Counter()
    for j, name, d in zip(g.launch.tolist(), g.name, durs.tolist()):
        if j < 0:
            continue
        seen: set[str] = set()
        p: int | None = j
        leaf = None
        while p is not None:
            if p in is_op:
                op = events[p]["name"]
                if leaf is None and events[p].get("cat") == "cpu_op":
                    leaf = p
                if op not in seen:
                    seen.add(op)
                    op_kernels[op][name] += d
            p = parent.get(p)
        if leaf is not None:
            launcher_kernels[leaf][name] += d
            launcher_count[leaf] += 1
    total_gpu = int(durs.sum())
    rows: dict[str, list[float]] = {}
    for i in is_op:
        ev = events[i]
        r = rows.setdefault(ev["name"], [0, 0, 0, 0])
        r[0] += 1
        r[1] += ev.get("dur", 0)
        r[2] += gpu_ns.get(i, 0)
        r[3] += n_kernels.get(i, 0)
    ops = pd.DataFrame(
        [(name, int(c), cpu, gns / 1e3, 100.0 * gns / total_gpu if total_gpu else 0.0, int(k),
          _top(op_kernels.get(name, Counter()))) for name, (c, cpu, gns, k) in rows.items()],
        columns=["name", "count", "cpu_time_us", "gpu_time_us", "gpu_pct", "kernel_count", "top_kernels"])
    ops = ops.sort_values(["gpu_time_us", "cpu_time_us", "name"], ascending=[False, False, True], ignore_index=True)
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for i, kernels in launcher_kernels.items():
        args = events[i].get("args") if type(events[i].get("args")) is dict else {}
        key = (events[i]["name"], _shape_text(args.get("Input Dims")), _shape_text(args.get("Input type")))
        r = groups.setdefault(key, [0, 0, 0, Counter()])
        r[0] += 1
        r[1] += sum(kernels.values())
        r[2] += launcher_count[i]
        r[3].update(kernels)
    launchers = pd.DataFrame(
        [(*key, c, gns / 1e3, k, _top(kc)) for key, (c, gns, k, kc) in groups.items()],
        columns=["name", "input_dims", "input_types", "count", "gpu_time_us", "kernel_count", "top_kernels"])
    launchers = launchers.sort_values(["gpu_time_us", "name", "input_dims"], ascending=[False, True, True],
                                      ignore_index=True)
    return ops, launchers


def _idle_table(g: _Gpu, start: dict[int, int]) -> pd.DataFrame:
    """HTA's idle time breakdown per stream, over kernels, memcpy and memset.

    Each gap before a GPU event on its stream is host wait when the event's
    launch started after the previous event ended, kernel wait when shorter
    than 30 µs, else other. As in HTA, gaps are taken between consecutive
    events by start time, so overlapping events give negative gaps.
    """
    rows = []
    has_launch = g.launch >= 0
    launch_ts = np.array([start[int(j)] if j >= 0 else 0 for j in g.launch], dtype=np.int64)
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
    frames = []
    for rt in ranks:
        df = rt.tables[table]
        frames.append(df.assign(rank=rt.rank)[["rank", *df.columns]] if len(df) else df)
    non_empty = [f for f in frames if len(f)]
    if not non_empty:
        return pd.DataFrame(columns=["rank", *(frames[0].columns if frames else [])])
    return pd.concat(non_empty, ignore_index=True)
