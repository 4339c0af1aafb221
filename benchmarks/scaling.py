"""Benchmark one worker against two: tracefuse_dask.merge_traces and the orjson floor, side by side.

Usage: ``python benchmarks/scaling.py [--ranks 8] [--rank-mb 20] [--repeat 5]``

One generated dataset of plain ``.json`` ranks; a 1- and a 2-worker cluster and a 1- and a 2-process floor pool
(GC off), all started first; the merge to ``.json`` and ``.json.gz`` on each cluster and the floor on each pool run
in turn, once per round: the best times, and the speed-ups as the median (and range) of the rounds' own.

Takes about 1.5 minutes on 2 cores with ``--repeat 5`` and the defaults.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys

from common import (
    at_least_one,
    cleanup,
    empty,
    environment,
    floor_task,
    make_root,
    make_synthetic,
    measure,
    paired,
    parser,
    warm,
    write_report,
)


def main(argv: list[str] | None = None) -> int:
    """One worker against two, side by side: the merge on a 1- and a 2-worker cluster, the GC-off floor
    on a 1- and a 2-process pool, in turn (``measure``), ``--repeat`` (at least 3) rounds: the best times, and
    the speed-ups as the median (and range) of the rounds' own."""
    ap = parser(__doc__)
    ap.add_argument("--ranks", type=int, default=8, help="ranks of the dataset (default 8)")
    ap.add_argument("--rank-mb", type=float, default=20, help="uncompressed MB per rank (default 20)")
    ap.add_argument("--repeat", type=at_least_one, default=3, help="rounds, at least 3 (default 3)")
    args = ap.parse_args(argv)

    from tracefuse_dask import merge_traces
    from tracefuse_dask.cluster import connect

    ctx = multiprocessing.get_context("spawn")
    repeat = max(args.repeat, 3)
    n = args.ranks
    print(environment() + f"{n} ranks × {args.rank_mb:g} MB; every cluster and pool is started before any row; "
          f"the rows run in turn, each writing new files after a `sync`; s = best of {repeat} rounds, speed-up = the "
          f"median (range) of the rounds' speed-ups.\n", flush=True)
    root = make_root("tracefuse-scaling-", args.tmp_dir)
    lines: list[str] = []
    try:
        with ctx.Pool(2) as pool:
            folder, paths, _ = make_synthetic(pool, root, n, args.rank_mb)
        with contextlib.ExitStack() as stack:
            clients, pools = {}, {}
            for w in (1, 2):
                clients[w] = stack.enter_context(connect(workers=w))
                clients[w].run(warm)
                pools[w] = stack.enter_context(ctx.Pool(w))
                pools[w].map(warm, range(2 * w), chunksize=1)
            out_dir = os.path.join(root, "out")
            os.makedirs(out_dir)
            keys, fns = [], []
            for w in (1, 2):
                for ext in ("json", "json.gz"):
                    out = os.path.join(out_dir, f"m{w}.{ext}")
                    keys.append((ext, w))
                    fns.append(lambda out=out, c=clients[w]: merge_traces(folder, out, client=c, force=True))
                jobs = [(p, os.path.join(out_dir, f"floor_{w}_{r}.json"), True) for r, p in enumerate(paths)]
                keys.append(("floor", w))
                fns.append(lambda jobs=jobs, pool=pools[w]: pool.map(floor_task, jobs, chunksize=1))
            measured = measure(fns, repeat, before=lambda: empty(out_dir))
            for got in measured:
                if isinstance(got, Exception):
                    raise got
            times = {k: got[0] for k, got in zip(keys, measured)}  # type: ignore[index]
        lines += ["| row | 1 worker s | 2 workers s | speed-up |", "|---|---|---|---|"]
        for key, label in (("floor", "orjson floor (GC off), pool of 1 and 2 processes"),
                           ("json", "tracefuse merge → .json"), ("json.gz", "tracefuse merge → .json.gz")):
            one, two = times[(key, 1)], times[(key, 2)]
            lines.append(f"| {label} | {min(one):.2f} | {min(two):.2f} | {paired(one, two)} |")
        print("\n".join(lines), flush=True)
    finally:
        cleanup(root, args.keep)
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
