"""Cross-rank efficiency, from the per-rank ``op_perf`` tables and the matched collectives: is one GPU slower than
the others at equal work, and how close do the collectives come to the device's links.

A slow GPU shows as kernel time per call above the median rank's for the same op group (name, input dims, input
types, concrete inputs), across many groups of a category. A rank that is late because of host work has no such
excess: its kernels take what everyone's take, and the critical path explains it instead.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from ...perf.devices import Device

__all__ = ["GPU_SPEED_COLUMNS", "gpu_speed", "link_use", "node_of"]

GPU_SPEED_COLUMNS = ["rank", "category", "groups", "factor", "slower_share", "excess_us", "slow"]
_KEY = ["name", "input_dims", "input_types", "concrete_inputs"]
_MIN_GROUPS = 3  # a category's groups a rank needs before its factor says anything
_MIN_EXCESS = 0.05  # below 5% slower, a GPU is not called slow
_MAD_LIMIT = 3.0
_MIN_SHARE = 0.75  # the share of its groups in which a slow rank is slower than the median rank


def gpu_speed(op_perf: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any] | None]:
    """Per rank and category: over the op groups that a model covers and that at least 3 ranks ran, the median of
    the rank's kernel time per call over the median rank's (``factor``), the share of groups where it is slower,
    the kernel time it spent beyond the median rank's at those shapes (``excess_us``), and whether it stands out
    (``slow``): at least 5% slower, by more than 3 MADs of the ranks' factors, in at least 3 groups and 75% of
    them. Also the verdict for the slow rank and category that cost the most time, or None."""
    cols = GPU_SPEED_COLUMNS
    if op_perf.empty:  # no rank's ops launched kernels (or only collective_trace logs were given)
        return pd.DataFrame([], columns=cols), None
    t = op_perf[op_perf["gflop"].notna() & (op_perf["calls"] > 0) & (op_perf["kernel_us"] > 0)]
    if t.empty or t["rank"].nunique() < 3:
        return pd.DataFrame([], columns=cols), None
    t = t.assign(per_call=t["kernel_us"] / t["calls"])
    by = t.groupby(_KEY, sort=False)["per_call"]
    t = t.assign(ranks=by.transform("size"), median=by.transform("median"))
    t = t[t["ranks"] >= 3]
    if t.empty:
        return pd.DataFrame([], columns=cols), None
    t = t.assign(ratio=t["per_call"] / t["median"], excess=t["kernel_us"] - t["calls"] * t["median"])
    g = t.groupby(["rank", "category"], sort=True)
    table = pd.DataFrame({"groups": g["ratio"].size(), "factor": g["ratio"].median(),
                          "slower_share": g["ratio"].apply(lambda r: float((r > 1.0).mean())),
                          "excess_us": g["excess"].sum()}).reset_index()
    slow = np.zeros(len(table), dtype=bool)
    for cat, rows in table.groupby("category").groups.items():
        f = table.loc[rows, "factor"].to_numpy()
        mad = float(np.median(np.abs(f - np.median(f))))
        limit = max(_MIN_EXCESS, _MAD_LIMIT * 1.4826 * mad)
        slow[np.asarray(rows)] = ((f - np.median(f) > limit) & (table.loc[rows, "groups"].to_numpy() >= _MIN_GROUPS)
                                  & (table.loc[rows, "slower_share"].to_numpy() >= _MIN_SHARE))
    table["slow"] = slow
    table = table[cols]
    named = table[table["slow"]].sort_values(["excess_us", "factor", "rank"], ascending=[False, False, True])
    if named.empty:
        return table, None
    top = named.iloc[0]
    rank, cat, factor, groups = int(top["rank"]), str(top["category"]), float(top["factor"]), int(top["groups"])
    return table, {
        "rank": rank, "category": cat, "factor": round(factor, 4), "groups": groups,
        "excess_us": round(float(top["excess_us"]), 3),
        "others": [{"rank": int(r["rank"]), "category": r["category"], "factor": round(float(r["factor"]), 4),
                    "groups": int(r["groups"])} for _, r in named.iloc[1:].iterrows()],
        "text": f"rank {rank}'s GPU runs its {_plural(cat)} {100 * (factor - 1):.0f}% slower than the median rank at "
                f"equal shapes ({groups} op groups): a slow or throttled GPU",
    }


def _plural(category: str) -> str:
    return {"GEMM": "GEMMs", "elementwise": "elementwise ops", "reduce": "reductions"}.get(
        category, f"{category} ops")


def node_of(rank: int, host: str | None, gpus: int) -> str | None:
    """The node a rank ran on: its ``host_name``, else, when its trace lists the node's GPUs (Kineto's
    ``deviceProperties`` lists every GPU of the node), ``rank // GPUs``, as torchrun lays ranks out; else None."""
    if host:
        return host
    return f"node {rank // gpus} (rank // {gpus} GPUs)" if gpus > 1 else None  # one GPU seen: no node to tell


def link_use(instances: pd.DataFrame, matched: pd.DataFrame, hosts: Mapping[int, str | None],
             devices: Mapping[int, Device | None]) -> pd.DataFrame:
    """``instances`` with ``scope`` (``intra-node`` when every rank of the instance is on one node, ``inter-node``
    when they span nodes, None when a rank's node is unknown; ``hosts`` from ``node_of``) and ``link_pct``: an
    intra-node instance's bus bandwidth as a % of one direction of its device's peer links (half the NVLink or
    xGMI figure, which counts both). Inter-node traffic runs over the network, whose peak the device table does
    not know: no % there."""
    out = instances.assign(scope=None, link_pct=np.nan)
    if instances.empty or matched.empty:
        return out
    members = matched.groupby("instance")["rank"].agg(list)
    scopes, pcts = [], []
    for inst, busbw in zip(instances["instance"].tolist(), instances["busbw_gbps"].tolist()):
        ranks = members.get(inst, [])
        names = {hosts.get(r) for r in ranks}
        scope = None if not ranks or None in names else ("intra-node" if len(names) == 1 else "inter-node")
        link = [d.link_gb_s for d in (devices.get(r) for r in ranks) if d is not None and d.link_gb_s]
        pct = (100.0 * busbw / (min(link) / 2) if scope == "intra-node" and busbw is not None and not pd.isna(busbw)
               and len(link) == len(ranks) else np.nan)
        scopes.append(scope)
        pcts.append(pct)
    return out.assign(scope=scopes, link_pct=pcts)
