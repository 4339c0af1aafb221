"""The client's cross-rank reduce: the tasks' joined tables become an ``Analysis`` (``cross_rank``'s functions
and the summary)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .._version import __version__
from ..errors import RankError, every_rank_failed
from ..kineto.collectives import group_members
from ..model import ranges
from ..perf.devices import Device
from .cross_rank.collective_trace import summarize
from .cross_rank.collectives import clock_offsets, instance_metrics, match_collectives, op_summary, straggler
from .cross_rank.counters import launch_summary, rank_metrics
from .cross_rank.critical_path import bound, stitch, straggler_cause
from .cross_rank.efficiency import gpu_speed, link_use, node_of
from .cross_rank.op_perf import by_category, roofline_summary
from .cross_rank.sequences import top_sequences
from .cross_rank.what_if import stragglers as what_ifs
from .cross_rank.what_if import timeline as replay_graph
from .cross_rank.what_if import verdict as straggler_verdict
from .schema import ANOMALIES, CT_COLUMNS, LEFT_OUT, PIECES, TABLES, Analysis, AnalyzeRequest, RankTables, Summary
from .transport import as_text, in_rank_order

__all__ = ["rank_stats", "reduce_ranks"]

_MAD_LIMIT = 3.0

_CANDIDATES = 8  # the ranks that caused most waiting, each replayed without its extra work (``what_if``)

_MIN_REL_DEVIATION = 0.10

_BOOKKEEPING = ("gpu_events_left_out", "kernels_clipped")  # breakdown columns that rank_stats leaves out


def _one_source_per_rank(calls: pd.DataFrame, warnings: list[str]) -> pd.DataFrame:
    """Drop a rank's CSV calls when its log is there too: the same calls, which would count twice."""
    csv = calls["kind"] == "csv"
    logged = set(calls.loc[~csv, "rank"].dropna())
    twice = csv & calls["rank"].isin(logged)
    for rank, paths in calls[twice].groupby("rank")["path"]:
        warnings.append(f"rank {rank}: both a collective_trace log and a CSV export ({', '.join(sorted(set(paths)))}); "
                        "the CSV's calls were left out, as the log holds the same calls with their groups")
    return calls[~twice].reset_index(drop=True)


def rank_stats(breakdown: pd.DataFrame, by_step: pd.DataFrame, launches: pd.DataFrame,
               queues: pd.DataFrame) -> pd.DataFrame:
    """One row per metric: min, median and max across ranks, and the outlier ranks.

    A rank is an outlier when it is more than 3 median absolute deviations from
    the median, and at least 10% away from it. The counts of GPU events left out
    and kernels clipped say how the trace was read, not how the rank ran: no rows.
    The metrics are the breakdown's, the mean step time, and each rank's median launch delay and longest queue
    (``cross_rank.counters.rank_metrics``).
    """
    per_rank = breakdown.set_index("rank").drop(columns=list(_BOOKKEEPING), errors="ignore")
    if len(by_step):
        per_rank = per_rank.join(by_step.groupby("rank")["step_us"].mean().rename("step_us_mean"))
    per_rank = per_rank.join(rank_metrics(launches, queues))
    rows = []
    for metric in per_rank.columns:
        values = per_rank[metric].dropna()
        if values.empty:
            continue
        med = float(values.median())
        dev = (values - med).abs()
        mad = float(dev.median())
        far = dev[(dev > _MAD_LIMIT * mad) & (dev >= _MIN_REL_DEVIATION * abs(med)) & (dev > 0)]
        outliers = sorted(int(r) for r in far.index)
        notes = []
        for r in outliers:
            x = float(values[r])
            how = f"{x / med:.1f}× the median" if med else f"{x:,.1f} against a median of 0"
            notes.append(f"rank {r}'s {metric} is {how} ({x:,.1f} vs {med:,.1f})")
        rows.append({"metric": metric, "min": float(values.min()), "median": med, "max": float(values.max()),
                     "min_rank": int(values.idxmin()), "max_rank": int(values.idxmax()),
                     "outlier_ranks": outliers, "note": "; ".join(notes)})
    return pd.DataFrame(rows, columns=["metric", "min", "median", "max", "min_rank", "max_rank", "outlier_ranks",
                                       "note"])


@dataclass
class _Gathered:
    """What the tasks' results hold besides their tables: the ranks (in rank order), collective_trace's calls, and
    what the summary reports of the inputs."""

    per_rank: list[RankTables]
    ct_calls: list[pd.DataFrame]
    warnings: list[str]
    ignored: list[str]
    skipped: list[dict[str, Any]]


@dataclass
class _Collectives:
    """The collectives matched across ranks, the clock offsets they give, and their instances' metrics."""

    matched: pd.DataFrame
    problems: list[str]
    clocks: dict[str, Any]
    offsets: dict[int, float]
    instances: pd.DataFrame
    waits: pd.DataFrame


# The reduce runs with the cyclic collector paused, as the tasks do: it builds and frees many objects and no
# cycles, and a full collection over the client's objects cost 50-70 ms of an 8-rank analysis.
def reduce_ranks(results: list[dict[str, Any]], segments_of: Callable[[list[tuple[int, int]]], pd.DataFrame],
                 ignored: list[str], request: AnalyzeRequest) -> Analysis:
    """The cross-rank reduce of the tasks' joined results (``combine``, without the critical path's segments,
    which ``segments_of`` gives for the walks asked for); it takes their tables out of them. ``ignored``: the
    inputs left out before the tasks, and why."""
    got = _gather(results, ignored, request.subset)
    per_rank = got.per_rank
    # each table's parts are dropped once joined, so that the client holds each table about once
    tables = {name: as_text(in_rank_order([res["tables"].pop(name) for res in results])) for name in TABLES}
    stats = rank_stats(tables["breakdown"], tables["breakdown_by_step"], tables["launch_stats"],
                       tables["queue_length"])
    coll = _collectives(tables["collectives"], per_rank, request.devices)
    stragglers, verdict = straggler(coll.instances, coll.waits, coll.matched)
    gpu = bool("kernel_count" in tables["breakdown"] and (tables["breakdown"]["kernel_count"] > 0).any())
    pieces = {name: as_text(in_rank_order([res["tables"].pop(name) for res in results]))
              for name in PIECES if name != "path_segments"}
    texts = {rt.rank: rt.texts for rt in per_rank}
    path, path_steps, path_origin = stitch(pieces["path_anchors"], segments_of, tables["collectives"], coll.matched,
                                           coll.offsets, texts)
    speed, slow_gpu = gpu_speed(tables["op_perf"])
    verdict = _what_if(verdict, stragglers, coll, pieces, path_steps, gpu, texts)
    ct = _one_source_per_rank(pd.concat(got.ct_calls, ignore_index=True), got.warnings) if got.ct_calls \
        else pd.DataFrame(columns=CT_COLUMNS)
    ct_summary, ct_hints, ct_verdict = summarize(ct)
    op_perf_categories = by_category(tables["op_perf"])
    summary = _summary(got, request, tables, stats, coll, gpu, verdict, slow_gpu, op_perf_categories, path_steps,
                       path_origin, {"files": sum(res["ct_files"] for res in results), "calls": len(ct),
                                     "straggler_hint": ct_verdict} if got.ct_calls else None,
                       [note for res in results for note in res["repaired"]])
    return Analysis(**tables, rank_stats=stats, collective_instances=coll.instances, collective_waits=coll.waits,
                    collective_summary=op_summary(coll.instances), straggler_ranks=stragglers, critical_path=path,
                    collective_trace_calls=ct, collective_trace_summary=ct_summary,
                    collective_trace_hints=ct_hints, op_perf_by_category=op_perf_categories, gpu_speed=speed,
                    summary=summary)


def _gather(results: list[dict[str, Any]], ignored: list[str], subset: Any) -> _Gathered:
    """The ranks of the tasks' results, each once and in rank order, and what the inputs say; raises when there is
    nothing to analyse, or a rank twice."""
    warnings: list[str] = []
    ignored = list(ignored)
    per_rank: list[RankTables] = []
    world_sizes = set()
    where: dict[int, str] = {}
    ct_calls: list[pd.DataFrame] = []
    skipped = sorted((sk for res in results for sk in res["skipped"]),
                     key=lambda sk: (sk["rank"] is None, sk["rank"] or 0, sk["path"]))
    for res in results:
        ignored += res["ignored"]
        if res["ct_calls"] is not None:
            ct_calls.append(res["ct_calls"])
        warnings += res["notes"]
        world_sizes.update(ws for ws in res["world_sizes"] if ws is not None)
        for rt in res["ranks"]:
            if rt.rank in where:
                raise RankError(f"rank {rt.rank} appears twice: {where[rt.rank]} and {rt.path}; drop one, or give "
                                "the files as a {rank: path} dict")
            where[rt.rank] = rt.path
            per_rank.append(rt)
    if not per_rank and not ct_calls:
        if skipped:
            raise every_rank_failed(skipped)
        if ignored and not subset:
            raise RankError(f"no traces to analyse: {'; '.join(ignored[:3])}"
                            f"{f' and {len(ignored) - 3} more' if len(ignored) > 3 else ''}; give Kineto traces "
                            "(.json, .json.gz) or collective_trace logs")
        raise RankError("no ranks to analyse after --ranks; check the inputs and --ranks")
    per_rank.sort(key=lambda rt: rt.rank)
    if len(world_sizes) == 1:
        world_size = world_sizes.pop()
        missing = sorted(set(range(world_size)) - set(where))
        if missing:
            bad = sorted(set(missing) & {sk["rank"] for sk in skipped})
            warnings.append(f"{len(missing):,} of the world size's {world_size:,} ranks "
                            f"{'is' if len(missing) == 1 else 'are'} not analysed: rank(s) {ranges(missing)}"
                            + (f" ({ranges(bad)} skipped as bad)" if bad else ""))
    elif len(world_sizes) > 1:
        warnings.append(f"the inputs report different world sizes {sorted(world_sizes)}: several jobs mixed?")
    return _Gathered(per_rank, ct_calls, warnings, ignored, skipped)


def _collectives(calls: pd.DataFrame, per_rank: list[RankTables], devices: tuple[Device, ...]) -> _Collectives:
    """Every rank's collective calls matched into instances across ranks, with each group's ranks from the ranks'
    ``pg_config``; the clock offsets they give; the instances' wait, skew and link use."""
    pg_members: dict[str, set[int]] = {}
    for pg, spec in {(pg, spec) for rt in per_rank for pg, spec in rt.pg_config.items()}:  # each group once
        pg_members.setdefault(pg, set()).update(group_members(spec))
    matched, problems = match_collectives(calls, pg_members)
    clocks = clock_offsets(matched, {rt.rank: rt.host for rt in per_rank})
    offsets = {int(r): us * 1e3 for r, us in clocks["clock_offset_us"].items()}
    instances, waits = instance_metrics(matched, offsets)
    by_name: dict[str, Device] = {}
    for d in devices:  # a --gpu-spec device comes first and wins over the package's of the same name
        by_name.setdefault(d.name, d)
    instances = link_use(instances, matched, {rt.rank: node_of(rt.rank, rt.host, rt.device[2]) for rt in per_rank},
                         {rt.rank: by_name.get(rt.device[0]) for rt in per_rank})
    return _Collectives(matched, problems, clocks, offsets, instances, waits)


def _what_if(verdict: dict[str, Any], stragglers: pd.DataFrame, coll: _Collectives, pieces: dict[str, pd.DataFrame],
             path_steps: list[dict[str, Any]], gpu: bool, texts: Mapping[int, list[str]]) -> dict[str, Any]:
    """The straggler verdict from the what-if: the job replayed without each candidate's extra work (the ranks
    that caused most waiting), and why each rank it names is late."""
    graph = replay_graph(coll.matched, pieces["path_anchors"], coll.offsets)
    candidates = stragglers.sort_values(["wait_caused_us", "rank"], ascending=[False, True])["rank"]
    what_if = what_ifs(graph, candidates.astype(int).tolist()[:_CANDIDATES])
    # a rank late in a few steps is late for what it did in those: its cause is found there
    named = [(n["rank"], n["late_steps"] if n["pattern"] == "transient" else None) for n in what_if["ranks"]] \
        if what_if else [(verdict["rank"], None)]
    causes = {r: straggler_cause(r, coll.instances, coll.matched, pieces["path_work"], len(late or path_steps), gpu,
                                 texts, late, behind=k > 0)  # the ranks after the first: held up behind it
              for k, (r, late) in enumerate(named) if r is not None}
    return straggler_verdict(verdict, stragglers, what_if, causes)


def _summary(got: _Gathered, request: AnalyzeRequest, tables: dict[str, pd.DataFrame], stats: pd.DataFrame,
             coll: _Collectives, gpu: bool, verdict: dict[str, Any], slow_gpu: dict[str, Any] | None,
             op_perf_categories: pd.DataFrame, path_steps: list[dict[str, Any]], path_origin: int,
             collective_trace: dict[str, Any] | None, repaired: list[str]) -> Summary:
    """``summary.json`` (``schema.Summary`` declares it key by key)."""
    per_rank = got.per_rank
    launches = launch_summary(tables["launch_stats"], tables["queue_length"], tables["memory_bw"], stats,
                              request.cutoffs)
    return {
        "tool": "tracefuse_dask",
        "version": __version__,
        "inputs": [rt.path for rt in per_rank],
        "ranks": [rt.rank for rt in per_rank],
        "steps": sorted({s for rt in per_rank for s in rt.steps}),
        "step_range": list(request.steps) if request.steps else None,
        "gpu": gpu,
        "why_no_gpu": None if gpu else "no GPU kernels, memcpy or memset in the traces: a CPU-only job (such as "
                                       "gloo); the GPU tables are empty, the ops and step tables are not",
        "per_rank": {str(rt.rank): _plain(rt.numbers) for rt in per_rank},
        "gpu_events_left_out": {
            "count": sum(rt.numbers["gpu_events_left_out"] for rt in per_rank),
            "why": "HTA's rule, for parity with its figures: in a rank with two or more ProfilerStep#N, device "
                   "work whose launch (correlation) is not among the host events up to the end of the last step, "
                   "such as work queued before the profiler started, is left out; --keep-unlaunched-gpu keeps it",
        } if not request.keep_unlaunched_gpu else None,
        "kernels_clipped": {
            "count": sum(rt.numbers["kernels_clipped"] for rt in per_rank),
            "why": "a kernel, memcpy or memset that ends after the next one on its stream starts (a clock quirk) "
                   "counts up to that start in the per-kernel durations (kernels, ops and kernel_launchers "
                   "tables); the breakdowns and the idle table use the raw times, as HTA does",
        },
        "begin_end": {
            "pairs": sum(rt.begin_end[0] for rt in per_rank),
            "unclosed": sum(rt.begin_end[1] for rt in per_rank),
            "unclosed_ranks": [rt.rank for rt in per_rank if rt.begin_end[1]],
            "unopened": sum(rt.begin_end[2] for rt in per_rank),
            "why": "B/E duration events (Composer's and other Chrome-trace writers') count as ops once paired on "
                   "their thread, as Perfetto pairs them; a B whose E is not in the trace (it was cut, or the span "
                   "outlives it, as Composer's event/fit and event/epoch outlive a profiling cycle) ends at its "
                   "rank's last timestamp; an E whose B came before the trace began is left out",
        },
        "account": _account(per_rank),
        "devices": _devices(per_rank),
        "slow_gpu": _slow_gpu_verdict(slow_gpu, verdict),
        "roofline": roofline_summary(op_perf_categories),
        "outliers": [n for n in stats["note"] if n],
        "launches": launches,
        "kernel_sequences": top_sequences(request.sequences_of, tables["kernel_sequences"]),
        "collectives": {"calls": len(tables["collectives"]), "matched": len(coll.instances),
                        "problems": len(coll.problems), "problem_examples": coll.problems[:20]},
        "straggler": verdict,
        "critical_path": path_steps,
        "bound": bound(path_steps, launches, float(np.nanmedian([rt.numbers["idle_pct"] for rt in per_rank])))
        if gpu else None,  # a CPU-only job's path is the host's
        "critical_path_origin_ns": path_origin,
        "base_time_ns": {str(rt.rank): rt.base for rt in per_rank},
        "collective_trace": collective_trace,
        **coll.clocks,
        "warnings": got.warnings,
        "ignored": got.ignored,
        "skipped": got.skipped,
        "repaired": repaired,
    }


def _account(per_rank: list[RankTables]) -> dict[str, Any]:
    """Where every event the analysis read went (``per_rank.account``), in total and per rank; ``anomalies``
    with the ranks that show each."""
    left: Counter[str] = Counter()
    odd: Counter[str] = Counter()
    for rt in per_rank:
        left.update(rt.account["left_out"])
        odd.update(rt.account["anomalies"])
    return {"read": sum(rt.account["read"] for rt in per_rank),
            "analysed": sum(rt.account["analysed"] for rt in per_rank),
            "left_out": {k: left[k] for k in LEFT_OUT if left[k]},
            "anomalies": {k: {"count": odd[k], "ranks": [rt.rank for rt in per_rank if rt.account["anomalies"].get(k)],
                              "why": ANOMALIES[k]} for k in ANOMALIES if odd[k]},
            "ranks": {str(rt.rank): rt.account for rt in per_rank}}


def _slow_gpu_verdict(slow: dict[str, Any] | None, straggler: dict[str, Any]) -> dict[str, Any] | None:
    """The slow GPU (``cross_rank.efficiency.gpu_speed``), told apart from the straggler: a straggler whose GPU is not slow
    is late for what the critical path shows (host work, launches, waits), not for its kernels."""
    late = straggler.get("rank")
    if slow is None:
        return None if late is None else {"rank": None, "text": f"no GPU is slower than the others at equal shapes: "
                                          f"rank {late} is late for what the critical path shows, not for its kernels"}
    if late == slow["rank"]:
        slow["text"] += "; it is also the straggler, and its GPU is why"
    elif late is not None:
        slow["text"] += f"; the straggler, rank {late}, is late for what the critical path shows, not for its kernels"
    return slow


def _devices(per_rank: list[RankTables]) -> dict[str, Any]:
    """Which device each rank ran on, as the device table names it (``op_perf``'s roofline), and which it lacks."""
    by_name: dict[str, list[int]] = {}
    unknown: dict[str, list[int]] = {}
    for rt in per_rank:
        name, called, _ = rt.device
        if name is not None:
            by_name.setdefault(name, []).append(rt.rank)
        elif called or rt.numbers.get("kernel_count"):
            unknown.setdefault(called or "(no deviceProperties)", []).append(rt.rank)
    return {
        "ranks": by_name,
        "unknown": unknown,
        "note": ("op_perf has no roofline for the ranks of " + ", ".join(map(repr, unknown)) + ": add the device to a "
                 "JSON file shaped as tracefuse_dask/perf/devices.json and pass it with --gpu-spec FILE.json"
                 ) if unknown else None,
    }


def _plain(numbers: Mapping[str, Any]) -> dict[str, Any]:
    """JSON-ready numbers: NaN becomes null."""
    return {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in numbers.items()}
