"""One run of a diff (``Side``): its figures per step, and its step-to-step noise (``compare``'s notes: Noise)."""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ...errors import TraceFormatError
from ..schema import MEANS, OP_PERF_COLUMNS
from .identity import group_label, name_key

if TYPE_CHECKING:
    from ..schema import Analysis

__all__ = ["BREAKDOWN", "MIN_CHANGE_PCT", "SUMMED", "Side", "pct_change", "rank_means", "step_spread",
           "straggler_of"]

MIN_CHANGE_PCT = 1.0  # the smallest change reported (%), whatever the runs' spreads
BREAKDOWN = ("computation_us", "communication_us", "exposed_comm_us", "memcpy_us", "idle_us")
# per rank and name: summed per step, or the mean of the ranks' (rates); beside each figure in the items
SUMMED = ("us", "count", "wait_us")


class Side:
    """One run's figures per step."""

    def __init__(self, a: Analysis, label: str) -> None:
        self.a, self.label = a, label
        s = a.summary
        self.ranks = [int(r) for r in s["ranks"]]
        # a step's period on the host, as the per-rank step times (breakdown_by_step) measure it; its path also
        # holds the device work that runs on into the next step (duration_us); a report before host_us: that
        self.steps_us = [float(p.get("host_us", p["duration_us"])) for p in s.get("critical_path") or []]
        if not self.steps_us:
            raise TraceFormatError(f"the {label} run has no step times: its traces hold no ProfilerStep#N "
                                   "with host events (collective_trace logs alone have none), so there is nothing "
                                   "to compare step by step; diff two runs whose torch.profiler recorded its steps "
                                   "(a schedule, with prof.step() called each step)")
        self.n_steps = len(self.steps_us)
        self.spread_pct = step_spread(self.steps_us)
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
        for x in (*SUMMED, *MEANS):
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
        for col in SUMMED:
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


def step_spread(values: Sequence[float]) -> float:
    """A run's step-to-step spread in % of its median: ``2 × 1.4826 × MAD / median``; 0 below two steps."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return 100 * 2 * 1.4826 * mad / med if med else 0.0


def pct_change(base: float, new: float) -> float:
    if base == new:
        return 0.0
    return 100.0 * (new - base) / base if base else float("inf")


def rank_means(df: pd.DataFrame) -> pd.DataFrame:
    """µs a call, where there are calls."""
    for side in ("base", "new"):
        count = df[f"{side}_count"].astype(float)
        df[f"{side}_mean_us"] = (df[side] / count).where(count > 0)
    return df


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


def straggler_of(sides: Sequence[Side]) -> dict[str, Any]:
    (rb, cb), (rn, cn) = ((s.a.summary["straggler"]["rank"], _cause_name(s.a.summary)) for s in sides)
    return {"base": rb, "new": rn, "changed": rb != rn, "cause_base": cb, "cause_new": cn,
            "cause_changed": cb != cn}
