"""Benchmark the whole merge of this checkout against ``--baseline`` (a commit before a change), side by side.

Usage: ``python benchmarks/merge_baseline.py [--shapes a100,h100] [--ranks 8] [--rank-mb 50] [--repeat 3]
[--baseline 3fb2f81^]``

Each shape is ``--ranks`` ranks of about ``--rank-mb`` MB built from its real trace by
``../shared/tools/make_dataset.py`` (as ``benchmarks/merge.py`` builds them). Each run is a process of its own with
``PYTHONPATH`` on one checkout (the baseline in a temporary ``git worktree``): it starts that checkout's embedded
cluster of 2 worker programs (``cluster.connect``, as ``tracefuse merge`` and ``benchmarks/merge.py`` do: workers
without a nanny and its malloc trimming, see docs/performance.md), merges the ranks to ``.json`` once untimed, then 3
times timed, and gives the median. The runs alternate the two checkouts, so that each ratio pairs runs that ran one
after the other; the row's speed is the median (range) of those ratios.

Used for issue 48 (lanes, the account and its anomalies) with the default baseline, the commit before its first.
Takes about 1 minute per shape on 2 cores with the defaults (2 min 8 s for both shapes on 2026-12-01).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from common import baseline_main

COLUMNS = ["shape", "checkout", "ranks", "MB", "merge s (median of 3, best run)", "speed vs baseline"]


def _child(folder: str, out: str) -> None:
    """Time the merge of the ``tracefuse_dask`` on ``PYTHONPATH`` of ``folder``; a JSON line."""
    from tracefuse_dask import merge_traces
    from tracefuse_dask.cluster import connect

    with connect(workers=2) as c:
        times = []
        for _ in range(4):  # the first warms the workers' imports and the page cache
            if os.path.exists(out):
                os.remove(out)
            t = time.perf_counter()
            merge_traces(folder, out, client=c)
            times.append(time.perf_counter() - t)
    os.remove(out)
    print(json.dumps({"seconds": statistics.median(times[1:])}))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(*sys.argv[2:4])
    baseline_main(__doc__, __file__, "tracefuse-mergebase-", COLUMNS,
                  {"shapes": "a100,h100", "ranks": 8, "repeat": 3, "baseline": "3fb2f81^", "why": "before issue 48"},
                  lambda folder, paths, root: [folder, os.path.join(root, "merged.json")])


if __name__ == "__main__":
    main()
