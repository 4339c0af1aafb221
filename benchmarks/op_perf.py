"""Benchmark what the op performance models (``op_perf``, the roofline, the slow-GPU table) cost the per-rank
analysis task: at this checkout and at ``--baseline`` (the commit before them), side by side.

Usage: ``python benchmarks/op_perf.py [--shapes a100,h100] [--ranks 2] [--rank-mb 50] [--repeat 5]
[--baseline 45604ca]``

Each shape is ``--ranks`` ranks of about ``--rank-mb`` MB built from its real trace by
``../shared/tools/make_dataset.py`` (as ``benchmarks/merge.py`` builds them). Each run is a process of its own with
``PYTHONPATH`` on one checkout (the baseline in a temporary ``git worktree``): it runs the analysis's per-rank task
(``_analyze_file``: read, decode, analyse) on every rank once untimed, then times it on each rank. The rounds
alternate the two checkouts, so that each round's ratio pairs runs that ran one after the other; the overhead is
the median (range) of those ratios. The rows say how many op groups the task found, and how many a model covers.

Takes about 4 minutes on 2 cores with the defaults.
"""
from __future__ import annotations

import json
import sys
import time

from common import (against_baseline, check_real_shapes, cleanup, environment, make_real, make_root, paired, parser,
                    write_report)

COLUMNS = ["shape", "checkout", "ranks", "MB", "task s (best round)", "speed vs baseline", "op groups (modelled)"]


def _child(paths: list[str]) -> None:
    """Time the per-rank task of the ``tracefuse_dask`` on ``PYTHONPATH`` on each of ``paths``; a JSON line."""
    import inspect

    from tracefuse_dask import analysis
    from tracefuse_dask.model import DEFAULT_RANK_REGEX, InputFile

    extra: dict = {}
    if "devices" in inspect.signature(analysis._analyze_file).parameters:
        from tracefuse_dask.perf.devices import load_devices

        extra["devices"] = load_devices()

    def task(path: str, rank: int) -> dict:
        return analysis._analyze_file(InputFile(path, rank_hint=rank, hint_source="order"), None, None, None,
                                      DEFAULT_RANK_REGEX, False, **extra)

    for r, p in enumerate(paths):  # warm: imports, caches, the page cache
        task(p, r)
    t = time.perf_counter()
    results = [task(p, r) for r, p in enumerate(paths)]
    seconds = time.perf_counter() - t
    groups = modelled = 0
    for res in results:
        for rt in res["ranks"]:
            perf = rt.tables.get("op_perf")
            if perf is not None:
                groups += len(perf)
                modelled += int(perf["gflop"].notna().sum())
    print(json.dumps({"seconds": seconds, "groups": groups, "modelled": modelled}))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2:])
    ap = parser(__doc__)
    ap.add_argument("--shapes", default="a100,h100")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rank-mb", type=float, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", default="45604ca", help="the commit before the op performance models")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    check_real_shapes(shapes)
    root = make_root("tracefuse-opperf-", args.tmp_dir)
    lines = [environment(), "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    print("\n".join(lines), flush=True)
    try:
        for shape in shapes:
            _, paths, size = make_real(shape, root, args.ranks, args.rank_mb)
            runs = against_baseline(__file__, root, args.baseline, args.repeat, paths)
            base_times = [r["seconds"] for r in runs[f"baseline {args.baseline}"]]
            for name, got in runs.items():
                best = min(got, key=lambda r: r["seconds"])
                found = f"{best['groups']:,} ({best['modelled']:,})" if name == "this checkout" else "-"
                line = (f"| {shape} | {name} | {len(paths)} | {size / 1e6:.0f} | {best['seconds']:.2f} | "
                        f"{paired(base_times, [r['seconds'] for r in got])} | {found} |")
                lines.append(line)
                print(line, flush=True)
    finally:
        cleanup(root, args.keep)
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
