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

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..schema import ITEM_COLUMNS, MEANS, Diff
from .identity import (
    MIN_KERNEL_OVERLAP,
    MIN_NAME_OVERLAP,
    PATH_LABEL,
    labelled,
    matched_groups,
    renamed_kernels,
)
from .sides import (
    MIN_CHANGE_PCT,
    SUMMED,
    Side,
    pct_change,
    rank_means,
    step_spread,
    straggler_of,
)
from .verdict import ROOTS, diff_verdict, path_deltas, root_change, route_note

if TYPE_CHECKING:
    from ..schema import Analysis

__all__ = ["compare"]

MIN_SHARE = 0.01
LISTED = 100  # job-wide and per-rank rows of each list in diff.json; the tables hold them all
_ORDER = ("kernel", "op group", "critical path", "collective", "op")


def compare(base: Analysis, new: Analysis, *, fail_above: float | None = None) -> Diff:
    """Compare two analysed runs; see the module's notes on significance, identity and ``fail_above`` (a
    percentage)."""
    sides = (Side(base, "base"), Side(new, "new"))
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
    matched = matched_groups(groups) if by_shape or renamed else None
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
    on_path = path_deltas(path_rows)
    root = groups_changed[0] if groups_changed else root_change(
        regressions if step["delta_us"] >= 0 or not step["significant"] else improvements, on_path)
    job = significant[(significant["rank"] == -1) & significant["what"].isin(ROOTS)]
    route = route_note(path_rows[~path_rows["name"].str.replace(PATH_LABEL, "", regex=True).isin(set(job["name"]))],
                       root)
    if route:
        notes.append(route)
    straggler = straggler_of(sides)
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
        "verdict": diff_verdict(step, root, groups_changed, regressions + improvements, on_path, straggler, sides, noise),
        "notes": notes,
        "warnings": warnings,
    }
    steps = pd.concat([s.step_rows() for s in sides], ignore_index=True)
    step_stats = (steps.groupby(["run", "rank"], sort=False)["step_us"].agg(["count", "min", "median", "max"])
                  .rename(columns={"count": "steps", "min": "min_us", "median": "median_us", "max": "max_us"})
                  .reset_index())
    return Diff({"items": items, "steps": steps, "step_stats": step_stats}, summary)


def _all_items(sides: tuple[Side, Side], step: dict[str, Any], same_ranks: bool, noise: float,
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
    renamed = renamed_kernels(groups, kernels)
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
    return labelled(items, renamed), per_what, kernels, renamed


def _step_item(sides: Sequence[Side], rank: int = -1) -> dict[str, Any]:
    """The job's step time (rank -1), or a rank's, with its significance against the runs' spreads."""
    b, n = (s.steps_us if rank == -1 else s.rank_steps.get(rank, ([], []))[1] for s in sides)
    what = "step time" if rank == -1 else "rank step time"
    if not b or not n:
        return _row(what, rank, float("nan"), float("nan"))
    row = _row(what, rank, statistics.median(b), statistics.median(n))
    row["significant"] = bool(abs(row["delta_pct"]) > max(step_spread(b), step_spread(n), MIN_CHANGE_PCT))
    return row


def _items(what: str, per_rank: Sequence[pd.DataFrame], ranks: Sequence[list[int]], noise: float,
           same_ranks: bool) -> pd.DataFrame:
    """Job-wide rows (rank -1: the mean over the run's ranks, a rank without the name counting 0) and, for runs
    of the same ranks, per-rank rows; ``ranks_regressed`` counts the ranks where the name went up significantly."""
    if all(p.empty for p in per_rank):  # such as the kernels of a CPU-only job
        return pd.DataFrame(columns=ITEM_COLUMNS)
    limit = max(noise, MIN_CHANGE_PCT)
    wide = [{x: p.set_index(["name", "rank"])[x].unstack("rank").reindex(columns=r) for x in (*SUMMED, *MEANS)}
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
        return rank_means(job)
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
    return rank_means(pd.concat([job, each], ignore_index=True))


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
            "delta_pct": pct_change(base, new), "significant": False, "ranks_regressed": None}


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


