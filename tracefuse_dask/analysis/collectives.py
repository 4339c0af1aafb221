"""Collectives: each rank's calls (a map task); matching, wait and skew, stragglers, clock offsets (a reduction).

Pure functions on events and small DataFrames; no IO, no Dask. See the spec §5: ``Rank`` in
``record_param_comms`` is group-local and ``Sequence number`` is autograd's, so neither is used
to match; ``Seq`` (PyTorch >= March 2026) is, when present.
"""
from __future__ import annotations

import contextlib
import functools
import re
from collections import defaultdict
from collections.abc import Mapping, Set
from typing import Any

import numpy as np
import orjson
import pandas as pd

from ..kineto.vocabulary import COLLECTIVE_OP_PREFIXES, is_comm_kernel
from ..model import RankSet

__all__ = ["CALL_COLUMNS", "canonical_op", "clock_offsets", "group_members", "group_spec", "match_collectives",
           "rank_collectives", "straggler"]

_OP_SUFFIX = re.compile(r"(base|single|intotensor|tensor|coalesced)$")
# bytes per element of each dtype name, as the profiler (c10 names) and torch (``torch.float32``) write them
ITEMSIZE = {"float": 4, "float32": 4, "bfloat16": 2, "half": 2, "float16": 2, "double": 8, "float64": 8,
            "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "byte": 1,
            "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "signed char": 1,
            "unsigned char": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complexfloat": 8, "complexdouble": 16,
            "complex64": 8, "complex128": 16}
_OP_PREFIX = re.compile("^(" + "|".join(map(re.escape, COLLECTIVE_OP_PREFIXES)) + ")")
CALL_COLUMNS = ["index", "op", "name", "pg_name", "pg_desc", "group_ranks", "group_size", "dtype", "in_nelems",
                "out_nelems", "in_bytes", "out_bytes", "input_dims", "seq", "comms_id", "step", "tid",
                "cpu_start_ns", "cpu_end_ns", "gpu_start_ns", "gpu_end_ns", "stream", "done_ns"]


def canonical_op(name: str) -> str:
    """One spelling per collective: ``c10d::allreduce_``, ``nccl:all_reduce`` and ``allreduce`` are ``allreduce``."""
    s = _OP_PREFIX.sub("", name).lower().replace("_", "")
    while (t := _OP_SUFFIX.sub("", s)) != s and t:
        s = t
    return s


def group_spec(ranks: Any) -> str | None:
    """A group's global ranks as a rank spec (``0-63:8``, see ``RankSet.of``), from a list or its JSON text.

    ``Process Group Ranks`` lists every rank of a group, so its text grows with the world size
    (59 kB for 10,000 ranks, on every call of every rank); the spec stays a few bytes.
    None when ``ranks`` is not a list of ranks.
    """
    if isinstance(ranks, str):
        return _text_spec(ranks)
    try:
        return RankSet.of(ranks).spec
    except (TypeError, ValueError):  # not a list of ranks (TypeError: not a list at all)
        return None


@functools.lru_cache(maxsize=256)
def _text_spec(text: str) -> str | None:
    """``group_spec`` of a list's JSON text, once per text and process: every call of a group has the same."""
    try:
        ranks = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return None if isinstance(ranks, str) else group_spec(ranks)


@functools.lru_cache(maxsize=64)
def group_members(spec: str) -> frozenset[int]:
    """The ranks of a group's rank spec (``group_spec``), once per spec and process: every call and rank
    of a group has the same. Raises ``ValueError`` when ``spec`` is not a rank spec."""
    return frozenset(RankSet.parse(spec).ranks())


def _dims_product(dims: Any) -> int | None:
    """Elements of the first tensor in ``Input Dims`` (a tensor list counts its first tensor)."""
    if not isinstance(dims, list):
        return None
    for d in dims:
        while isinstance(d, list) and d and isinstance(d[0], list):
            d = d[0]
        if isinstance(d, list) and d and all(type(v) is int for v in d):
            return int(np.prod(d))
    return None


def rank_collectives(name_code: np.ndarray, names: np.ndarray, tids: np.ndarray, args: list[Any],
                     order: np.ndarray, stop: np.ndarray, members: np.ndarray, start: np.ndarray, end: np.ndarray,
                     launch_pos: np.ndarray, gpu: Any, steps: list[tuple[int, int, int]], base: int,
                     pg_config: Mapping[str, str]) -> pd.DataFrame:
    """One rank's collective calls, one row each, times in absolute ns.

    A call is the outermost of a chain of ``c10d::*``, ``record_param_comms``, ``nccl:*``
    and ``gloo:*`` events; its args are gathered over the chain, and its GPU times are those
    of the NCCL/RCCL kernels launched inside it. A ``gloo:*`` annotation on its own runloop
    thread is the execution of a ``c10d::*`` call, not a call, when the rank has ``c10d::*`` calls.
    Only the chains' events are read, not the whole rank's.

    ``done_ns`` is when the collective was done on this rank: its last kernel's end; for a gloo call, the end of
    its execution (the first unpaired ``gloo:*`` of its op that starts after it, in order: gloo runs a group's
    work in the order it was queued), as ``c10d::*`` returns once the work is queued; else the call's end.

    Parameters
    ----------
    name_code, names
        Per event, its name as a code into ``names``.
    tids, args, start, end
        Per event: its tid, ``args`` (the struct of ``analysis.rank``) and relative
        start and end (ns).
    order, stop
        The call tree: the host event at each position (each thread's parents before
        their children), and where each position's subtree ends (exclusive).
    members
        The positions, ascending, of the events whose name ``is_collective_call``.
    launch_pos
        Per GPU event, the position of the host event that launched it (-1: none).
    gpu
        The GPU events (``analysis.rank._Gpu``): their ``start``, ``end``, ``stream``, ``name`` and ``args``.
    steps
        ``(step, start, end)`` of each ``ProfilerStep#N`` (relative ns).
    pg_config
        ``distributedInfo.pg_config`` as ``{pg_name: rank spec of its global ranks}`` (``group_spec``).
    """
    root = np.full(len(order), -1, dtype=np.int64)  # the outermost member holding each position
    chain = []  # (its event, its root's event) of each member
    reach = top = 0
    for k in members.tolist():
        if k >= reach:
            top, reach = k, int(stop[k])
            root[k:reach] = k
        chain.append((int(order[k]), int(order[top])))
    has_c10d = any(names[name_code[i]].startswith("c10d::") for i, _ in chain)
    calls: dict[int, dict[str, Any]] = {}  # by the root's event
    runs: dict[str, list[tuple[int, int]]] = defaultdict(list)  # gloo's executions, by op: (start, end)
    for i, r in chain:
        if r not in calls:
            name = names[name_code[r]]
            if has_c10d and name.startswith("gloo:"):
                if i == r:
                    runs[canonical_op(name)].append((int(start[r]) + base, int(end[r]) + base))
                continue
            calls[r] = {"name": name, "tid": tids[r], "cpu_start_ns": int(start[r]) + base,
                        "cpu_end_ns": int(end[r]) + base}
        _gather(calls[r], names[name_code[i]], args[i])
    held = root[launch_pos] if len(root) else launch_pos  # -1: not inside a call
    for j in np.flatnonzero((launch_pos >= 0) & (held >= 0)).tolist():  # the GPU work launched inside calls
        r = int(order[held[j]])
        if r in calls and is_comm_kernel(gpu.name[j], gpu.args[j]):
            c = calls[r]
            s, e = int(gpu.start[j]) + base, int(gpu.end[j]) + base
            c["gpu_start_ns"] = min(c.get("gpu_start_ns", s), s)
            c["gpu_end_ns"] = max(c.get("gpu_end_ns", e), e)
            c["stream"] = gpu.stream[j]
    rows = []
    sizes = {pg: len(group_members(spec)) for pg, spec in pg_config.items()}
    for run in runs.values():
        run.sort(reverse=True)
    for k, r in enumerate(sorted(calls, key=lambda r: (calls[r]["cpu_start_ns"], r))):
        c = calls[r]
        op = canonical_op(c.get("collective") or c.get("op_name") or c["name"])
        run = runs.get(op, [])
        while run and run[-1][0] < c["cpu_start_ns"]:  # an execution of work queued before the trace began
            run.pop()
        done = c.get("gpu_end_ns") or (run.pop()[1] if run else c["cpu_end_ns"])
        pg = c.get("pg_name")
        text = c.get("group_ranks")
        # Kineto writes the first 30 ranks of a bigger group and "...": then pg_config has them all
        ranks = group_spec(text) or pg_config.get(pg) or text
        itemsize = ITEMSIZE.get(str(c.get("dtype", "")).lower())
        in_n, out_n = c.get("in_nelems"), c.get("out_nelems")
        rows.append({
            "index": k, "op": op,
            "name": c["name"], "pg_name": pg, "pg_desc": c.get("pg_desc"), "group_ranks": ranks,
            "group_size": c.get("group_size") or sizes.get(pg),
            "dtype": c.get("dtype"), "in_nelems": in_n, "out_nelems": out_n,
            "in_bytes": in_n * itemsize if in_n is not None and itemsize else None,
            "out_bytes": out_n * itemsize if out_n is not None and itemsize else None,
            "input_dims": c.get("input_dims"), "seq": c.get("seq"), "comms_id": c.get("comms_id"),
            "step": _step_of(steps, c["cpu_start_ns"] - base), "tid": str(c["tid"]),
            "cpu_start_ns": c["cpu_start_ns"], "cpu_end_ns": c["cpu_end_ns"],
            "gpu_start_ns": c.get("gpu_start_ns"), "gpu_end_ns": c.get("gpu_end_ns"), "stream": c.get("stream"),
            "done_ns": done,
        })
    df = pd.DataFrame(rows, columns=CALL_COLUMNS)
    # From the rows, not from the frame: pandas makes a column of ints and None float64, where absolute ns (1.7e18)
    # lose up to 128 ns to a float's 53 bits; a call's GPU start then fell after its first kernel's start, so that
    # ``critical_path.rank_pieces`` did not find the call's kernels, and the path stopped at its arrival.
    for col in ("group_size", "in_nelems", "out_nelems", "in_bytes", "out_bytes", "seq", "step", "gpu_start_ns",
                "gpu_end_ns", "stream", "done_ns"):
        df[col] = pd.array([r[col] for r in rows], dtype="Int64")
    for col in ("op", "name", "pg_name", "pg_desc", "group_ranks", "dtype", "input_dims", "comms_id", "tid"):
        df[col] = df[col].astype("string")
    return df


def _gather(call: dict[str, Any], name: str, args: Any) -> None:
    """Take a chain member's args into its call; the first value seen wins."""
    if name.startswith(COLLECTIVE_OP_PREFIXES):
        call.setdefault("op_name", name)
    found = {
        "collective": args.collective,
        "pg_name": args.pg_name,
        "pg_desc": args.pg_desc,
        "group_ranks": args.group_ranks,
        "group_size": args.group_size,
        "dtype": args.dtype,
        "in_nelems": args.in_nelems,
        "out_nelems": args.out_nelems,
        "seq": args.seq,
        "comms_id": args.comms_id,
    }
    for key, value in found.items():
        if value is not None and value != "" and key not in call:
            call[key] = str(value) if key in ("pg_name", "comms_id", "group_ranks") else value
    dims = orjson.loads(memoryview(args.input_dims)) if args.input_dims else None  # raw JSON text, empty when absent
    if dims is not None and "input_dims" not in call and _dims_product(dims):
        call["input_dims"] = orjson.dumps(dims).decode()
        n = _dims_product(dims)
        types = orjson.loads(memoryview(args.input_types)) if args.input_types else None
        dtype = next((t for t in types if t and t not in ("Scalar", "TensorList")), None) if isinstance(
            types, list) else None
        call.setdefault("in_nelems", n)
        if dtype:
            call.setdefault("dtype", dtype)


def _step_of(spans: list[tuple[int, int, int]], t: int) -> int | None:
    for step, s, e in spans:
        if s <= t < e:
            return step
    return None


def _expected(row_ranks: Any, pg: Any, pg_members: Mapping[str, set[int]]) -> Set[int] | None:
    """The global ranks of an instance's group: ``Process Group Ranks``, else ``pg_config``; None when unknown."""
    if isinstance(row_ranks, str):
        with contextlib.suppress(ValueError):  # not a rank spec: the trace's text, kept as it was
            return group_members(row_ranks)
    return pg_members.get(pg) if isinstance(pg, str) else None


def match_collectives(calls: pd.DataFrame, pg_members: Mapping[str, set[int]]) -> tuple[pd.DataFrame, list[str]]:
    """Match each rank's calls into collective instances; return the matched calls and the problems.

    The key is (process group, ``Seq``) when every call of the group has a ``Seq``; else
    (process group, ordinal in the group) counted from the first ``ProfilerStep#N`` all ranks
    share; for calls with no process group (gloo) it is (op, input shape, ordinal). An instance
    whose ranks disagree on the op or message size, or that lacks an expected rank that is in
    the inputs, is reported and left out.
    """
    if calls.empty:
        return calls.assign(instance=pd.Series(dtype="Int64")), []
    df = calls.copy()
    df["channel"] = df["pg_name"].fillna("op " + df["op"] + " " + df["input_dims"].fillna("?"))
    if df["step"].notna().any():
        common = [set(g.dropna()) for _, g in df.groupby("rank")["step"]]
        shared = set.intersection(*common) if common else set()
        if shared:
            df = df[df["step"].ge(min(shared)).fillna(False)]
    df = df.sort_values(["rank", "cpu_start_ns"], kind="stable")
    df["ordinal"] = df.groupby(["rank", "channel"]).cumcount()
    by_seq = df.groupby("channel")["seq"].transform(lambda s: s.notna().all())
    df["key"] = np.where(by_seq, "seq " + df["seq"].astype("string").fillna(""), "n " + df["ordinal"].astype(str))
    present = set(df["rank"])
    problems: list[str] = []
    group = df.groupby(["channel", "key"], sort=False).ngroup().to_numpy()
    members = np.split(np.argsort(group, kind="stable"), np.cumsum(np.bincount(group))[:-1])
    ops, sizes = df["op"].groupby(group).nunique().to_numpy(), df["in_nelems"].groupby(group).nunique().to_numpy()
    op, channel, key, rank = (df[c].to_numpy() for c in ("op", "channel", "key", "rank"))
    group_ranks, pg_name, nelems = (df[c].to_numpy() for c in ("group_ranks", "pg_name", "in_nelems"))
    keep = np.zeros(len(df), dtype=bool)
    inst = np.full(len(df), -1, dtype=np.int64)
    n = 0
    for k, rows in enumerate(members):
        f = rows[0]
        where = f"{op[f]} #{key[f].split()[-1]} of group {channel[f]}"
        if ops[k] > 1 or sizes[k] > 1:
            listed = ", ".join(f"rank {rank[i]}: {op[i]} {nelems[i]}" for i in rows)
            problems.append(f"inconsistent {where}: {listed}")
            continue
        expected = _expected(group_ranks[f], pg_name[f], pg_members)
        missing = sorted((expected & present) - set(rank[rows].tolist())) if expected else []
        if missing or len(rows) < 2:
            who = missing or f"other than {rank[rows].tolist()}"
            problems.append(f"unmatched {where}: no call from rank(s) {who}")
            continue
        keep[rows] = True
        inst[rows] = n
        n += 1
    out = df.assign(instance=inst)[keep]
    return out.reset_index(drop=True), problems


_BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
               "reducescatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n}


def instance_metrics(matched: pd.DataFrame, offsets_ns: Mapping[int, float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per instance: arrival skew, last rank, comm latency, algbw/busbw; per (instance, rank): the wait.

    Arrival is the GPU kernel start when every rank of the instance has one, else the CPU
    start; times are first corrected by ``offsets_ns`` (what to subtract from each rank).
    """
    cols = ["instance", "op", "group", "bytes", "ranks", "skew_us", "last_rank", "comm_latency_us", "algbw_gbps",
            "busbw_gbps", "step", "on_gpu"]
    if matched.empty:
        return pd.DataFrame(columns=cols), pd.DataFrame(columns=["instance", "rank", "arrival_us", "wait_us"])
    m = matched.sort_values("instance", kind="stable")
    inst = m["instance"].to_numpy(dtype=np.int64)
    on_gpu = m["gpu_start_ns"].notna().groupby(inst).transform("all").to_numpy()
    shift = m["rank"].map(lambda r: offsets_ns.get(r, 0.0)).to_numpy(dtype=float)
    # times from a common base before they become floats: absolute ns (1.7e18) as floats are 256 ns apart
    base = int(m["cpu_start_ns"].min())
    start = np.where(on_gpu, (m["gpu_start_ns"] - base).astype(float), (m["cpu_start_ns"] - base).astype(float)) - shift
    end = np.where(on_gpu, (m["gpu_end_ns"] - base).astype(float), (m["cpu_end_ns"] - base).astype(float)) - shift
    ranks = m["rank"].to_numpy(dtype=np.int64)
    t = pd.DataFrame({"start": start, "took": end - start, "bytes": np.fmax(m["in_bytes"].astype(float),
                                                                           m["out_bytes"].astype(float))})
    by = t.groupby(inst, sort=True)
    first, last = by["start"].min(), by["start"].max()
    at_last = start == last.reindex(inst).to_numpy()
    last_rank = pd.Series(ranks[at_last]).groupby(inst[at_last]).min()
    firsts = m.groupby(inst, sort=True)[["op", "channel"]].first()
    steps = m["step"].groupby(inst, sort=True).min()
    rows = []
    for i, n, took, size, lo, hi, who, on, op, channel, step in zip(
            first.index.tolist(), by.size().tolist(), by["took"].min().tolist(), by["bytes"].max().tolist(),
            first.tolist(), last.tolist(), last_rank.tolist(), m.groupby(inst, sort=True)["gpu_start_ns"].count(),
            firsts["op"], firsts["channel"], steps):
        latency = took / 1e3
        nbytes = None if np.isnan(size) else int(size)
        algbw = nbytes / (latency * 1e3) if nbytes and latency > 0 else None  # bytes/ns = GB/s
        busbw = algbw * _BUS_FACTOR.get(op, lambda n: 1.0)(n) if algbw is not None else None
        rows.append([i, op, channel, nbytes, n, (hi - lo) / 1e3, who, latency, algbw, busbw,
                     None if pd.isna(step) else step, on == n])
    waits = pd.DataFrame({"instance": inst, "rank": ranks, "arrival_us": (start - first.reindex(inst).to_numpy()) / 1e3,
                          "wait_us": (last.reindex(inst).to_numpy() - start) / 1e3})
    return pd.DataFrame(rows, columns=cols), waits


def op_summary(instances: pd.DataFrame) -> pd.DataFrame:
    """Per op, message size and scope (intra- or inter-node, ``efficiency.link_use``): count, comm latency (total,
    mean, max), mean skew, mean bus bandwidth and its mean % of the links' peak."""
    cols = ["op", "bytes", "scope", "count", "latency_total_us", "latency_mean_us", "latency_max_us", "skew_mean_us",
            "busbw_mean_gbps", "link_pct_mean"]
    if instances.empty:
        return pd.DataFrame(columns=cols)
    g = instances.groupby(["op", "bytes", "scope"], dropna=False)
    out = g.agg(count=("instance", "count"), latency_total_us=("comm_latency_us", "sum"),
                latency_mean_us=("comm_latency_us", "mean"), latency_max_us=("comm_latency_us", "max"),
                skew_mean_us=("skew_us", "mean"), busbw_mean_gbps=("busbw_gbps", "mean"),
                link_pct_mean=("link_pct", "mean")).reset_index()
    return out.sort_values(["latency_total_us", "op"], ascending=[False, True], ignore_index=True)[cols]


def straggler(instances: pd.DataFrame, waits: pd.DataFrame, matched: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Per rank: times last, wait caused, own wait, compute before collectives; and the verdict from the waiting.

    The verdict names the rank that caused most of the waiting when its share stands out:
    ``confidence`` rescales its share of all caused waiting from ``1/ranks`` (nobody stands
    out) to 1 (all of it); a rank is named at 0.5 and above. ``what_if.verdict`` replaces the naming with
    what fixing each rank is worth wherever the ranks share a step; this one stands without steps.
    """
    cols = ["rank", "collectives", "last_count", "wait_caused_us", "own_wait_us", "compute_before_us"]
    if instances.empty:
        return pd.DataFrame(columns=cols), {"rank": None, "confidence": 0.0,
                                            "evidence": "no matched collectives across ranks"}
    lasts = instances.set_index("instance")["last_rank"]
    w = waits.assign(last=waits["instance"].map(lasts))
    caused = w[w["rank"] != w["last"]].groupby("last")["wait_us"].sum()
    before = _compute_before(matched)
    table = pd.DataFrame({
        "collectives": w.groupby("rank")["instance"].count(),
        "last_count": lasts.value_counts(),
        "wait_caused_us": caused,
        "own_wait_us": w.groupby("rank")["wait_us"].sum(),
        "compute_before_us": before,
    }).fillna(0).rename_axis("rank").reset_index()
    table = table[cols].astype({"rank": int, "collectives": int, "last_count": int})
    n_ranks = len(table)
    total = float(table["wait_caused_us"].sum())
    top = table.sort_values(["wait_caused_us", "rank"], ascending=[False, True]).iloc[0]
    share = float(top["wait_caused_us"]) / total if total else 0.0
    confidence = max(0.0, (share - 1 / n_ranks) / (1 - 1 / n_ranks)) if n_ranks > 1 else 0.0
    r, n = int(top["rank"]), len(instances)
    numbers = {"last_count": int(top["last_count"]), "collectives": n,
               "wait_caused_ms": round(top["wait_caused_us"] / 1e3, 3), "share_of_wait": round(share, 3),
               "total_wait_ms": round(total / 1e3, 3)}
    if confidence >= 0.5:
        text = (f"rank {r} is the straggler: last to arrive in {numbers['last_count']} of {n} collectives; the other "
                f"ranks waited {numbers['wait_caused_ms']:,.1f} ms for it in total ({share:.0%} of all waiting)")
        verdict = {"rank": r, "confidence": round(confidence, 3), "evidence": text, **numbers}
    else:
        text = (f"no straggler: waiting is spread across ranks (the most, rank {r}, caused {share:.0%} of "
                f"{numbers['total_wait_ms']:,.1f} ms of waiting in {n} collectives)")
        verdict = {"rank": None, "confidence": round(confidence, 3), "evidence": text, **numbers}
    return table, verdict


def _compute_before(matched: pd.DataFrame) -> pd.Series:
    """Per rank: the time between the end of each matched collective and the start of the next."""
    m = matched.sort_values(["rank", "cpu_start_ns"])
    gap = m["cpu_start_ns"] - m.groupby("rank")["cpu_end_ns"].shift(1)
    return (gap.clip(lower=0) / 1e3).groupby(m["rank"]).sum()


def clock_offsets(matched: pd.DataFrame, hosts: Mapping[int, str | None]) -> dict[str, Any]:
    """Each rank's clock offset from the lowest rank present, from the ends of matched GPU collectives.

    The kernels of one collective instance end within a few µs of each other on every rank,
    so the median over instances of (this rank's end - the reference's end) is the offset;
    ranks that share no instance with the reference are chained through ranks that do. The
    spread is the median absolute deviation of those differences.
    """
    gpu = matched[matched["gpu_end_ns"].notna()] if "gpu_end_ns" in matched else matched.iloc[:0]
    if gpu.empty:
        return {"clock_offset_us": {}, "clock_offset_spread_us": {},
                "clock_note": "no matched GPU collectives: clock offsets need NCCL/RCCL kernels"}
    ends = pd.DataFrame({"instance": gpu["instance"].to_numpy(), "rank": gpu["rank"].astype(int).to_numpy(),
                         # from a common base: absolute ns (1.7e18) as floats are 256 ns apart
                         "end": (gpu["gpu_end_ns"] - int(gpu["gpu_end_ns"].min())).astype(float).to_numpy()})
    ends = ends.drop_duplicates(["instance", "rank"], keep="last")
    ref = ends.groupby("instance")["rank"].transform("min")
    ref_end = ends["end"].where(ends["rank"] == ref).groupby(ends["instance"]).transform("max")
    others = ends.assign(ref=ref, d=ends["end"] - ref_end)[ends["rank"] != ref]
    # the ends' differences per pair of ranks (the lower one is the instance's reference), each pair under both ranks
    edges: dict[int, list[tuple[tuple[int, int], int, int, np.ndarray]]] = {}
    for (x, y), d in others.groupby(["ref", "rank"], sort=True)["d"]:
        d = d.to_numpy()
        edges.setdefault(int(x), []).append(((x, y), int(y), 1, d))
        edges.setdefault(int(y), []).append(((x, y), int(x), -1, d))
    lowest = int(gpu["rank"].min())
    offset = {lowest: 0.0}
    spread = {lowest: 0.0}
    frontier = [lowest]
    while frontier:
        a = frontier.pop()
        for _, dst, sign, d in sorted(edges.get(a, []), key=lambda e: e[0]):
            if dst not in offset:
                med = float(np.median(d))
                offset[dst] = offset[a] + sign * med
                spread[dst] = float(np.median(np.abs(d - med)))
                frontier.append(dst)
    by_host: dict[str, list[int]] = {}
    for r in sorted(offset):
        by_host.setdefault(hosts.get(r) or "?", []).append(r)
    return {
        "clock_offset_us": {str(r): round(offset[r] / 1e3, 3) for r in sorted(offset)},
        "clock_offset_spread_us": {str(r): round(spread[r] / 1e3, 3) for r in sorted(offset)},
        "clock_offset_by_host": {
            h: {"ranks": rs, "median_offset_us": round(float(np.median([offset[r] for r in rs])) / 1e3, 3)}
            for h, rs in by_host.items()},
    }
