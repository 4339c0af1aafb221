"""op_perf across ranks: time by op category and the roofline summary."""
from __future__ import annotations

from typing import Any

import pandas as pd

__all__ = ["by_category", "roofline_summary"]


def by_category(op_perf: pd.DataFrame) -> pd.DataFrame:
    """Per rank and category: the kernel time, its share of the rank's op kernel time, how much of it has a model
    and a roofline, and the time-weighted % of roofline over that part."""
    columns = ["rank", "category", "kernel_us", "time_pct", "roofline_us", "roofline_pct"]
    if op_perf.empty:
        return pd.DataFrame([], columns=columns)
    t = op_perf.assign(roofed=op_perf["kernel_us"].where(op_perf["roofline_pct"].notna(), 0.0),
                       weighted=(op_perf["kernel_us"] * op_perf["roofline_pct"]).fillna(0.0))
    g = t.groupby(["rank", "category"], sort=True)[["kernel_us", "roofed", "weighted"]].sum().reset_index()
    total = g.groupby("rank")["kernel_us"].transform("sum")
    g["time_pct"] = 100.0 * g["kernel_us"] / total.where(total > 0)
    g["roofline_pct"] = g["weighted"] / g["roofed"].where(g["roofed"] > 0)
    g = g.rename(columns={"roofed": "roofline_us"})
    return g.sort_values(["rank", "kernel_us", "category"], ascending=[True, False, True], ignore_index=True)[columns]


def roofline_summary(categories: pd.DataFrame) -> dict[str, Any] | None:
    """Over all ranks, per category: the kernel time, its share and the time-weighted % of roofline; and a line
    that says it (None without a roofline anywhere)."""
    if categories.empty or not (categories["roofline_us"] > 0).any():
        return None
    t = categories.assign(weighted=(categories["roofline_pct"] * categories["roofline_us"]).fillna(0.0))
    g = t.groupby("category")[["kernel_us", "roofline_us", "weighted"]].sum()
    g = g.sort_values("kernel_us", ascending=False)
    total = float(g["kernel_us"].sum())
    rows = {str(c): {"kernel_us": round(float(r["kernel_us"]), 3),
                     "time_pct": round(100.0 * float(r["kernel_us"]) / total, 2) if total else None,
                     "roofline_pct": round(float(r["weighted"] / r["roofline_us"]), 2) if r["roofline_us"] > 0
                     else None} for c, r in g.iterrows()}
    parts = [f"{c} {v['time_pct']:.0f}% of op kernel time at {v['roofline_pct']:.0f}% of roofline"
             for c, v in rows.items() if v["roofline_pct"] is not None and v["time_pct"] is not None][:4]
    return {"categories": rows, "text": "; ".join(parts)}
