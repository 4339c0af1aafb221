"""HolisticTraceAnalysis's counters across ranks: each rank's metrics for ``rank_stats`` and the launch summary."""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..schema import Cutoffs

__all__ = ["launch_summary", "rank_metrics"]


def rank_metrics(launches: pd.DataFrame, queues: pd.DataFrame) -> pd.DataFrame:
    """Per rank (the index) that launched work: its median launch delay (``median_launch_delay_us``) and the mean
    queue length of its busiest stream (``queue_length_mean``), for the outliers across ranks (``rank_stats``)."""
    out = pd.DataFrame(index=pd.Index([], name="rank", dtype=np.int64))
    if len(launches):
        launched = launches[launches["launches"] > 0]
        out = out.join(launched.set_index("rank")["median_launch_delay_us"], how="outer")
    if len(queues):
        out = out.join(queues.groupby("rank")["mean"].max().rename("queue_length_mean"), how="outer")
    return out


def launch_summary(launches: pd.DataFrame, queues: pd.DataFrame, memory: pd.DataFrame, stats: pd.DataFrame,
                   cutoffs: Cutoffs) -> dict[str, Any] | None:
    """``summary.json``'s ``launches``: the job's counts, the median rank's launch delay, the longest queue, the
    time streams spent full, each copy kind's highest bandwidth, the ranks that stand out (``rank_stats``'s
    outliers of ``rank_metrics``) and a line that says it; None when no rank launched anything."""
    if launches.empty or not (launches["launches"] > 0).any():
        return None
    launched = launches[launches["launches"] > 0]
    total = {c: int(launches[c].sum()) for c in ("launches", "short_kernels", "runtime_outliers",
                                                  "launch_delay_outliers")}
    outliers = {m: [int(r) for r in stats.loc[stats["metric"] == m, "outlier_ranks"].iloc[0]]
                for m in ("median_launch_delay_us", "queue_length_mean") if (stats["metric"] == m).any()}
    out: dict[str, Any] = {
        "cutoffs": {"runtime_us": cutoffs.runtime_us, "launch_delay_us": cutoffs.launch_delay_us,
                    "max_queue_length": cutoffs.max_queue_length},
        **total,
        "median_launch_delay_us": round(float(launched["median_launch_delay_us"].median()), 3),
        "max_queue_length": None, "time_full_us": 0.0,
        "memory_max_gbps": {str(k): round(float(v), 3) for k, v in memory.groupby("kind")["max_gbps"].max().items()}
        if len(memory) else {},
        "outlier_ranks": outliers,
    }
    text = (f"{total['launches']:,} launches on {len(launched)} rank(s): median launch delay "
            f"{out['median_launch_delay_us']:,.1f} µs; {total['launch_delay_outliers']:,} waited over "
            f"{cutoffs.launch_delay_us:g} µs, {total['runtime_outliers']:,} calls took over {cutoffs.runtime_us:g} "
            f"µs, {total['short_kernels']:,} kernels ran shorter than their launch")
    if len(queues):
        top = queues.sort_values(["max", "rank"], ascending=[False, True], kind="stable").head(1).to_dict("records")[0]
        out["max_queue_length"] = int(top["max"])
        out["time_full_us"] = round(float(queues["time_full_us"].sum()), 3)
        full = (f"full ({cutoffs.max_queue_length:,}) for {out['time_full_us'] / 1e3:,.1f} ms" if out["time_full_us"]
                else "never full")
        text += f"; queues up to {int(top['max']):,} (rank {int(top['rank'])}, stream {top['stream']}), {full}"
    for metric, ranks in outliers.items():
        if ranks:
            what = "median launch delay" if metric == "median_launch_delay_us" else "queue length"
            text += f"; rank(s) {', '.join(map(str, ranks))} stand out by {what}"
    out["text"] = text
    return out
