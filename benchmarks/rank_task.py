"""Benchmark what a change costs the analysis's per-rank task: this checkout against ``--baseline`` (a commit
before the change), side by side.

Usage: ``python benchmarks/rank_task.py [--shapes a100,h100] [--ranks 2] [--rank-mb 50] [--repeat 5]
[--baseline COMMIT]``

Each shape is ``--ranks`` ranks of about ``--rank-mb`` MB built from its real trace by
``../shared/tools/make_dataset.py`` (as ``benchmarks/merge.py`` builds them). Each run is a process of its own with
``PYTHONPATH`` on one checkout (the baseline in a temporary ``git worktree``): it runs the analysis's per-rank task
(``_analyze_file``: read, decode, analyse) on every rank once untimed, then times it on each rank, with the options
its checkout's task takes at their defaults. The rounds alternate the two checkouts, so that each round's ratio
pairs runs that ran one after the other; the overhead is the median (range) of those ratios. The rows say what the
task found: op groups (and how many a model covers) and launches, where its checkout has them.

Used for the op performance models (``--baseline 45604ca``) and for the launch statistics, queue length and memory
bandwidth (``--baseline fd1752a``). Takes about 4 minutes on 2 cores with the defaults.
"""
from __future__ import annotations

import json
import sys
import time

from common import baseline_main

COLUMNS = ["shape", "checkout", "ranks", "MB", "task s (best round)", "speed vs baseline", "op groups (modelled)",
           "launches"]


def _child(paths: list[str]) -> None:
    """Time the per-rank task of the ``tracefuse_dask`` on ``PYTHONPATH`` on each of ``paths``; a JSON line."""
    import importlib
    import inspect

    from tracefuse_dask.model import DEFAULT_RANK_REGEX, InputFile

    try:  # where the task is: analysis/tasks.py, or analysis/__init__.py before analysis/ was one folder a phase
        analysis = importlib.import_module("tracefuse_dask.analysis.tasks")
    except ImportError:
        analysis = importlib.import_module("tracefuse_dask.analysis")

    takes = inspect.signature(analysis._analyze_file).parameters
    if "request" in takes:  # the options as one AnalyzeRequest
        from tracefuse_dask.analysis.schema import AnalyzeRequest
        from tracefuse_dask.perf.devices import load_devices

        request = AnalyzeRequest(devices=load_devices())

        def task(path: str, rank: int) -> dict:
            return analysis._analyze_file(InputFile(path, rank_hint=rank, hint_source="order"), request)
    else:  # a checkout before it: the options one by one, those its task takes
        extra: dict = {}
        if "devices" in takes:
            from tracefuse_dask.perf.devices import load_devices

            extra["devices"] = load_devices()
        if "cutoffs" in takes:
            extra.update(cutoffs=importlib.import_module("tracefuse_dask").Cutoffs(), sequences_of=None)
        if "repair" in takes:
            extra["repair"] = False

        def task(path: str, rank: int) -> dict:
            return analysis._analyze_file(InputFile(path, rank_hint=rank, hint_source="order"), None, None, None,
                                          DEFAULT_RANK_REGEX, False, **extra)

    for r, p in enumerate(paths):  # warm: imports, caches, the page cache
        task(p, r)
    t = time.perf_counter()
    results = [task(p, r) for r, p in enumerate(paths)]
    seconds = time.perf_counter() - t
    found: dict = {}
    for res in results:
        for rt in res["ranks"]:
            perf, launches = rt.tables.get("op_perf"), rt.tables.get("launch_stats")
            if perf is not None:
                found["groups"] = found.get("groups", 0) + len(perf)
                found["modelled"] = found.get("modelled", 0) + int(perf["gflop"].notna().sum())
            if launches is not None:
                found["launches"] = found.get("launches", 0) + int(launches["launches"].sum())
    print(json.dumps({"seconds": seconds, **found}))


def _found(best: dict) -> list[str]:
    """The op groups (how many a model covers) and launches the best run found, where its checkout has them."""
    return [f"{best['groups']:,} ({best['modelled']:,})" if "groups" in best else "-",
            f"{best['launches']:,}" if "launches" in best else "-"]


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2:])
    baseline_main(__doc__, __file__, "tracefuse-ranktask-", COLUMNS,
                  {"shapes": "a100,h100", "ranks": 2, "repeat": 5, "baseline": "fd1752a",
                   "why": "before the launch statistics, queue length and memory bandwidth"},
                  lambda folder, paths, root: paths, _found)


if __name__ == "__main__":
    main()
