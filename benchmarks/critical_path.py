"""Benchmark what the critical path costs the analysis at scale: ``analyze`` of a generated job with a straggler,
at this checkout and at ``--baseline`` (a commit before the critical path), side by side.

Usage: ``python benchmarks/critical_path.py [--ranks 512] [--rank-kb 200] [--straggler 37] [--repeat 3]
[--baseline 8b80d9e]``

The job is ``tracefuse example --ranks N --straggler R`` with ranks of ``--rank-kb`` kB (gzip). Each run is a
process of its own with ``PYTHONPATH`` on one checkout (the baseline in a temporary ``git worktree``): it starts a
2-worker embedded cluster, untimed, then times ``analyze`` on it, with the peak RSS of its process tree and of the
client process. The rounds alternate the two checkouts, so that the ratio of each round pairs runs that ran one
after the other. The rows say what each found: the straggler and, at this checkout, the length of the critical
path and the straggler's cause.

Takes about 6 minutes on 2 cores with the defaults.
"""
from __future__ import annotations

import json
import os
import sys
import time

from common import against_baseline, cleanup, environment, make_root, paired, parser, write_report

COLUMNS = ["checkout", "ranks", "MB", "analyze s", "speed vs baseline", "peak RSS MiB", "Δ peak RSS MiB",
           "client peak RSS MiB", "found"]


def _child(folder: str) -> None:
    """One timed ``analyze`` of ``folder`` with the ``tracefuse_dask`` of ``PYTHONPATH``; prints a JSON line."""
    from common import TreeRSS

    from tracefuse_dask import analyze
    from tracefuse_dask.cluster import connect

    with connect(workers=2) as c:
        c.run(lambda: None)  # the workers are up
        with TreeRSS() as mem:
            t = time.perf_counter()
            a = analyze(folder, client=c)
            seconds = time.perf_counter() - t
    s = a.summary
    found = f"straggler: rank {s['straggler']['rank']}"
    if "critical_path" in s:
        cause = s["straggler"].get("cause") or {}
        found += (f"; {len(a.critical_path):,} path segments over {len(s['critical_path'])} steps; cause: "
                  f"`{cause['top'][0]['name']}` +{cause['extra_us'] / 1e3:.1f} ms per step" if cause
                  else "; no cause")
    print(json.dumps({"seconds": seconds, "peak": mem.peak, "delta": mem.peak - mem.baseline,
                      "client": mem.self_peak, "found": found}))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2])
    ap = parser(__doc__)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--rank-kb", type=int, default=200)
    ap.add_argument("--straggler", type=int, default=37)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", default="8b80d9e", help="a commit before the critical path (default: 8b80d9e)")
    args = ap.parse_args()
    from tracefuse_dask.synth import write_example

    root = make_root("tracefuse-cp-", args.tmp_dir)
    lines = [environment(), "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    print("\n".join(lines), flush=True)
    try:
        folder = os.path.join(root, "job")
        paths = write_example(folder, ranks=args.ranks, rank_bytes=args.rank_kb * 1000, straggler=args.straggler)
        mb = sum(os.path.getsize(p) for p in paths) / 1e6
        runs = against_baseline(__file__, root, args.baseline, args.repeat, [folder])
        times = {name: [r["seconds"] for r in got] for name, got in runs.items()}
        base_times = times[f"baseline {args.baseline}"]
        for name, got in runs.items():
            best = min(got, key=lambda r: r["seconds"])
            line = (f"| {name} | {args.ranks} | {mb:.1f} gz | {best['seconds']:.2f} | "
                    f"{paired(base_times, times[name])} | "
                    f"{max(r['peak'] for r in got) / 2**20:,.0f} | {max(r['delta'] for r in got) / 2**20:,.0f} | "
                    f"{max(r['client'] for r in got) / 2**20:,.0f} | {best['found']} |")
            lines.append(line)
            print(line, flush=True)
    finally:
        cleanup(root, args.keep)
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
