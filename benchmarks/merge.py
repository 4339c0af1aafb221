"""Benchmark tracefuse_dask.merge_traces against an orjson floor, a naive TraceLens-style merge and HTA.

Usage: ``python benchmarks/merge.py [--ranks 8,32] [--rank-mb 20] [--workers 2] [--repeat 5] [--out report.md]``

For each rank count, a generated dataset of plain ``.json`` ranks (``tracefuse_dask.synth``) and four rows run
side by side, in turn, once per round: the floor (a pool of ``--workers`` processes doing ``orjson.loads`` +
``orjson.dumps`` of every file and writing it) with Python's GC on and off, and tracefuse's merge to ``.json`` and
to ``.json.gz`` on a pre-started cluster of as many workers. A row's speed against a floor is the median (and
range) of the rounds' own ratios. On the smallest dataset, once each: the naive merge (``json.load``,
``json.dump(indent=4)``, gzip -9, one process) and HTA's load plus temporal breakdown
(``benchmarks/hta_breakdown.py`` run with ``--hta-python``).

Every row runs with the same number of worker processes. Memory is the summed RSS of the whole
process tree (this process, the Dask nanny and worker processes, pool workers, HTA's process and its
pool), sampled every 25 ms (the tree listed again every 0.5 s).

Takes about 7 minutes on 2 cores with ``--repeat 5`` and the defaults (most of it the naive row and HTA);
``--ranks 2 --rank-mb 0.5 --no-naive --no-hta`` takes seconds.
"""
from __future__ import annotations

import gzip
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
from typing import Any

from common import (
    HTA_PYTHON,
    HTA_SETUP,
    MB,
    Row,
    Table,
    at_least_one,
    cleanup,
    empty,
    environment,
    floor_task,
    hta_versions,
    in_child,
    make_root,
    make_synthetic,
    parser,
    run_hta,
    warm,
    write_report,
)


def _naive_merge(paths: list[str], out: str) -> int:
    """TraceLens TraceFuse, reduced to its cost: one process, json, one list, indent=4, gzip -9."""
    events: list[dict[str, Any]] = []
    mult = 0
    for rank, path in enumerate(paths):
        with open(path) as f:
            doc = json.load(f)
        if not mult:  # from file #1 only, as TraceLens does
            top = max((e["pid"] for e in doc["traceEvents"] if type(e.get("pid")) is int), default=0)
            mult = 10 ** (math.ceil(math.log10(top + 1)) + 1)
        for e in doc["traceEvents"]:
            if type(e.get("pid")) is int:
                e["pid"] += rank * mult
            events.append(e)
    with gzip.open(out, "wt", compresslevel=9) as f:
        json.dump({"traceEvents": events}, f, indent=4)
    return os.path.getsize(out)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--ranks", default="8,32", help="comma-separated rank counts, one dataset each (default 8,32)")
    ap.add_argument("--rank-mb", type=float, default=20, help="uncompressed MB per rank (default 20)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes for every row (default 2)")
    ap.add_argument("--repeat", type=at_least_one, default=1,
                    help="rounds per row; the rows of a dataset run in turn in each round, and a row's time is its "
                         "best, its speed against the floor the median (range) of the rounds' (default 1; naive "
                         "runs once)")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive TraceLens-style merge")
    ap.add_argument("--no-hta", action="store_true",
                    help="skip the HTA row (HTA's load + temporal breakdown, run with --hta-python)")
    ap.add_argument("--hta-python", default=HTA_PYTHON,
                    help=f"python of a venv with HolisticTraceAnalysis 0.5.0 (default {HTA_PYTHON}); without it "
                         f"the HTA row is skipped. Set it up: {HTA_SETUP}")
    ap.add_argument("--include-pyfunc", action="store_true", help="merge with include_pyfunc=True")
    args = ap.parse_args(argv)
    rank_counts = [int(x) for x in args.ranks.split(",") if x.strip()]

    from tracefuse_dask import merge_traces
    from tracefuse_dask.cluster import connect

    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs a Dask client
    header = (environment() +
              f"Every row uses {args.workers} worker processes. MB/s = uncompressed input MB / s. "
              f"RSS = summed over the process tree (benchmark + Dask nannies/workers + pool workers), "
              f"sampled every 25 ms (the tree listed again every 0.5 s); Δ = peak above the idle tree just "
              f"before the row. "
              f"s = best of {args.repeat} rounds; in each round the rows of a dataset run in turn, each "
              f"writing new files, after the page cache was written back (`sync`). A speed against a floor is "
              f"the median of the rounds' own (floor's time in the round / the row's), with their range: the "
              f"rows of one round run seconds apart, so a slow spell of the machine cancels out. "
              f"tracefuse drops python_function events unless --include-pyfunc "
              f"({'on' if args.include_pyfunc else 'off'} here).\n")
    hta = None if args.no_hta or not rank_counts else hta_versions(args.hta_python)
    if hta is None and rank_counts and not args.no_hta:
        header += (f"HTA row skipped: no HolisticTraceAnalysis at --hta-python {args.hta_python} "
                   f"(set it up: {HTA_SETUP}).\n")
    print(header, flush=True)
    table = Table()
    root = make_root("tracefuse-bench-", args.tmp_dir)
    try:
        datasets = []
        with ctx.Pool(args.workers) as pool:
            for n in rank_counts:
                t = time.perf_counter()
                datasets.append((n, *make_synthetic(pool, root, n, args.rank_mb)))
                print(f"generated {n} ranks × {args.rank_mb:g} MB = {datasets[-1][3] / MB:.0f} MB in "
                      f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        with connect(workers=args.workers) as client, ctx.Pool(args.workers) as pool:
            pool.map(warm, range(2 * args.workers), chunksize=1)
            client.run(warm)
            if datasets:
                print("\n".join(table.lines), flush=True)
            smallest = min((d[3] for d in datasets), default=0)
            for n, folder, paths, size in datasets:
                name, out_dir = f"{n}×{args.rank_mb:g} MB", os.path.join(root, f"out_{n}")
                os.makedirs(out_dir)
                floors: dict[str, list[float]] = {}
                rows = []
                for key, gc_off in (("gc_on", False), ("gc_off", True)):
                    jobs = [(p, os.path.join(out_dir, f"floor_{key}_{r}.json"), gc_off) for r, p in enumerate(paths)]
                    rows.append(Row(f"orjson floor (GC {key[3:]})",
                                    lambda jobs=jobs: pool.map(floor_task, jobs, chunksize=1), sum, floor=key))
                for ext in ("json", "json.gz"):
                    out = os.path.join(out_dir, f"merged.{ext}")
                    rows.append(Row(f"tracefuse merge → .{ext}",
                                    lambda out=out: merge_traces(folder, out, client=client, force=True,
                                                                 include_pyfunc=args.include_pyfunc),
                                    lambda r: r.bytes_out, lambda r: f"{r.events_in:,} → {r.events_out:,} events"))
                table.rows(name, size, floors, rows, args.repeat, before=lambda out_dir=out_dir: empty(out_dir))
                if size == smallest and not args.no_naive:
                    out = os.path.join(out_dir, "naive.json.gz")
                    table.row("naive TraceLens-style (1 process)", name, size, floors,
                              lambda: in_child(ctx, _naive_merge, paths, out), 1, int,
                              lambda r: "json, indent=4, gzip -9")
                if size == smallest and hta:
                    table.row("HTA load + temporal breakdown (its process and pool)", name, size, floors,
                              lambda: run_hta(args.hta_python, folder, ranks=n), 1,
                              note=lambda r: f"{hta}: load {r['load_s']:.2f} s + breakdown {r['breakdown_s']:.2f} s "
                                             f"of {len(r['ranks'])} ranks, Python start and imports the rest")
                if not args.keep:
                    shutil.rmtree(out_dir)
    finally:
        cleanup(root, args.keep)
    write_report(args.out, [header, *(table.lines if datasets else [])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
