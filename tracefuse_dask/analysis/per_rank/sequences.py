"""The frequent kernel sequences of an operator (HolisticTraceAnalysis's ``get_frequent_cuda_kernel_sequences``,
HTA 0.5.0): for the calls of the ops whose names contain the operator's, at the shallowest depth where such calls
are, that launched at least ``MIN_PATTERN_LEN`` device events (kernels, copies, sets), the sequence of the op's
name and its device events' names in order of their start. Per rank in its task (``rank_sequences``), and across
ranks (``top_sequences``): how often each sequence ran, its device time and its ops' time. Pure functions, no IO.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..schema import MIN_PATTERN_LEN, SEQUENCE_COLUMNS
from .model import RankModel

__all__ = ["rank_sequences"]

SEPARATOR = "|"  # between a sequence's names, as HTA joins them


def rank_sequences(operator: str, model: RankModel) -> pd.DataFrame:
    """One rank's sequences of ``operator`` (``SEQUENCE_COLUMNS``, the most frequent first)."""
    tree, g, launch_pos = model.tree, model.gpu, model.launch_pos
    names = model.names[model.name_code[tree.order]].tolist()
    depth, stop, start, end = tree.depth, tree.stop, model.start[tree.order], model.end[tree.order]
    gpu_start, gpu_end, gpu_names = g.start, g.end, g.name
    candidates = np.flatnonzero(np.array([operator in n for n in names], dtype=bool))
    if not len(candidates):
        return pd.DataFrame(columns=SEQUENCE_COLUMNS)
    order = np.argsort(launch_pos, kind="stable")
    at = launch_pos[order]
    lo, hi = np.searchsorted(at, candidates, "left"), np.searchsorted(at, stop[candidates], "left")
    root = (depth[candidates] == depth[candidates].min()) & (hi - lo >= MIN_PATTERN_LEN)
    rows = []
    for p, a, b in zip(candidates[root].tolist(), lo[root].tolist(), hi[root].tolist()):
        events = order[a:b]
        events = events[np.argsort(gpu_start[events], kind="stable")]
        rows.append((SEPARATOR.join([names[p], *gpu_names[events].tolist()]),
                     float((gpu_end[events] - gpu_start[events]).sum()) / 1e3, float(end[p] - start[p]) / 1e3))
    if not rows:
        return pd.DataFrame(columns=SEQUENCE_COLUMNS)
    df = pd.DataFrame(rows, columns=["pattern", "gpu_us", "cpu_us"])
    out = df.groupby("pattern", sort=True).agg(count=("gpu_us", "size"), gpu_us=("gpu_us", "sum"),
                                                 cpu_us=("cpu_us", "sum")).reset_index()
    return out.sort_values(["count", "pattern"], ascending=[False, True], kind="stable",
                           ignore_index=True)[SEQUENCE_COLUMNS]


