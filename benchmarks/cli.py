"""The command line end to end, as a user starts it, against a TraceLens-style merge started the same way.

Usage: ``python benchmarks/cli.py [--shapes example,a100] [--rank-mb 50] [--repeat 5] [--out report.md]``

Each row is a fresh process, timed from its start to its exit: ``tracefuse merge DIR -o OUT.json.gz -q``
(Python start, imports, the embedded cluster's start, the merge, its shutdown; inputs this small run in
threads of the process, ``programs.small_input``) and ``python -c`` running the naive TraceLens-style merge
(``json.load`` of every rank, one event list, pids offset, ``json.dump(indent=4)`` through gzip -9, one
process: what TraceLens's ``TraceFuse.merge_and_save`` costs). The rows alternate in every round; a row's
speed against the naive merge is the median (range) of the rounds' own ratios. Datasets: ``example`` is
``tracefuse example`` (8 ranks of 1 MB, what the quick start merges); ``a100``, ``h100`` and ``b200`` are 8
ranks of ``--rank-mb`` built from a real trace by ``../shared/tools/make_dataset.py``. Also timed, as
medians of ``--repeat`` fresh processes: ``tracefuse --version`` and the import of the API (``from
tracefuse_dask import merge_traces``).

About 1 minute for ``--shapes example``; each 8 × 50 MB real shape adds about 5 minutes (the naive merge
takes about a minute a round there).
"""
from __future__ import annotations

import inspect
import os
import shutil
import statistics
import subprocess
import sys
import time

from common import (
    MB,
    REAL_SHAPES,
    check_real_shapes,
    cleanup,
    environment,
    make_real,
    make_root,
    naive_merge,
    paired,
    parser,
    write_report,
)

from tracefuse_dask.synth import write_example

_NAIVE = "import gzip, json, math, os, sys\nfrom typing import Any\n" + inspect.getsource(naive_merge) + \
    "naive_merge(sys.argv[2:], sys.argv[1])\n"


def timed(cmd: list[str]) -> float:
    """Seconds from the start of ``cmd`` to its exit; its failure is raised."""
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    took = time.perf_counter() - t
    if done.returncode:
        raise RuntimeError(f"{cmd[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return took


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shapes", default="example", help="datasets: example and/or a100,h100,b200 (default example)")
    ap.add_argument("--rank-mb", type=float, default=50, help="MB per rank of the real shapes (default 50)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = set(shapes) - {"example", *REAL_SHAPES}
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(sorted(unknown))}; choose from example, {', '.join(REAL_SHAPES)}")
    check_real_shapes([s for s in shapes if s != "example"])
    tracefuse = os.path.join(os.path.dirname(sys.executable), "tracefuse")
    lines = [environment(), f"Fresh processes, {args.repeat} alternating rounds; s = median.", "",
             "| row | dataset | MB on disk | s | speed vs naive | note |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    root = make_root("tracefuse-cli-bench-", args.tmp_dir)
    try:
        for shape in shapes:
            if shape == "example":
                folder = os.path.join(root, "example")
                write_example(folder, ranks=8, rank_bytes=1_000_000)
                paths = sorted(os.path.join(folder, n) for n in os.listdir(folder))
                size = sum(os.path.getsize(p) for p in paths)
                name = "example 8 × 1 MB"
            else:
                folder, paths, size = make_real(shape, root, 8, args.rank_mb)
                name = f"{shape} 8 × {args.rank_mb:g} MB"
            ours: list[float] = []
            naive: list[float] = []
            for _ in range(args.repeat):
                ours.append(timed([tracefuse, "merge", folder, "-o", os.path.join(root, "out.json.gz"), "-q",
                                   "--force"]))
                naive.append(timed([sys.executable, "-c", _NAIVE, os.path.join(root, "naive.json.gz"), *paths]))
            for label, times, note in (("tracefuse merge (CLI, embedded cluster)", ours, "gzip, one member per rank"),
                                       ("naive TraceLens-style (python -c)", naive, "json indent=4, gzip -9")):
                line = (f"| {label} | {name} | {size / MB:.0f} | {statistics.median(times):.2f} | "
                        f"{paired(naive, times)} | {note} |")
                lines.append(line)
                print(line, flush=True)
            shutil.rmtree(folder)
        version = [timed([tracefuse, "--version"]) for _ in range(args.repeat)]
        api = [timed([sys.executable, "-c", "from tracefuse_dask import merge_traces"]) for _ in range(args.repeat)]
        tail = [f"`tracefuse --version`: {statistics.median(version):.2f} s; `from tracefuse_dask import "
                f"merge_traces` (Python start included): {statistics.median(api):.2f} s (medians of {args.repeat})."]
        print("\n" + tail[0], flush=True)
        lines += ["", *tail]
    finally:
        cleanup(root, args.keep)
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
