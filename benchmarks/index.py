"""Benchmark ``tracefuse index`` against the merge of the same ranks, side by side, and time SQL over the store.

Usage: ``python benchmarks/index.py [--shapes a100,h100] [--ranks 8] [--rank-mb 50] [--workers 2] [--repeat 3]
[--out report.md]``

For each shape a dataset of ``.json.gz`` ranks is built from one real trace by ``../shared/tools/make_dataset.py``
(beside the repository): ``a100`` from real/hta_trace_filter, ``h100`` from real/tracelens_h100_qwen. In each
round, on one pre-started cluster of ``--workers`` worker processes, the merge (to ``.json.gz``) and the index
(``--force``) run in turn; the index's cost is the median of the rounds' own ratios (index / merge), with their
range, and its memory the peak RSS of the process tree. Then the store's size against the gzipped inputs, the
seconds of one query over the store (p99 kernel time per rank, in this process, median of 3), and ``analyze`` of
the JSON, of the store (the same tables: ``tests/test_output_hashes.py``) and of the JSON writing a store as it
goes (``--store``) side by side.

With ``--small-ranks N``: also N ranks of ``--small-kb`` kB (copies of one rank of the first shape cut to that
size, ``scale.py``'s ``small_template``), merged and indexed side by side: the index's seconds per rank and the
client's peak memory.

The issue's goals: the index at most 1.2x the merge, the store at most half the gzipped JSON, analyze from the
store no slower than from the JSON, ``analyze --store`` at most 1.2x ``analyze``; ``--ranks 256
--rank-mb 25 --shapes a100`` is its 6.4 GB query case (building it takes a while: make_dataset.py writes about
8 MB/s here); ``--small-ranks 10000`` its 5 ms per rank. ``--ranks 2 --rank-mb 5 --repeat 2`` takes about a
minute.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

from common import (
    MAKE_DATASET,
    MB,
    REAL_SHAPES,
    Row,
    Table,
    at_least_one,
    check_real_shapes,
    cleanup,
    environment,
    make_root,
    parser,
    real_source,
    round_ratios,
    write_report,
)

P99 = "SELECT rank, quantile_cont(dur_ns, 0.99) AS p99_ns FROM kernels GROUP BY rank ORDER BY rank"


def _dataset(shape: str, root: str, ranks: int, rank_mb: float) -> tuple[str, int]:
    """``ranks`` gzipped ranks of about ``rank_mb`` MB built from the shape's real trace; (folder, gzipped bytes)."""
    folder = os.path.join(root, f"{shape}_{ranks}x{rank_mb:g}MB")
    subprocess.run([sys.executable, MAKE_DATASET, "--source", real_source(shape), "--ranks", str(ranks),
                    "--mb-per-rank", f"{rank_mb:g}", "--gzip", "--out", folder], check=True, capture_output=True)
    return folder, sum(e.stat().st_size for e in os.scandir(folder) if e.name.endswith(".gz"))


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _small(tf: Any, client: Any, table: Table, root: str, shape: str, args: Any) -> str:
    """The merge and the index of ``--small-ranks`` small ranks side by side; the index's cost per rank."""
    import multiprocessing

    from scale import make_small_ranks, small_template

    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        folder, size = make_small_ranks(pool, root, args.small_ranks, small_template(root, args.small_kb, shape))
    merged, store = os.path.join(root, "small.json.gz"), os.path.join(root, "small.store")
    rows = [Row("merge → .json.gz", lambda: tf.merge_traces(folder, merged, client=client, force=True)),
            Row("index → store", lambda: tf.index_traces(folder, store, client=client, force=True))]
    got = table.rows(f"{shape} {args.small_ranks:,}×{args.small_kb:g} kB", size, {}, rows, args.repeat)
    if any(isinstance(g, Exception) for g in got):
        return f"- {args.small_ranks:,} small ranks: FAILED"
    (merge_s, _, _), (index_s, mem, _) = got
    per_rank = [min(t) / args.small_ranks * 1e3 for t in (index_s, merge_s)]
    return (f"- {args.small_ranks:,} ranks of {args.small_kb:g} kB: the index takes {per_rank[0]:.1f} ms per rank "
            f"(the merge {per_rank[1]:.1f}); the client's peak RSS "
            f"{mem.self_peak / 2**20:,.0f} MiB")


def _analyses(tf: Any, client: Any, table: Table, shape: str, folder: str, store: str, raw: int,
              repeat: int) -> str:
    """``analyze`` of the JSON, of its store, and of the JSON writing a store (``--store``) side by side: each
    against the plain analysis."""
    by_product = store + ".by-analyze"
    rows = [Row("analyze ← .json.gz", lambda: tf.analyze(folder, client=client)),
            Row("analyze ← store", lambda: tf.analyze(store, client=client)),
            Row("analyze --store ← .json.gz", lambda: tf.analyze(folder, client=client, store=by_product,
                                                                 force=True))]
    got = table.rows(f"{shape} analyze", raw, {}, rows, repeat)
    if any(isinstance(g, Exception) for g in got):
        return f"- {shape}: analyze FAILED"
    said = []
    for k, what in ((1, "analyze from the store"), (2, "analyze --store")):
        ratios = round_ratios(got[0][0], got[k][0])
        said.append(f"{what} takes {1 / statistics.median(ratios):.2f}× analyze from the JSON (rounds "
                    f"{1 / max(ratios):.2f}-{1 / min(ratios):.2f})")
    return f"- {shape}: " + "; ".join(said)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shapes", default="a100,h100", help="comma-separated real shapes (default a100,h100)")
    ap.add_argument("--ranks", type=at_least_one, default=8, help="ranks per dataset (default 8)")
    ap.add_argument("--rank-mb", type=float, default=50, help="uncompressed MB per rank (default 50)")
    ap.add_argument("--workers", type=at_least_one, default=2, help="worker processes (default 2)")
    ap.add_argument("--repeat", type=at_least_one, default=3, help="rounds (default 3)")
    ap.add_argument("--small-ranks", type=int, default=0, help="also this many small ranks (default 0: none)")
    ap.add_argument("--small-kb", type=float, default=20, help="kB per small rank (default 20)")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not shapes or set(shapes) - set(REAL_SHAPES):
        ap.error(f"--shapes {args.shapes}: not a list of {', '.join(REAL_SHAPES)}")
    check_real_shapes(shapes)

    import tracefuse_dask as tf
    from tracefuse_dask.cluster import connect

    lines = [environment(), f"{args.ranks} ranks of about {args.rank_mb:g} MB per shape, {args.workers} worker "
             f"processes, {args.repeat} rounds; s = best round; RSS = summed over the process tree.", ""]
    print("\n".join(lines), flush=True)
    table = Table()
    summary: list[str] = []
    root = make_root("tracefuse-index-bench-", args.tmp_dir)
    try:
        with connect(workers=args.workers) as client:
            for shape in shapes:
                folder, gz_bytes = _dataset(shape, root, args.ranks, args.rank_mb)
                raw = args.ranks * args.rank_mb * MB
                merged, store = os.path.join(root, "merged.json.gz"), os.path.join(root, f"{shape}.store")
                rows = [Row("merge → .json.gz", lambda: tf.merge_traces(folder, merged, client=client, force=True),
                            lambda s: s.bytes_out),
                        Row("index → store", lambda: tf.index_traces(folder, store, client=client, force=True),
                            lambda s: _size(store), lambda s: f"{s.events_out:,} rows")]
                got = table.rows(f"{shape} {args.ranks}×{args.rank_mb:g} MB", int(raw), {}, rows, args.repeat)
                if any(isinstance(g, Exception) for g in got):
                    continue
                ratios = round_ratios(got[0][0], got[1][0])
                seconds = []
                for _ in range(3):
                    t = time.perf_counter()
                    tf.query(store, P99)
                    seconds.append(time.perf_counter() - t)
                summary.append(
                    f"- {shape}: the index takes {1 / statistics.median(ratios):.2f}× the merge's time (rounds "
                    f"{1 / max(ratios):.2f}-{1 / min(ratios):.2f}); the store is {_size(store) / MB:.1f} MB, "
                    f"{_size(store) / gz_bytes:.2f}× the {gz_bytes / MB:.1f} MB of gzipped JSON; p99 kernel time "
                    f"per rank over it answers in {statistics.median(seconds):.2f} s")
                summary.append(_analyses(tf, client, table, shape, folder, store, int(raw), args.repeat))
            if args.small_ranks:
                summary.append(_small(tf, client, table, root, shapes[0], args))
    finally:
        cleanup(root, args.keep)
    lines += table.lines + [""] + summary
    print("\n".join(summary), flush=True)
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
