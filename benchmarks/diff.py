"""Benchmark ``tracefuse diff`` at scale: two generated jobs of ``--ranks`` ranks (the second with a straggler),
diffed from their traces and from their ``analyze`` reports, next to ``analyze`` of one of them.

Usage: ``python benchmarks/diff.py [--ranks 512] [--rank-kb 200] [--straggler 37] [--repeat 2]``

All rows run on one 2-worker embedded cluster started first; each row's time is its best of ``--repeat``, with the
peak RSS of the process tree and of this (the client) process over its runs.

Takes about 4 minutes on 2 cores with the defaults.
"""
from __future__ import annotations

import os
import time

from common import TreeRSS, cleanup, environment, make_root, parser, write_report

COLUMNS = ["row", "ranks", "s", "peak RSS MiB", "Δ peak RSS MiB", "client peak RSS MiB", "verdict"]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--rank-kb", type=int, default=200)
    ap.add_argument("--straggler", type=int, default=37)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    from tracefuse_dask import analyze, diff
    from tracefuse_dask.cluster import connect
    from tracefuse_dask.synth import write_example

    root = make_root("tracefuse-diff-", args.tmp_dir)
    lines = [environment(), "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    print("\n".join(lines), flush=True)
    try:
        base, new = os.path.join(root, "base"), os.path.join(root, "new")
        write_example(base, ranks=args.ranks, rank_bytes=args.rank_kb * 1000, seed=1)
        write_example(new, ranks=args.ranks, rank_bytes=args.rank_kb * 1000, seed=1, straggler=args.straggler)
        with connect(workers=2) as c:
            c.run(lambda: None)
            rows = [
                ("analyze one job", lambda: analyze(new, os.path.join(root, "report-new"), client=c, force=True)),
                ("diff of the two jobs' traces", lambda: diff(base, new, os.path.join(root, "diff"), client=c,
                                                              force=True)),
            ]
            analyze(base, os.path.join(root, "report-base"), client=c, force=True)
            rows.append(("diff of their analyze reports", lambda: diff(
                os.path.join(root, "report-base"), os.path.join(root, "report-new"), os.path.join(root, "diff2"),
                client=c, force=True)))
            for label, fn in rows:
                best, peak, delta, client, got = float("inf"), 0, 0, 0, None
                for _ in range(args.repeat):
                    with TreeRSS() as mem:
                        t = time.perf_counter()
                        got = fn()
                        best = min(best, time.perf_counter() - t)
                    peak, delta = max(peak, mem.peak), max(delta, mem.peak - mem.baseline)
                    client = max(client, mem.self_peak)
                verdict = got.summary.get("verdict", "") if label.startswith("diff") else ""
                line = (f"| {label} | {args.ranks} | {best:.2f} | {peak / 2**20:,.0f} | {delta / 2**20:,.0f} | "
                        f"{client / 2**20:,.0f} | {verdict} |")
                lines.append(line)
                print(line, flush=True)
    finally:
        cleanup(root, args.keep)
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
