"""Collectives across ranks: each rank's calls (``per_rank.collectives``) matched into instances; wait and skew,
stragglers, clock offsets.

Pure functions on events and small DataFrames; no IO, no Dask. See the spec §5: ``Rank`` in
``record_param_comms`` is group-local and ``Sequence number`` is autograd's, so neither is used
to match; ``Seq`` (PyTorch >= March 2026) is, when present.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping, Set
from typing import Any

import numpy as np
import pandas as pd

from ...kineto.collectives import group_members

__all__ = ["clock_offsets", "instance_metrics", "match_collectives", "op_summary", "straggler"]


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
