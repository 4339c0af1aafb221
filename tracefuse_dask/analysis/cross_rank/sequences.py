"""The job's most frequent kernel sequences, from each rank's (``per_rank.sequences``)."""
from __future__ import annotations

from typing import Any

import pandas as pd

from ..schema import MIN_PATTERN_LEN

__all__ = ["top_sequences"]

TOP = 5  # the sequences summary.json lists, HTA's top_k


def top_sequences(operator: str | None, per_rank: pd.DataFrame) -> dict[str, Any] | None:
    """``summary.json``'s ``kernel_sequences``: across ranks, the ``TOP`` most frequent sequences (how often,
    on how many ranks, their device and op time), and how many distinct ones there are; None without an
    operator."""
    if operator is None:
        return None
    if per_rank.empty:
        return {"operator": operator, "min_pattern_len": MIN_PATTERN_LEN, "distinct": 0, "top": [],
                "note": f"no call of an op whose name contains {operator!r} launched {MIN_PATTERN_LEN} or more "
                        "device events"}
    g = per_rank.groupby("pattern", sort=True).agg(count=("count", "sum"), ranks=("rank", "nunique"),
                                                   gpu_us=("gpu_us", "sum"), cpu_us=("cpu_us", "sum"))
    g = g.reset_index().sort_values(["count", "pattern"], ascending=[False, True], kind="stable").head(TOP)
    return {"operator": operator, "min_pattern_len": MIN_PATTERN_LEN, "distinct": int(per_rank["pattern"].nunique()),
            "top": [{"pattern": p, "count": int(c), "ranks": int(r), "gpu_us": round(float(gu), 3),
                     "cpu_us": round(float(cu), 3)}
                    for p, c, r, gu, cu in zip(g["pattern"], g["count"], g["ranks"], g["gpu_us"], g["cpu_us"])]}
