"""Two runs compared (``tracefuse diff``): pure functions on two ``Analysis`` objects, no IO and no Dask.

Every figure is per step, so that runs of different lengths compare: a rank's total over its trace divided by
the run's steps (each step's period across ranks: its earliest host start to its latest host end, ``host_us``, as
each rank's step times measure it, not the device work it leaves running into the next step; the whole trace
counts as one without steps). A job-wide figure is the mean over the run's ranks (the job's total over its ranks; a rank
without the name counts 0), the job's step time the median over its steps.

Noise. A run's spread is ``2 × 1.4826 × MAD / median`` of its step times (about two standard deviations for
normal noise; the median absolute deviation, so that one warm-up or checkpoint step does not blind the check;
0 with fewer than two steps). A change is significant when it is larger than both runs' spreads and than
``MIN_CHANGE_PCT``; for a rank's step time, than that rank's spreads. The other figures (breakdown, kernels,
ops, collectives) are kept per trace, not per step: they are held to the job's spreads.

A check with ``fail_above`` fails on a significant regression above it of the job's step time, or of a figure
that is at least ``MIN_SHARE`` of the step time, a kernel's or op group's of the GPU's computation time (so that a
2 µs kernel that doubles does not fail a nightly job, while a GEMM does where waiting for the network fills most of
the step).
A name only in the new run (a recompiled Triton kernel) fails it only when the step time also regressed
significantly; with fewer than two steps in a run only the step time can fail it. Only a root change fails it: a
kernel, op group, op, collective or step time whose own duration changed. A critical path that took another route
is not one: its items are reported, and the route change is a note that names the root change behind it.

Identity. A kernel or op is its exact name (``name_key``: only what differs between two runs of one program, an
address or a step number, is normalised; template arguments and parameter lists are the kernel: ``…_nt_align1``
and ``…_nn_align1`` are two GEMMs). Names are shortened for the verdict and the page only
(``vocabulary.kernel_label``); the JSON and Parquet tables keep them whole. Op groups are compared as the op performance models define them (``op_perf``:
name, input dims, input types, concrete inputs), with their time per call, TFLOP/s and % of roofline. A group's
main kernel (the one with most time) that exists in one run only, while the other run's group has a main kernel
of its own that exists in the other run only, was renamed (a new cuBLAS, hipBLASLt or Triton build): the kernel
is compared under its new name, its old one beside it. This is TraceLens TraceDiff's pairing of kernels under
their lowest common ancestor, made at the op that launched them, by shape, across ranks and steps.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ...kineto.vocabulary import is_comm_kernel, kernel_label, kernel_type
from ..schema import ITEM_COLUMNS, LABELS, MEANS, OP_PERF_COLUMNS, Diff

if TYPE_CHECKING:
    from ..schema import Analysis

__all__ = ["BREAKDOWN", "RUN_VARIANT", "compare", "name_key"]

MIN_CHANGE_PCT = 1.0
MIN_SHARE = 0.01
MIN_NAME_OVERLAP = 0.2  # below this share of matching kernel and op names, two runs look like different models
MIN_KERNEL_OVERLAP = 0.5  # below this share of a run's kernel time in names both runs have, compare by op group
LISTED = 100  # job-wide and per-rank rows of each list in diff.json; the tables hold them all
BREAKDOWN = ("computation_us", "communication_us", "exposed_comm_us", "memcpy_us", "idle_us")
# per rank and name: summed per step, or the mean of the ranks' (rates); beside each figure in the items
_SUMMED = ("us", "count", "wait_us")
_ORDER = ("kernel", "op group", "critical path", "collective", "op")
ROOTS = ("step time", "rank step time", "kernel", "op group", "op", "collective")  # what can fail a check
# What differs between two runs of one program and says nothing about the kernel or op, each with an example from
# a real trace; the rest of a name is its identity.
RUN_VARIANT = (
    # an address: "<built-in method apply of FunctionMeta object at 0x55d3c8a1e6b0>"
    (re.compile(r"0x[0-9a-fA-F]+"), "0x…"),
    # a step counter after a word: "ProfilerStep#551", "not yet in ProfilerStep#551"; not a lambda's number,
    # which is the kernel's ("…direct_copy_kernel_cuda(…)::{lambda()#3}::operator()() const::{lambda()#7}…")
    (re.compile(r"(?<=[A-Za-z_])#\d+"), "#…"),
)
_STEP = "ProfilerStep#"  # the step itself: its time is the step's, never a root change
_PATH_LABEL = "(?:" + "|".join(map(re.escape, LABELS)) + ")$"  # what a critical-path name adds to its op's


def name_key(name: str) -> str:
    """A kernel's or op's identity across runs: its exact name, with what ``RUN_VARIANT`` lists normalised."""
    text = str(name)
    for pattern, replacement in RUN_VARIANT:
        text = pattern.sub(replacement, text)
    return text


def group_label(name: str, dims: str) -> str:
    """An op group for reading: ``aten::mm [8944×1024 · 1024×2816]`` from its name and input dims, without the
    trailing scalars."""
    try:
        shapes = json.loads(dims) if dims else []
    except (TypeError, ValueError):
        shapes = []
    def shape(d: Any) -> str:
        if d and all(isinstance(x, list) for x in d):  # a list of tensors (aten::cat's)
            return "(" + ", ".join(map(shape, d)) + ")"
        return "×".join(map(str, d)) if d else "scalar"

    parts = [shape(d) for d in shapes if isinstance(d, list)]
    while parts and parts[-1] == "scalar":  # trailing scalar arguments (alpha, dropout, flags) say little
        parts.pop()
    return f"{name} [{' · '.join(parts)}]" if parts else name


def compare(base: Analysis, new: Analysis, *, fail_above: float | None = None) -> Diff:
    """Compare two analysed runs; see the module's notes on significance, identity and ``fail_above`` (a
    percentage)."""
    sides = (_Side(base, "base"), _Side(new, "new"))
    same_ranks = sides[0].ranks == sides[1].ranks
    notes: list[str] = []
    if not same_ranks:
        notes.append(f"the runs have different ranks ({len(sides[0].ranks):,} and {len(sides[1].ranks):,}): compared by "
                     "job-wide figures (means over ranks); the per-rank rows are left out")
    few = [s for s in sides if len(s.steps_us) < 2]
    notes += [f"the {s.label} run has {len(s.steps_us)} step: its step-to-step spread is unknown, so a change "
              "counts from 1%, and only the step time can fail a check" for s in few]
    noise = max(s.spread_pct for s in sides)
    step = _step_item(sides)
    items, per_what, kernels, renamed = _all_items(sides, step, same_ranks, noise, notes)
    groups = per_what["op group"]
    warnings = []
    names = [set(per_what["kernel"][i]["name"]) | set(per_what["op"][i]["name"]) for i in (0, 1)]
    if names[0] | names[1] and len(names[0] & names[1]) < MIN_NAME_OVERLAP * len(names[0] | names[1]):
        warnings.append(f"only {len(names[0] & names[1]):,} of {len(names[0] | names[1]):,} kernel and op names "
                        "match: two different models or programs? The figures by name compare little")
    kernel_us = [k.groupby("name")["us"].sum() for k in kernels]
    shared = kernel_us[0].index.intersection(kernel_us[1].index)
    # most of a run's kernel time in names the other run lacks (another vendor, a new library): said by op group,
    # with each group's kernel change
    by_shape = any(k.sum() > 0 and k.reindex(shared).sum() < MIN_KERNEL_OVERLAP * k.sum() for k in kernel_us)
    matched = _matched_groups(groups) if by_shape or renamed else None
    if matched:
        notes.append(matched)
    significant = items[items["significant"]]
    regressions = _ordered(significant[significant["delta_us"] > 0])
    improvements = _ordered(significant[significant["delta_us"] < 0])
    compute = items[(items["what"] == "breakdown") & (items["rank"] == -1) & (items["name"] == "computation_us")]
    whole = {"kernel": float(compute["new"].iloc[0]) if len(compute) else step["new"]}
    whole["op group"] = whole["kernel"]
    slower = step["significant"] and step["delta_us"] > 0
    failing = [] if fail_above is None else [
        r for r in regressions if r["what"] in ROOTS and (r["what"] == "step time" and r["delta_pct"] > fail_above
        or not few and r["new"] >= MIN_SHARE * whole.get(r["what"], step["new"]) > 0
        and (r["delta_pct"] > fail_above if r["delta_pct"] is not None else slower))]
    # for runs whose kernels share little time by name, the op groups that changed most per step lead
    groups_changed = sorted((r for r in regressions + improvements if by_shape and r["rank"] == -1
                             and r["what"] == "op group" and r["base"] and r["new"]),
                            key=lambda r: -abs(r["delta_us"]))[:3]
    path_rows = significant[significant["what"] == "critical path"]
    on_path = _path_deltas(path_rows)
    root = groups_changed[0] if groups_changed else _root(
        regressions if step["delta_us"] >= 0 or not step["significant"] else improvements, on_path)
    job = significant[(significant["rank"] == -1) & significant["what"].isin(ROOTS)]
    route = _route(path_rows[~path_rows["name"].str.replace(_PATH_LABEL, "", regex=True).isin(set(job["name"]))],
                   root)
    if route:
        notes.append(route)
    straggler = _straggler(sides)
    summary = {
        "base": sides[0].describe(),
        "new": sides[1].describe(),
        "step_time": _plain(step),
        "noise_pct": round(noise, 3),
        "regressions": _capped(regressions),
        "improvements": _capped(improvements),
        "added": _named(items, "base"),
        "removed": _named(items, "new"),
        "renamed": [{"base": b, "new": n} for b, n in sorted(renamed.items())][:LISTED],
        "straggler": straggler,
        "fail_above_pct": fail_above,
        "failing": failing[:LISTED],
        "verdict": _verdict(step, root, groups_changed, regressions + improvements, on_path, straggler, sides, noise),
        "notes": notes,
        "warnings": warnings,
    }
    steps = pd.concat([s.step_rows() for s in sides], ignore_index=True)
    step_stats = (steps.groupby(["run", "rank"], sort=False)["step_us"].agg(["count", "min", "median", "max"])
                  .rename(columns={"count": "steps", "min": "min_us", "median": "median_us", "max": "max_us"})
                  .reset_index())
    return Diff({"items": items, "steps": steps, "step_stats": step_stats}, summary)


def _all_items(sides: tuple[_Side, _Side], step: dict[str, Any], same_ranks: bool, noise: float,
               notes: list[str]) -> tuple[pd.DataFrame, dict[str, list[pd.DataFrame]], list[pd.DataFrame],
                                          dict[str, str]]:
    """Every figure compared, a row each (``items``); each kind's per-rank tables of both runs; both runs' kernels
    by their own names; the kernels renamed between the runs. A note says when the op groups cannot be compared."""
    rows = [step]
    if same_ranks:
        rows += [_step_item(sides, r) for r in sides[0].ranks]
    frames = [pd.DataFrame(rows, columns=ITEM_COLUMNS)]
    groups = [s.per_rank("op_perf") for s in sides]
    kernels = [s.per_rank("kernels") for s in sides]
    lacking = [s.label for s, g, k in zip(sides, groups, kernels) if g.empty and not k.empty]
    if lacking:  # a report of an earlier version: no op groups to compare with the other run's
        notes.append(f"the {lacking[0]} run's report has no op_perf table (an earlier version): op groups are not "
                     "compared; run tracefuse analyze on its traces again")
        groups = [g.iloc[:0] for g in groups]
    renamed = _renamed(groups, kernels)
    per_what = {"breakdown": [s.per_rank("breakdown") for s in sides],
                "kernel": [sides[0].per_rank("kernels", renamed) if renamed else kernels[0], kernels[1]],
                "op group": groups,
                "op": [s.per_rank("ops") for s in sides], "collective": [s.per_rank("collectives") for s in sides]}
    for what, per_rank in per_what.items():
        frames.append(_items(what, per_rank, [s.ranks for s in sides], noise, same_ranks))
    paths = [sides[0].path(renamed), sides[1].path()]
    names_cp = paths[0].index.union(paths[1].index)
    cp = _frame("critical path", names_cp, -1, *(p.reindex(names_cp, fill_value=0.0) for p in paths))
    cp["significant"] = cp["delta_pct"].abs() > max(noise, MIN_CHANGE_PCT)
    frames.append(cp)
    items = pd.concat([f for f in frames if len(f)], ignore_index=True).astype({"significant": bool})
    return _labelled(items, renamed), per_what, kernels, renamed


class _Side:
    """One run's figures per step."""

    def __init__(self, a: Analysis, label: str) -> None:
        self.a, self.label = a, label
        s = a.summary
        self.ranks = [int(r) for r in s["ranks"]]
        # a step's period on the host, as the per-rank step times (breakdown_by_step) measure it; its path also
        # holds the device work that runs on into the next step (duration_us); a report before host_us: that
        self.steps_us = [float(p.get("host_us", p["duration_us"])) for p in s.get("critical_path") or []]
        if not self.steps_us:
            raise ValueError(f"the {label} run has no step times (its analysis found no critical path: no host "
                             "events?)")
        self.n_steps = len(self.steps_us)
        self.spread_pct = _spread(self.steps_us)
        by_step = a.breakdown_by_step
        self.rank_steps = {int(r): (g["step"].astype(int).tolist(), g["step_us"].astype(float).tolist())
                           for r, g in by_step.groupby("rank")} if len(by_step) else {}

    def describe(self) -> dict[str, Any]:
        s = self.a.summary
        return {"inputs": s["inputs"][:10], "inputs_count": len(s["inputs"]), "ranks": len(self.ranks),
                "steps": s["steps"], "step_time_us": _stats(self.steps_us),
                "straggler": s["straggler"]["rank"], "cause": _cause_name(s), "spread_pct": round(self.spread_pct, 3)}

    def per_rank(self, table: str, renamed: Mapping[str, str] | None = None) -> pd.DataFrame:
        """``rank, name, us, count, …`` per step: the table's figure by identity (``name_key``; an op group's
        is its ``op_perf`` key), or the breakdown's columns; ``renamed`` kernels under their new names."""
        df = getattr(self.a, table) if table != "collectives" else self._collectives()
        nan = np.nan
        if table == "breakdown":
            cols = [c for c in BREAKDOWN if c in df]
            long = df.melt(id_vars="rank", value_vars=cols, var_name="name", value_name="us").assign(count=nan)
        elif table == "op_perf":  # a report of an earlier version may lack the table or its main kernel
            df = df.reindex(columns=list(dict.fromkeys([*df.columns, "rank", *OP_PERF_COLUMNS])))
            texts = {c: df[c].astype(object).fillna("").astype(str).to_numpy(dtype=object)  # "" is NaN in a CSV
                     for c in ("name", "input_dims", "input_types", "concrete_inputs", "context")}
            key = pd.Series(texts["name"], index=df.index).map(name_key).to_numpy(dtype=object)
            for c in ("input_dims", "input_types", "concrete_inputs", "context"):
                key = key + np.where(texts[c] != "", " " + texts[c], "")
            long = pd.DataFrame({"rank": df["rank"], "name": key, "us": df["kernel_us"], "count": df["calls"],
                                 "tflops_s": df["tflops_s"], "roofline_pct": df["roofline_pct"],
                                 "kernel": df["kernel"], "label": [group_label(n, d) for n, d in
                                                                   zip(texts["name"], texts["input_dims"])]})
        else:
            value = {"kernels": "total_us", "ops": "cpu_time_us", "collectives": "latency_us"}[table]
            name = df["name"] if table == "collectives" else df["name"].map(name_key)
            long = pd.DataFrame({"rank": df["rank"], "us": df[value], "count": df["count"],
                                 "name": name.replace(renamed) if renamed else name,
                                 **{x: df[x] for x in ("algbw_gbps", "busbw_gbps", "wait_us") if x in df}})
        for x in (*_SUMMED, *MEANS):
            if x not in long:
                long[x] = nan
        long = long.dropna(subset=["us"])
        g = long.groupby(["rank", "name"], as_index=False, sort=True)
        out = g.agg(us=("us", "sum"), **{x: (x, lambda c: c.sum(min_count=1)) for x in ("count", "wait_us")},
                    **{x: (x, "mean") for x in MEANS})
        if table == "op_perf":  # an op group's main kernel: the one its calls spent most time in, on the rank
            first = long.sort_values(["us", "kernel"], ascending=[False, True], kind="stable")
            firsts = first.drop_duplicates(["rank", "name"]).set_index(["rank", "name"])
            out["kernel"] = firsts["kernel"].reindex(pd.MultiIndex.from_frame(out[["rank", "name"]])).to_numpy()
            out["label"] = firsts["label"].reindex(pd.MultiIndex.from_frame(out[["rank", "name"]])).to_numpy()
        for col in _SUMMED:
            out[col] = out[col].astype(float) / self.n_steps
        return out

    def path(self, renamed: Mapping[str, str] | None = None) -> pd.Series:
        """Time per step on the critical path by identity (``name_key``; ``renamed`` kernels under their new
        names), whatever the rank and kind."""
        cp = self.a.critical_path
        name = cp["name"].map(name_key)
        return (cp.assign(name=name.replace(renamed) if renamed else name).groupby("name", sort=True)["dur_us"]
                .sum().astype(float) / self.n_steps)

    def _collectives(self) -> pd.DataFrame:
        """Each rank's collective latency by type, group and message size."""
        inst = self.a.collective_instances
        if inst.empty:
            return pd.DataFrame({"rank": pd.Series(dtype=int), "name": pd.Series(dtype=str),
                                 **{c: pd.Series(dtype=float) for c in ("latency_us", "count", "algbw_gbps",
                                                                        "busbw_gbps", "wait_us")}})
        waits = self.a.collective_waits[["instance", "rank", "wait_us"]]
        calls = waits.merge(inst[["instance", "op", "group", "bytes", "comm_latency_us", "algbw_gbps", "busbw_gbps"]],
                            on="instance")
        calls["name"] = [f"{op} group {g} {int(b):,} B" if pd.notna(b) else f"{op} group {g}"
                         for op, g, b in zip(calls["op"], calls["group"], calls["bytes"])]
        return calls.assign(count=1).rename(columns={"comm_latency_us": "latency_us"})

    def step_rows(self) -> pd.DataFrame:
        """The run's step times: the job's (rank -1) and each rank's."""
        rows = [{"run": self.label, "rank": -1, "step": p["step"], "step_us": p.get("host_us", p["duration_us"])}
                for p in self.a.summary["critical_path"]]
        rows += [{"run": self.label, "rank": r, "step": k, "step_us": us} for r, (ks, us_) in self.rank_steps.items()
                 for k, us in zip(ks, us_)]
        return pd.DataFrame(rows, columns=["run", "rank", "step", "step_us"])


def _step_item(sides: Sequence[_Side], rank: int = -1) -> dict[str, Any]:
    """The job's step time (rank -1), or a rank's, with its significance against the runs' spreads."""
    b, n = (s.steps_us if rank == -1 else s.rank_steps.get(rank, ([], []))[1] for s in sides)
    what = "step time" if rank == -1 else "rank step time"
    if not b or not n:
        return _row(what, rank, float("nan"), float("nan"))
    row = _row(what, rank, statistics.median(b), statistics.median(n))
    row["significant"] = bool(abs(row["delta_pct"]) > max(_spread(b), _spread(n), MIN_CHANGE_PCT))
    return row


def _spread(values: Sequence[float]) -> float:
    """A run's step-to-step spread in % of its median: ``2 × 1.4826 × MAD / median``; 0 below two steps."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return 100 * 2 * 1.4826 * mad / med if med else 0.0


def _items(what: str, per_rank: Sequence[pd.DataFrame], ranks: Sequence[list[int]], noise: float,
           same_ranks: bool) -> pd.DataFrame:
    """Job-wide rows (rank -1: the mean over the run's ranks, a rank without the name counting 0) and, for runs
    of the same ranks, per-rank rows; ``ranks_regressed`` counts the ranks where the name went up significantly."""
    if all(p.empty for p in per_rank):  # such as the kernels of a CPU-only job
        return pd.DataFrame(columns=ITEM_COLUMNS)
    limit = max(noise, MIN_CHANGE_PCT)
    wide = [{x: p.set_index(["name", "rank"])[x].unstack("rank").reindex(columns=r) for x in (*_SUMMED, *MEANS)}
            for p, r in zip(per_rank, ranks)]
    names = wide[0]["us"].index.union(wide[1]["us"].index)
    job = _frame(what, names, -1, *(w["us"].reindex(names).fillna(0.0).mean(axis=1) for w in wide))
    job["significant"] = job["delta_pct"].abs() > limit
    for side, w, p in zip(("base", "new"), wide, per_rank):
        job[f"{side}_count"] = w["count"].reindex(names).fillna(0.0).mean(axis=1).to_numpy()
        for x in ("wait_us", *MEANS):  # over the ranks that have it
            job[f"{side}_{x}"] = w[x].reindex(names).mean(axis=1).to_numpy()
        if "kernel" in p:  # the job's: the lowest rank's
            first = p.drop_duplicates("name").set_index("name")
            job[f"{side}_kernel"] = first["kernel"].reindex(names).to_numpy()
            job["label"] = job["label"].fillna(pd.Series(first["label"].reindex(names).to_numpy(), index=job.index))
    if not same_ranks:
        return _means(job)
    both = per_rank[0].merge(per_rank[1], on=["rank", "name"], how="outer", suffixes=("_b", "_n"))
    both[["us_b", "us_n", "count_b", "count_n"]] = both[["us_b", "us_n", "count_b", "count_n"]].fillna(0.0)
    each = _frame(what, both["name"], both["rank"].astype(int), both["us_b"], both["us_n"])
    for x in ("count", "wait_us", *MEANS, *(("kernel",) if "kernel" in per_rank[0] else ())):
        each[f"base_{x}"], each[f"new_{x}"] = both[f"{x}_b"].to_numpy(), both[f"{x}_n"].to_numpy()
    if "label" in per_rank[0]:
        each["label"] = both["label_b"].fillna(both["label_n"]).to_numpy()
    each["significant"] = each["delta_pct"].abs() > limit
    up = each[each["significant"] & (each["delta_us"] > 0)].groupby("name").size()
    job["ranks_regressed"] = job["name"].map(up).fillna(0).astype(int)
    return _means(pd.concat([job, each], ignore_index=True))


def _means(df: pd.DataFrame) -> pd.DataFrame:
    """µs a call, where there are calls."""
    for side in ("base", "new"):
        count = df[f"{side}_count"].astype(float)
        df[f"{side}_mean_us"] = (df[side] / count).where(count > 0)
    return df


def _renamed(groups: Sequence[pd.DataFrame], kernels: Sequence[pd.DataFrame]) -> dict[str, str]:
    """Kernels renamed between the runs, old name to new (the module's notes): an op group's main kernel in each run
    that the other run does not have, one to one."""
    main = [g.drop_duplicates("name").set_index("name")["kernel"].dropna().map(name_key) for g in groups]
    have = [set(k["name"]) for k in kernels]
    news: dict[str, set[str]] = defaultdict(set)
    for key in main[0].index.intersection(main[1].index):
        old, new = main[0][key], main[1][key]
        if old != new and old not in have[1] and new not in have[0] and kernel_type(old) == kernel_type(new) \
                == "COMPUTATION":  # a copy of another kind is another op's work, not a new build's
            news[old].add(new)
    olds = Counter(n for v in news.values() for n in v)
    return {o: n for o, (n, *more) in news.items() if not more and olds[n] == 1}


def _labelled(items: pd.DataFrame, renamed: Mapping[str, str]) -> pd.DataFrame:
    """Each item's ``label`` (kernel names shortened, ``label``, also on the critical path; op groups have theirs),
    and a renamed kernel's names in ``base_kernel`` and ``new_kernel``."""
    kernel = items["what"] == "kernel"
    named = kernel | (items["what"] == "critical path")
    short = {n: kernel_label(n) for n in items.loc[named & (items["rank"] == -1), "name"]}
    items["label"] = items["label"].fillna(items["name"].where(~named, items["name"].map(short)))
    old = {n: o for o, n in renamed.items()}
    renamed_rows = kernel & items["name"].isin(old.keys())
    items.loc[renamed_rows, "base_kernel"] = items.loc[renamed_rows, "name"].map(old)
    items.loc[renamed_rows, "new_kernel"] = items.loc[renamed_rows, "name"]
    return items


def _matched_groups(groups: Sequence[pd.DataFrame]) -> str | None:
    """How many op groups the runs share (by op and shapes), and their share of the op kernel time."""
    job = [g.groupby("name")["us"].sum() for g in groups]
    if not len(job[0]) or not len(job[1]):
        return None
    both = job[0].index.intersection(job[1].index)
    share = [100 * float(j.reindex(both).sum() / j.sum()) if j.sum() else 0.0 for j in job]
    return (f"{len(both):,} of {len(job[0].index.union(job[1].index)):,} op groups (op, input dims, types and "
            f"concrete inputs) are in both runs: {share[0]:.0f}% of the base run's op kernel time, {share[1]:.0f}% "
            "of the new run's")


def _path_deltas(path: pd.DataFrame) -> dict[str, float]:
    """How much each name's time on the critical path changed per step, the ops' time under their labels
    (``aten::linear (host dispatch)``) counting for the op."""
    op = path["name"].str.replace(_PATH_LABEL, "", regex=True)
    return {str(k): float(v) for k, v in path.groupby(op)["delta_us"].sum().items()}


def _root(rows: list[dict[str, Any]], on_path: Mapping[str, float]) -> dict[str, Any] | None:
    """The root change: of the job-wide kernels (not a collective's: its kernels grow when their ranks wait for a
    late one), op groups, collectives and ops that changed, the one whose time on the critical path changed most
    the same way, else the first (``_ordered``). An op's time holds its waits, so that ops that waited for a late
    rank grow with the one that made it late: the path tells them apart."""
    rows = [r for r in rows if r["rank"] == -1 and r["what"] in ROOTS[2:] and not r["name"].startswith(_STEP)
            and not (r["what"] == "kernel" and is_comm_kernel(r["name"]))]
    moved = [r for r in rows if on_path.get(r["name"], 0.0) * r["delta_us"] > 0]
    if moved:
        return max(moved, key=lambda r: abs(on_path[r["name"]]))
    return rows[0] if rows else None


def _route(path: pd.DataFrame, root: dict[str, Any] | None) -> str | None:
    """The note for a critical path that took another route: its items that changed significantly while the
    figure they are named after did not (such as the GPU's idle time, a collective's wait), and the root change
    behind it where there is one."""
    if path.empty:
        return None
    top = path.reindex(path["delta_us"].abs().sort_values(ascending=False, kind="stable").index).head(3)
    moved = ", ".join(f"`{n}` {d / 1e3:+,.1f} ms per step" for n, d in zip(top["label"], top["delta_us"]))
    cause = f"the root change: {_root_text(root)}" if root else "no root change explains it"
    return f"the critical path changed: {moved}; a route change is not a root change by itself, {cause}"


def _frame(what: str, names: Any, rank: Any, base: Any, new: Any) -> pd.DataFrame:
    base, new = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = np.where(base == new, 0.0, np.where(base == 0, np.inf, 100.0 * (new - base) / base))
    return pd.DataFrame({"what": what, "name": np.asarray(names, dtype=object), "label": None, "rank": rank,
                         "base": base, "new": new, "delta_us": new - base, "delta_pct": pct, "significant": False,
                         "ranks_regressed": None}, columns=ITEM_COLUMNS)


def _row(what: str, rank: int, base: float, new: float) -> dict[str, Any]:
    """A step-time row (its significance is the caller's)."""
    return {"what": what, "name": "step time", "label": "step time", "rank": rank, "base": base, "new": new,
            "delta_us": new - base,
            "delta_pct": _pct(base, new), "significant": False, "ranks_regressed": None}


def _pct(base: float, new: float) -> float:
    if base == new:
        return 0.0
    return 100.0 * (new - base) / base if base else float("inf")


def _ordered(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Where the time went first, job-wide (``_ORDER``: kernels, the leaf work; the critical path's items; the
    collectives; ops, whose time includes their children's and their waits); then the ranks' step times; then
    each rank's figures; then the job's breakdown and step time. Within each, by how much time changed per
    step."""
    job = df["rank"] == -1
    group = np.select([job & (df["what"] == w) for w in _ORDER] + [df["what"] == "rank step time", ~job,
                                                                   df["what"] == "breakdown"],
                      [*range(len(_ORDER)), len(_ORDER), len(_ORDER) + 1, len(_ORDER) + 2], len(_ORDER) + 3)
    key = df.assign(_group=group, _size=df["delta_us"].abs())
    key = key.sort_values(["_group", "_size", "what", "name", "rank"], ascending=[True, False, True, True, True],
                          kind="stable")
    return [_plain(r) for r in key[ITEM_COLUMNS].to_dict("records")]


def _capped(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first ``LISTED`` job-wide rows and the first ``LISTED`` per-rank ones, in their order."""
    seen = {True: 0, False: 0}
    out = []
    for r in rows:
        job = r["rank"] == -1
        seen[job] += 1
        if seen[job] <= LISTED:
            out.append(r)
    return out


def _named(items: pd.DataFrame, zero: str) -> list[dict[str, Any]]:
    """Job-wide kernels, ops and collectives only in one run (``zero`` is the other), largest first."""
    other = "new" if zero == "base" else "base"
    rows = items[(items["rank"] == -1) & items["what"].isin(["kernel", "op", "collective"]) & (items[zero] == 0)
                 & (items[other] > 0)].sort_values([other, "name"], ascending=[False, True])
    return [{"what": w, "name": n, "us": round(float(v), 3)}
            for w, n, v in zip(rows["what"], rows["name"], rows[other])][:LISTED]


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        if isinstance(v, float):
            v = round(v, 3) if math.isfinite(v) else None
        elif hasattr(v, "item"):
            v = v.item()
        out[k] = v
    return out


def _stats(values: Iterable[float]) -> dict[str, float]:
    v = list(values)
    return {"min": round(min(v), 3), "median": round(statistics.median(v), 3), "max": round(max(v), 3)}


def _cause_name(summary: dict[str, Any]) -> str | None:
    """The op the straggler's cause names (None: none explains it); a report written before ``op`` was, its top."""
    cause = summary["straggler"].get("cause")
    if not cause or not cause.get("top"):
        return None
    op = cause["op"] if "op" in cause else cause["top"][0]["name"]
    return None if op is None else name_key(op)


def _straggler(sides: Sequence[_Side]) -> dict[str, Any]:
    (rb, cb), (rn, cn) = ((s.a.summary["straggler"]["rank"], _cause_name(s.a.summary)) for s in sides)
    return {"base": rb, "new": rn, "changed": rb != rn, "cause_base": cb, "cause_new": cn,
            "cause_changed": cb != cn}


def _verdict(step: dict[str, Any], root: dict[str, Any] | None, groups: list[dict[str, Any]],
             changes: list[dict[str, Any]], on_path: Mapping[str, float], straggler: dict[str, Any],
             sides: Sequence[_Side], noise: float) -> str:
    """The root change first (``groups``: for runs whose kernels share little time by name, the op groups that
    changed most per step), then the step time and the straggler."""
    lead = []
    if groups:
        lead.append("the kernels differ by name; by op and shapes: " + ", ".join(map(_root_text, groups)))
    elif root is not None:
        lead.append(_root_text(root, sides))
        group = next((r for r in changes if r["rank"] == -1 and r["what"] == "op group" and r["new_kernel"]
                      and name_key(r["new_kernel"]) == root["name"] and r["delta_us"] * root["delta_us"] > 0), None)
        if root["what"] == "kernel" and group is not None:  # the op and shapes it ran for
            lead[0] += f", in op `{group['label']}`"
    pct = step["delta_pct"]
    if step["significant"]:
        text = (f"step time {pct:+.1f}% ({step['base'] / 1e3:,.1f} ms → {step['new'] / 1e3:,.1f} ms, median over "
                "steps)")
        moved = on_path.get(root["name"], 0.0) if root is not None else 0.0
        if moved * step["delta_us"] > 0:
            text += (f"; on the critical path `{root['label']}` takes {moved / 1e3:+,.1f} ms per step "
                     f"({moved / step['delta_us']:.0%} of the change)")
        busy = next((r for r in changes if r["rank"] != -1 and r["what"] == "breakdown"
                     and r["name"] == "computation_us" and r["delta_us"] > 0), None)
        if busy is not None and step["delta_us"] > 0 and len(sides[0].ranks) > 1:
            text += f"; rank {busy['rank']}'s computation {_pct_text(busy)}"
    elif any(len(s.steps_us) < 2 for s in sides):  # a run of one step has no spread to be within
        text = (f"no significant change in step time ({pct:+.1f}%, below the smallest change reported, "
                f"{MIN_CHANGE_PCT:g}%)")
    else:
        text = (f"no significant change in step time ({pct:+.1f}%, within the runs' step-to-step spread of "
                f"{noise:.1f}% and the smallest change reported, {MIN_CHANGE_PCT:g}%)")
    text = "; ".join([*lead, text])
    if straggler["changed"]:
        was = "no straggler" if straggler["base"] is None else f"rank {straggler['base']}"
        now = "no straggler" if straggler["new"] is None else f"rank {straggler['new']}"
        text += f"; the straggler changed from {was} to {now}"
        if straggler["cause_new"]:
            text += f", late because of `{kernel_label(straggler['cause_new'])}`"
    elif straggler["cause_changed"] and straggler["new"] is not None:
        now, was = (f"`{kernel_label(c)}`" if c else "no single op" for c in (straggler["cause_new"],
                                                                               straggler["cause_base"]))
        text += f"; rank {straggler['new']} is still the straggler, now because of {now} (was {was})"
    return text


def _root_text(row: dict[str, Any], sides: Sequence[_Side] | None = None) -> str:
    """A change in words: ``kernel `…` +30% on all ranks (renamed from `…`)``, ``op group `aten::mm [8944×1024 ·
    1024×2816]` +31% per call (kernel changed: `…` → `…`)``."""
    where = _where(row, sides) if sides is not None else ""
    if row["what"] == "op group":
        if row["base_mean_us"] and row["new_mean_us"]:
            text = f"op `{row['label']}` {_pct(row['base_mean_us'], row['new_mean_us']):+.0f}% per call{where}"
        else:  # in one run only
            text = f"op `{row['label']}` {_pct_text(row)}{where}"
        if row["base_kernel"] and row["new_kernel"] and name_key(row["base_kernel"]) != name_key(row["new_kernel"]):
            text += (f" (kernel changed: `{kernel_label(row['base_kernel'], 60)}` → "
                     f"`{kernel_label(row['new_kernel'], 60)}`)")
        return text
    text = f"{row['what']} `{row['label']}` {_pct_text(row)}{where}"
    if row["what"] == "kernel" and row["base_kernel"]:
        text += f" (renamed from `{kernel_label(row['base_kernel'])}`)"
    return text


def _pct_text(row: dict[str, Any]) -> str:
    return "(new)" if row["delta_pct"] is None else f"{row['delta_pct']:+.0f}%"


def _where(row: dict[str, Any], sides: Sequence[_Side]) -> str:
    """On how many ranks a job-wide name went up significantly (runs of the same ranks only)."""
    n, ranks = row["ranks_regressed"], len(sides[0].ranks)
    if n is None or row["delta_us"] <= 0:
        return ""
    return " on all ranks" if n == ranks else f" on {n} of {ranks} ranks"
