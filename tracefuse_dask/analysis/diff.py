"""Two runs compared (``tracefuse diff``): pure functions on two ``Analysis`` objects, no IO and no Dask.

Every figure is per step, so that runs of different lengths compare: a rank's total over its trace divided by
the run's steps (each step's length across ranks, as the critical path measures it; the whole trace counts as
one without steps). A job-wide figure is the mean over the run's ranks (the job's total over its ranks; a rank
without the name counts 0), the job's step time the median over its steps.

Noise. A run's spread is ``2 × 1.4826 × MAD / median`` of its step times (about two standard deviations for
normal noise; the median absolute deviation, so that one warm-up or checkpoint step does not blind the check;
0 with fewer than two steps). A change is significant when it is larger than both runs' spreads and than
``MIN_CHANGE_PCT``; for a rank's step time, than that rank's spreads. The other figures (breakdown, kernels,
ops, collectives) are kept per trace, not per step: they are held to the job's spreads.

A check with ``fail_above`` fails on a significant regression above it of the job's step time, or of a figure
that is at least ``MIN_SHARE`` of the step time (so that a 2 µs kernel that doubles does not fail a nightly job).
A name only in the new run (a renamed kernel, a recompiled Triton one) fails it only when the step time also
regressed significantly; with fewer than two steps in a run only the step time can fail it.
"""
from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..kineto.vocabulary import is_comm_kernel

if TYPE_CHECKING:
    from . import Analysis

__all__ = ["BREAKDOWN", "ITEM_COLUMNS", "Diff", "compare", "normalize_name"]

MIN_CHANGE_PCT = 1.0
MIN_SHARE = 0.01
MIN_NAME_OVERLAP = 0.2  # below this share of matching kernel and op names, two runs look like different models
LISTED = 100  # job-wide and per-rank rows of each list in diff.json; the tables hold them all
BREAKDOWN = ("computation_us", "communication_us", "exposed_comm_us", "memcpy_us", "idle_us")
# per rank and name: summed per step (bandwidths: the mean of the calls'); beside each figure in the items
_SUMMED = ("us", "count", "algbw_gbps", "busbw_gbps", "wait_us")
_EXTRAS = ("count", "mean_us", "algbw_gbps", "busbw_gbps", "wait_us")
ITEM_COLUMNS = ["what", "name", "rank", "base", "new", "delta_us", "delta_pct", "significant", "ranks_regressed",
                *(f"{side}_{x}" for x in _EXTRAS for side in ("base", "new"))]
_ORDER = ("kernel", "critical path", "collective", "op")
_TEMPLATE = re.compile(r"<[^<>]*>")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_STEP = re.compile(r"#\d+")
_SHORT_RUN = re.compile(r"^\d+ (short \w[\w ]* segments)$")  # the critical path's joined runs
_ARGS = re.compile(r"\((?:[^()]|\([^()]*\))*\)$")


@dataclass
class Diff:
    """The comparison: ``tables`` (``items``, one row per figure compared, job-wide (rank -1) and per rank;
    ``steps``, the step times of both runs; ``step_stats``, their min, median and max per run and rank) and
    ``summary`` (``diff.json``)."""

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]

    @property
    def failed(self) -> bool:
        """Whether a regression went above ``fail_above`` (``tracefuse diff`` exits 3)."""
        return bool(self.summary["failing"])


def normalize_name(name: str) -> str:
    """A kernel or op name without what splits one kernel into many: template arguments, addresses, step
    numbers (``ProfilerStep#…``) and a trailing parameter list become ``…``; the critical path's
    ``N short cpu_op segments`` lose their count."""
    text = _SHORT_RUN.sub(r"\1", _STEP.sub("#…", _ADDRESS.sub("0x…", str(name))))
    while (cut := _TEMPLATE.sub("\0", text)) != text:  # the innermost first, each as a mark
        text = cut
    return _ARGS.sub("(…)", text.replace("\0", "<…>"))


def compare(base: Analysis, new: Analysis, *, fail_above: float | None = None) -> Diff:
    """Compare two analysed runs; see the module's notes on significance and ``fail_above`` (a percentage)."""
    sides = (_Side(base, "base"), _Side(new, "new"))
    same_ranks = sides[0].ranks == sides[1].ranks
    notes: list[str] = []
    if not same_ranks:
        notes.append(f"the runs have different ranks ({len(sides[0].ranks)} and {len(sides[1].ranks)}): compared by "
                     "job-wide figures (means over ranks); the per-rank rows are left out")
    few = [s for s in sides if len(s.steps_us) < 2]
    notes += [f"the {s.label} run has {len(s.steps_us)} step: its step-to-step spread is unknown, so a change "
              "counts from 1%, and only the step time can fail a check" for s in few]
    noise = max(s.spread_pct for s in sides)
    step = _step_item(sides)
    rows = [step]
    if same_ranks:
        rows += [_step_item(sides, r) for r in sides[0].ranks]
    frames = [pd.DataFrame(rows, columns=ITEM_COLUMNS)]
    names: list[set[str]] = [set(), set()]
    for what, table, value in (("breakdown", "breakdown", None), ("kernel", "kernels", "total_us"),
                               ("op", "ops", "cpu_time_us"), ("collective", "collectives", "latency_us")):
        per_rank = [s.per_rank(table, value) for s in sides]
        frames.append(_items(what, per_rank, [s.ranks for s in sides], noise, same_ranks))
        if what in ("kernel", "op"):
            for seen, p in zip(names, per_rank):
                seen.update(p["name"])
    paths = [s.path() for s in sides]
    names_cp = paths[0].index.union(paths[1].index)
    cp = _frame("critical path", names_cp, -1, *(p.reindex(names_cp, fill_value=0.0) for p in paths))
    cp["significant"] = cp["delta_pct"].abs() > max(noise, MIN_CHANGE_PCT)
    frames.append(cp)
    items = pd.concat([f for f in frames if len(f)], ignore_index=True).astype({"significant": bool})
    warnings = []
    if names[0] | names[1] and len(names[0] & names[1]) < MIN_NAME_OVERLAP * len(names[0] | names[1]):
        warnings.append(f"only {len(names[0] & names[1]):,} of {len(names[0] | names[1]):,} kernel and op names "
                        "match: two different models or programs? The figures by name compare little")
    step_us = step["new"]
    significant = items[items["significant"]]
    regressions = _ordered(significant[significant["delta_us"] > 0])
    improvements = _ordered(significant[significant["delta_us"] < 0])
    failing = [] if fail_above is None else [
        r for r in regressions if r["what"] == "step time" and r["delta_pct"] > fail_above
        or not few and step_us and r["new"] >= MIN_SHARE * step_us
        and (r["delta_pct"] > fail_above if r["delta_pct"] is not None else step["significant"])]
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
        "straggler": straggler,
        "fail_above_pct": fail_above,
        "failing": failing[:LISTED],
        "verdict": _verdict(step, regressions, straggler, sides, noise),
        "notes": notes,
        "warnings": warnings,
    }
    steps = pd.concat([s.step_rows() for s in sides], ignore_index=True)
    step_stats = (steps.groupby(["run", "rank"], sort=False)["step_us"].agg(["count", "min", "median", "max"])
                  .rename(columns={"count": "steps", "min": "min_us", "median": "median_us", "max": "max_us"})
                  .reset_index())
    return Diff({"items": items, "steps": steps, "step_stats": step_stats}, summary)


class _Side:
    """One run's figures per step."""

    def __init__(self, a: Analysis, label: str) -> None:
        self.a, self.label = a, label
        s = a.summary
        self.ranks = [int(r) for r in s["ranks"]]
        self.steps_us = [float(p["duration_us"]) for p in s.get("critical_path") or []]
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

    def per_rank(self, table: str, value: str | None) -> pd.DataFrame:
        """``rank, name, us`` per step: the table's figure by (normalised) name, or the breakdown's columns."""
        df = getattr(self.a, table) if table != "collectives" else self._collectives()
        if table == "breakdown":
            cols = [c for c in BREAKDOWN if c in df]
            long = df.melt(id_vars="rank", value_vars=cols, var_name="name", value_name="us").assign(
                count=np.nan, algbw_gbps=np.nan, busbw_gbps=np.nan, wait_us=np.nan)
        else:
            long = pd.DataFrame({"rank": df["rank"], "us": df[value], "count": df["count"],
                                 "name": df["name"] if table == "collectives" else df["name"].map(normalize_name),
                                 **{x: df.get(x, np.nan) for x in ("algbw_gbps", "busbw_gbps", "wait_us")}})
        long = long.dropna(subset=["us"]).groupby(["rank", "name"], as_index=False, sort=True).agg(
            us=("us", "sum"), count=("count", lambda c: c.sum(min_count=1)), algbw_gbps=("algbw_gbps", "mean"),
            busbw_gbps=("busbw_gbps", "mean"),
            wait_us=("wait_us", lambda w: w.sum(min_count=1)))
        for col in ("us", "count", "wait_us"):
            long[col] = long[col].astype(float) / self.n_steps
        return long

    def path(self) -> pd.Series:
        """Time per step on the critical path by (normalised) name, whatever the rank and kind."""
        cp = self.a.critical_path
        return (cp.assign(name=cp["name"].map(normalize_name)).groupby("name", sort=True)["dur_us"].sum()
                .astype(float) / self.n_steps)

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
        rows = [{"run": self.label, "rank": -1, "step": p["step"], "step_us": p["duration_us"]}
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
    wide = [{x: p.set_index(["name", "rank"])[x].unstack("rank").reindex(columns=r) for x in _SUMMED}
            for p, r in zip(per_rank, ranks)]
    names = wide[0]["us"].index.union(wide[1]["us"].index)
    job = _frame(what, names, -1, *(w["us"].reindex(names).fillna(0.0).mean(axis=1) for w in wide))
    job["significant"] = job["delta_pct"].abs() > limit
    for side, w in zip(("base", "new"), wide):
        job[f"{side}_count"] = w["count"].reindex(names).fillna(0.0).mean(axis=1).to_numpy()
        for x in ("algbw_gbps", "busbw_gbps", "wait_us"):  # over the ranks that have it
            job[f"{side}_{x}"] = w[x].reindex(names).mean(axis=1).to_numpy()
    if not same_ranks:
        return _means(job)
    both = per_rank[0].merge(per_rank[1], on=["rank", "name"], how="outer", suffixes=("_b", "_n"))
    both[["us_b", "us_n", "count_b", "count_n"]] = both[["us_b", "us_n", "count_b", "count_n"]].fillna(0.0)
    each = _frame(what, both["name"], both["rank"].astype(int), both["us_b"], both["us_n"])
    for x in ("count", "algbw_gbps", "busbw_gbps", "wait_us"):
        each[f"base_{x}"], each[f"new_{x}"] = both[f"{x}_b"].to_numpy(), both[f"{x}_n"].to_numpy()
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


def _frame(what: str, names: Any, rank: Any, base: Any, new: Any) -> pd.DataFrame:
    base, new = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = np.where(base == new, 0.0, np.where(base == 0, np.inf, 100.0 * (new - base) / base))
    return pd.DataFrame({"what": what, "name": np.asarray(names, dtype=object), "rank": rank, "base": base,
                         "new": new, "delta_us": new - base, "delta_pct": pct, "significant": False,
                         "ranks_regressed": None}, columns=ITEM_COLUMNS)


def _row(what: str, rank: int, base: float, new: float) -> dict[str, Any]:
    """A step-time row (its significance is the caller's)."""
    return {"what": what, "name": "step time", "rank": rank, "base": base, "new": new, "delta_us": new - base,
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
    cause = summary["straggler"].get("cause")
    return normalize_name(cause["top"][0]["name"]) if cause and cause.get("top") else None


def _straggler(sides: Sequence[_Side]) -> dict[str, Any]:
    (rb, cb), (rn, cn) = ((s.a.summary["straggler"]["rank"], _cause_name(s.a.summary)) for s in sides)
    return {"base": rb, "new": rn, "changed": rb != rn, "cause_base": cb, "cause_new": cn,
            "cause_changed": cb != cn}


def _verdict(step: dict[str, Any], regressions: list[dict[str, Any]], straggler: dict[str, Any],
             sides: Sequence[_Side], noise: float) -> str:
    pct = step["delta_pct"]
    if step["significant"]:
        text = (f"step time {pct:+.1f}% ({step['base'] / 1e3:,.1f} ms → {step['new'] / 1e3:,.1f} ms, median over "
                "steps)")
        job = [r for r in regressions if r["rank"] == -1]
        path = next((r for r in job if r["what"] == "critical path"), None)
        # a collective's kernels grow when their ranks wait for a late one: the waiting, not the cause
        kernel = next((r for r in job if r["what"] == "kernel" and not is_comm_kernel(r["name"])), None)
        if step["delta_us"] < 0:  # faster: what got slower does not explain it
            path = kernel = None
        if path is not None:
            share = f"{path['delta_us'] / step['delta_us']:.0%}"
            if kernel is not None and path["name"] == kernel["name"]:
                text += f"; {share} of it is kernel `{kernel['name']}` {_pct_text(kernel)}{_where(kernel, sides)}"
                kernel = None
            else:
                text += (f"; on the critical path `{path['name']}` takes {path['delta_us'] / 1e3:+,.1f} ms per step "
                         f"({share} of the increase)")
        if kernel is not None:
            text += f"; kernel `{kernel['name']}` {_pct_text(kernel)}{_where(kernel, sides)}"
        busy = next((r for r in regressions if r["rank"] != -1 and r["what"] == "breakdown"
                     and r["name"] == "computation_us"), None)
        if busy is not None and len(sides[0].ranks) > 1:
            text += f"; rank {busy['rank']}'s computation {_pct_text(busy)}"
    else:
        text = (f"no significant change in step time ({pct:+.1f}%, within the runs' step-to-step spread of "
                f"{noise:.1f}% and the smallest change reported, {MIN_CHANGE_PCT:g}%)")
        if regressions:
            top = regressions[0]
            on = _where(top, sides) if top["rank"] == -1 else f" on rank {top['rank']}"
            text += f"; largest significant regression: {top['what']} `{top['name']}` {_pct_text(top)}{on}"
    if straggler["changed"]:
        was = "no straggler" if straggler["base"] is None else f"rank {straggler['base']}"
        now = "no straggler" if straggler["new"] is None else f"rank {straggler['new']}"
        text += f"; the straggler changed from {was} to {now}"
        if straggler["cause_new"]:
            text += f", late because of `{straggler['cause_new']}`"
    elif straggler["cause_changed"] and straggler["new"] is not None:
        text += (f"; rank {straggler['new']} is still the straggler, now because of `{straggler['cause_new']}` "
                 f"(was `{straggler['cause_base']}`)")
    return text


def _pct_text(row: dict[str, Any]) -> str:
    return "(new)" if row["delta_pct"] is None else f"{row['delta_pct']:+.0f}%"


def _where(row: dict[str, Any], sides: Sequence[_Side]) -> str:
    """On how many ranks a job-wide name went up significantly (runs of the same ranks only)."""
    n, ranks = row["ranks_regressed"], len(sides[0].ranks)
    if n is None:
        return ""
    return " on all ranks" if n == ranks else f" on {n} of {ranks} ranks"
