"""collective_trace's calls of all ranks summarised: per op, hints and a straggler hint."""
from __future__ import annotations

from typing import Any

import pandas as pd

__all__ = ["summarize"]


def summarize(calls: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Per (op, shape, dtype, group): count, total, mean and max duration; and duration-only straggler hints.

    Calls are matched across ranks by their order within (rank, group, op, shape). In each match the
    rank with the shortest duration most likely arrived last (the others waited for it); per rank we
    count how often that was so, and the time the others spent beyond that shortest duration.

    Returns
    -------
    (summary, hints, verdict)
    """
    keys = ["op", "shape", "dtype", "group"]
    cols = ["rank", "calls", "shortest_count", "others_waited_us"]
    no_hint = {"rank": None, "confidence": 0.0, "evidence": "no call was logged by two or more ranks: no straggler hint"}
    if calls.empty and (calls.dtypes == object).all():  # as below, without pandas' 15 ms of grouping nothing
        return (pd.DataFrame(columns=[*keys, "count", "ranks", "total_us", "mean_us", "max_us", "bytes"]).astype(
            {"count": "int64", "ranks": "int64"}), pd.DataFrame(columns=cols), no_hint)
    c = calls.reset_index(drop=True)
    c = c.assign(**{k: c[k].fillna("") for k in keys})
    summary = (c.groupby(keys, sort=False)
               .agg(count=("duration_us", "size"), ranks=("rank", "nunique"), total_us=("duration_us", "sum"),
                    mean_us=("duration_us", "mean"), max_us=("duration_us", "max"), bytes=("bytes", "max"))
               .reset_index().sort_values(["total_us", "op"], ascending=[False, True], ignore_index=True))
    timed = c[c["duration_us"].notna() & c["rank"].notna()].copy()
    timed["ordinal"] = timed.groupby(["rank", *keys]).cumcount()
    rows = []
    for _, g in timed.groupby([*keys, "ordinal"], sort=False):
        if g["rank"].nunique() < 2:
            continue
        short = g["duration_us"].min()
        last = int(g.loc[g["duration_us"].idxmin(), "rank"])
        rows.append((last, float((g["duration_us"] - short).sum())))
    per_rank = timed.groupby("rank")["duration_us"].size().rename("calls")
    if not rows:
        hints = per_rank.reset_index().assign(shortest_count=0, others_waited_us=0.0)[cols] if len(per_rank) else \
            pd.DataFrame(columns=cols)
        return summary, hints, no_hint
    m = pd.DataFrame(rows, columns=["rank", "waited"])
    hints = pd.DataFrame({"calls": per_rank, "shortest_count": m.groupby("rank").size(),
                          "others_waited_us": m.groupby("rank")["waited"].sum()}).fillna(0)
    hints = hints.rename_axis("rank").reset_index().astype({"rank": int, "calls": int, "shortest_count": int})
    total = float(hints["others_waited_us"].sum())
    top = hints.sort_values(["others_waited_us", "rank"], ascending=[False, True]).iloc[0]
    share = float(top["others_waited_us"]) / total if total else 0.0
    n = len(hints)
    confidence = max(0.0, (share - 1 / n) / (1 - 1 / n)) if n > 1 else 0.0
    r = int(top["rank"])
    numbers = (f"it had the shortest duration in {int(top['shortest_count']):,} of {len(m):,} matched calls; the other "
               f"ranks spent {top['others_waited_us'] / 1e3:,.1f} ms longer in them ({share:.0%} of all such time)")
    if confidence >= 0.5:
        text = f"rank {r} probably arrives last (durations only; perf_counter times are not comparable): {numbers}"
    else:
        text = f"no straggler stands out in the durations (the most, rank {r}: {numbers})"
    return summary, hints[cols], {"rank": r if confidence >= 0.5 else None, "confidence": round(confidence, 3),
                                  "evidence": text}
