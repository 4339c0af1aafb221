"""Benchmark tracefuse_dask.analyze against HolisticTraceAnalysis's temporal breakdown, on the same files.

Usage: ``python benchmarks/analyze.py [--ranks 8] [--rank-mb 20] [--shapes a100,h100,b200] [--real FOLDER]
[--repeat 5] [--hta-python PY]``

``tracefuse_dask.analyze`` on a pre-started cluster against HTA's ``TraceAnalysis`` + ``get_temporal_breakdown``
(``benchmarks/hta_breakdown.py``, run with the python of a venv that has HTA, ``--hta-python``), on a synthetic
dataset (``--ranks`` × ``--rank-mb``), on datasets of the same size built from real traces (``--shapes``, by
``../shared/tools/make_dataset.py``, as ``benchmarks/merge.py`` builds them) and on a folder of real traces as they
are (``--real``): each one's time and memory, and whether they agree (per rank, GPU span, idle and computation
time within 1 %).
HTA 0.5.0 with pandas 3 fails (``TypeError: Invalid value ... for dtype 'int16'``) on a rank whose correlation ids
are all below 32768 while it has more events than that, as the synthetic ranks of 20 MB do; with pandas 2.2.3 it
only warns, so give ``--hta-python`` a venv with ``HolisticTraceAnalysis==0.5.0 pandas==2.2.3 numpy==2.2.6``.

A second table times the whole process as a user runs it, on the same datasets: ``tracefuse analyze FOLDER -o
OUT`` with its default outputs (every table, ``report.html``, ``summary.json``; its imports, its embedded cluster's
start and stop) against the HTA script's process, each from its start to its exit, with the CPU it used (its
children's included) and its peak memory.

Each dataset runs ``--repeat`` rounds, tracefuse then HTA in each, and the speedup is the median (range) of the
rounds' own ratios, so that a slow or fast spell of the machine cancels out. ``--ranks 8 --rank-mb 50 --shapes
a100,h100 --repeat 3`` took 33 minutes on 2 cores (both tables, the datasets built; HTA takes 20-45 s a round on
8 × 50 MB).
"""
from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
import traceback
from typing import Any

from common import (
    HTA_PYTHON,
    HTA_SETUP,
    MB,
    REAL_SHAPES,
    SHARED,
    Table,
    TimedProcess,
    TreeRSS,
    at_least_one,
    check_real_shapes,
    chunks,
    cleanup,
    environment,
    hta_versions,
    kineto_rank,
    make_real,
    make_root,
    paired,
    parser,
    run_hta,
    write_report,
)

from tracefuse_dask.synth import write_example

REAL_TRACES = os.path.join(SHARED, "traces", "real", "hta_trace_filter")
# per rank, tracefuse's breakdown column -> HTA's temporal breakdown column
AGREE = {"gpu_span_us": "kernel_time(us)", "idle_us": "idle_time(us)", "computation_us": "compute_time(us)"}
ANALYZE_COLUMNS = ["dataset", "ranks", "MB", "tracefuse s", "HTA s", "speedup", "tracefuse Δ peak RSS MiB",
                   "HTA Δ peak RSS MiB", "tracefuse peak RSS MiB", "HTA peak RSS MiB", "agree", "note"]
WHOLE_COLUMNS = ["dataset", "ranks", "MB", "tracefuse s", "tracefuse CPU", "HTA s", "HTA CPU", "speedup",
                 "tracefuse peak RSS MiB", "HTA peak RSS MiB", "agree", "note"]


def _kineto_rank(path: str) -> None:
    """Rewrite a ``write_example`` file with its rank as Kineto writes it (``kineto_rank``)."""
    with gzip.open(path, "rb") as f:
        data = kineto_rank(f.read())
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=6, mtime=0))


def make_analyze_dataset(pool: Any, root: str, ranks: int, rank_mb: float) -> str:
    """A folder of ``write_example`` ``.json.gz`` files and nothing else (HTA reads every .json/.gz file in it)."""
    folder = os.path.join(root, f"analyze_{ranks}x{rank_mb:g}MB")
    pool.map(_kineto_rank, write_example(folder, ranks=ranks, rank_bytes=int(rank_mb * MB)), chunksize=1)
    return folder


def folder_sizes(folder: str) -> tuple[int, int]:
    """(uncompressed bytes, file bytes) of the ``.json`` and ``.json.gz`` files in ``folder``."""
    raw = packed = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".json.gz"):
            with gzip.open(path, "rb") as f:
                raw += sum(len(c) for c in chunks(f))
        elif name.endswith(".json"):
            raw += os.path.getsize(path)
        else:
            continue
        packed += os.path.getsize(path)
    return raw, packed


def agreement(breakdown: Any, hta_ranks: dict[str, dict[str, float]]) -> tuple[bool, str]:
    """Whether HTA has the same ranks and, per rank, every pair of ``AGREE`` is within 1 %; and the largest gap."""
    ours = breakdown.set_index("rank")
    if set(map(int, hta_ranks)) != set(ours.index):
        return False, f"HTA loaded ranks {sorted(map(int, hta_ranks))}, tracefuse {sorted(ours.index)}"
    worst, where = 0.0, ""
    for rank, row in hta_ranks.items():
        for col, hta_col in AGREE.items():
            a, b = float(ours.loc[int(rank), col]), row[hta_col]
            gap = 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))
            if not gap <= worst:  # NaN too
                worst, where = gap, f"rank {rank} {col} {a:,.1f} vs {hta_col} {b:,.1f}"
    gap_text = f"largest gap {100 * worst:.2g} %" + (f", {where}" if where else "")
    return worst <= 0.01, gap_text


def _warm_analyze() -> None:
    import tracefuse_dask.analysis  # noqa: F401


def analyze_row(args: argparse.Namespace, client: Any, name: str, folder: str, hta: bool) -> tuple[str, bool]:
    """Measure tracefuse and HTA on ``folder``; the table row, and whether both ran and agree."""
    from tracefuse_dask import analyze

    raw, packed = folder_sizes(folder)
    dataset = f"{name} ({packed / MB:.{0 if packed >= 10 * MB else 1}f} MB gz)" if packed < raw else name

    def cells(ranks: str, tf: list[str], ht: list[str], speedup: str, agree: str, note: str) -> str:
        mb = f"{raw / MB:.{0 if raw >= 10 * MB else 1}f}"
        return "| " + " | ".join([dataset, ranks, mb, tf[0], ht[0], speedup, tf[1], ht[1], tf[2], ht[2], agree,
                                  note]) + " |"

    none = ["–"] * 3
    times: list[float] = []
    runs: list[dict[str, Any]] = []
    mem = analysis = None
    failed = None if hta else f"HTA skipped: no HTA at {args.hta_python}"
    for _ in range(args.repeat):  # the rows alternate, so that a round's two times can be compared (``paired``)
        os.sync()
        try:
            with TreeRSS() as m:
                t = time.perf_counter()
                analysis = analyze(folder, client=client)
                times.append(time.perf_counter() - t)
        except Exception as e:
            traceback.print_exc()
            return cells("–", none, none, "–", "–", f"FAILED: tracefuse: {type(e).__name__}: {e}"), False
        if mem is None or m.peak - m.baseline > mem.peak - mem.baseline:
            mem = m
        if failed is None:
            try:
                # the files as the ranks tracefuse found, so that both analyse the same ranks
                runs.append(run_hta(args.hta_python, folder, files=dict(zip(analysis.summary["ranks"],
                                                                            analysis.summary["inputs"]))))
            except (RuntimeError, ValueError) as e:
                failed = f"FAILED: HTA: {e}"
    seconds = min(times)
    tf = [f"{seconds:.2f}", f"{(mem.peak - mem.baseline) / 2**20:,.0f}", f"{mem.peak / 2**20:,.0f}"]
    ranks = str(len(analysis.breakdown))
    if failed is not None:
        return cells(ranks, tf, none, "–", "–", failed), not hta
    best = min(runs, key=lambda r: r["seconds"])
    hmem = max(runs, key=lambda r: r["rss_peak"] - r["rss_baseline"])
    ht = [f"{best['seconds']:.2f}", f"{(hmem['rss_peak'] - hmem['rss_baseline']) / 2**20:,.0f}",
          f"{hmem['rss_peak'] / 2**20:,.0f}"]
    ok, gap = agreement(analysis.breakdown, best["ranks"])
    note = (f"HTA: load {best['load_s']:.2f} s + breakdown {best['breakdown_s']:.2f} s (imports "
            f"{best['imports_s']:.2f} s, not counted); {gap}")
    speedup = paired([r["seconds"] for r in runs], times)
    return cells(ranks, tf, ht, speedup, "yes" if ok else "no", note), ok


WHOLE_HEADER = (
    "The whole process, as a user runs it: `tracefuse analyze FOLDER -o OUT --force -q` (its default outputs: every "
    "table, report.html and summary.json; the embedded cluster it starts and stops) against HTA's script, each a "
    "fresh process timed from its start to its exit (imports included). CPU = the CPU seconds of the process and "
    "the children it waited for (worker programs, HTA's fork pool) over its wall seconds, of its best round; peak "
    "RSS = its process tree's, the largest of the rounds. The two alternate in each round; speedup = the median "
    "(range) of the rounds' HTA s / tracefuse s; agree as above, from the report folder's breakdown.parquet.")


def whole_process_row(args: argparse.Namespace, name: str, folder: str, out: str, hta: bool) -> tuple[str, bool]:
    """``tracefuse analyze FOLDER -o OUT`` (its default outputs: every table, ``report.html``, ``summary.json``) and
    HTA's script, each a fresh process timed from its start to its exit, as a user runs them: the table row, and
    whether both ran and agree."""
    import pandas as pd

    raw, _ = folder_sizes(folder)
    cells = {"dataset": name, "MB": f"{raw / MB:.{0 if raw >= 10 * MB else 1}f}"}

    def line() -> str:
        return "| " + " | ".join(cells.get(c, "–") for c in WHOLE_COLUMNS) + " |"

    command = [os.path.join(os.path.dirname(sys.executable), "tracefuse"), "analyze", folder, "-o", out, "--force",
               "-q"]
    tf: list[TimedProcess] = []
    ht: list[TimedProcess] = []
    failed = None if hta else f"HTA skipped: no HTA at {args.hta_python}"
    report: dict[str, Any] = {}
    for _ in range(args.repeat):  # alternated, as in ``analyze_row``
        os.sync()
        tf.append(TimedProcess())
        proc = tf[-1](command, capture_output=True, text=True)
        if proc.returncode:
            cells["note"] = f"FAILED: tracefuse analyze: {' '.join(proc.stderr.split())[-300:]}"
            return line(), False
        if failed is None:
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
            ht.append(TimedProcess())
            try:
                report = run_hta(args.hta_python, folder, files=dict(zip(summary["ranks"], summary["inputs"])),
                                 run=ht[-1])
            except (RuntimeError, ValueError) as e:
                failed = f"FAILED: HTA: {e}"

    def fmt(runs: list[TimedProcess]) -> list[str]:
        best = min(runs, key=lambda r: r.seconds)
        mem = max(r.mem.peak - r.mem.baseline for r in runs)
        return [f"{best.seconds:.2f}", f"{100 * best.cpu / best.seconds:.0f}%", f"{mem / 2**20:,.0f}"]

    breakdown = pd.read_parquet(os.path.join(out, "breakdown.parquet"))
    cells["ranks"] = str(len(breakdown))
    cells["tracefuse s"], cells["tracefuse CPU"], cells["tracefuse peak RSS MiB"] = fmt(tf)
    ok = failed is None
    if failed is None:
        cells["HTA s"], cells["HTA CPU"], cells["HTA peak RSS MiB"] = fmt(ht)
        cells["speedup"] = paired([r.seconds for r in ht], [r.seconds for r in tf])
        ok, gap = agreement(breakdown, report["ranks"])
        cells["agree"], cells["note"] = "yes" if ok else "no", gap
    else:
        cells["note"] = failed
    return line(), ok or not hta


def main(argv: list[str] | None = None) -> int:
    """The analysis benchmark: one row per dataset; 1 if a row failed or disagrees."""
    ap = parser(__doc__)
    ap.add_argument("--ranks", type=int, default=8, help="ranks of the synthetic dataset (default 8)")
    ap.add_argument("--rank-mb", type=float, default=20,
                    help="uncompressed MB per rank of the synthetic dataset (default 20)")
    ap.add_argument("--shapes", default="",
                    help=f"real shapes to build, --ranks × --rank-mb each, from {', '.join(REAL_SHAPES)} "
                         "(comma-separated; default none)")
    ap.add_argument("--real", default=REAL_TRACES,
                    help=f"a folder of real per-rank traces, skipped if missing (default {REAL_TRACES})")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the cluster (default 2)")
    ap.add_argument("--repeat", type=at_least_one, default=5,
                    help="rounds per dataset, each a run of tracefuse then one of HTA; times are each one's best, "
                         "the speedup the median (range) of the rounds' own ratios (default 5)")
    ap.add_argument("--hta-python", default=HTA_PYTHON,
                    help=f"python of a venv with HolisticTraceAnalysis 0.5.0 (default {HTA_PYTHON}); without it "
                         f"the HTA columns are skipped. Set it up: {HTA_SETUP}")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    if unknown := set(shapes) - set(REAL_SHAPES):
        ap.error(f"unknown shape(s) {', '.join(sorted(unknown))}; choose from {', '.join(REAL_SHAPES)}")
    check_real_shapes(shapes)
    import pandas as pd

    from tracefuse_dask.cluster import connect

    hta = hta_versions(args.hta_python)
    ctx = multiprocessing.get_context("spawn")
    header = environment() + (
        f"Analysis benchmark: `tracefuse_dask.analyze(folder, client=...)` on the embedded cluster of "
        f"{args.workers} worker programs (`cluster.connect`, 1 thread each, pandas {pd.__version__}; started, "
        f"and its workers' imports done, before any row), seconds = from the call to its return; against "
        f"{hta or 'HolisticTraceAnalysis'} in a separate process of "
        f"`{args.hta_python}` (`benchmarks/hta_breakdown.py`): `TraceAnalysis(trace_files={{rank: file}}, "
        f"include_last_profiler_step=True)` with the ranks and files tracefuse found + `get_temporal_breakdown(visualize=False)` with "
        f"HTA_DISABLE_NS_ROUNDING=1, timed inside that process (load + breakdown; its imports are in the note, "
        f"not counted); HTA parses with a fork pool of min(CPUs, ranks) processes. The two alternate in each "
        f"of {args.repeat} rounds; s = each one's best; speedup = the median (range) of the rounds' HTA s / "
        f"tracefuse s. "
        f"RSS: tracefuse summed over this process tree (the benchmark with the scheduler and client, and the "
        f"workers), HTA over its process and its pool, both sampled every 25 ms; Δ = peak above the tree just "
        f"before the call. HTA's pool processes are forked from its process, and RSS counts the pages they still "
        f"share with it in each of them (HTA peak − Δ = its RSS before the load, after its imports). "
        f"agree = HTA loads the same ranks and, per rank, "
        f"tracefuse's {', '.join(f'{a} vs HTA {b}' for a, b in AGREE.items())} are within 1 %. "
        f"The synthetic files are `synth.write_example` .json.gz files (gzip -6), with `\"rank\": N` spaced as "
        f"Kineto writes it so that HTA's rank regex finds it; the real shapes are plain .json files that "
        f"`make_dataset.py` builds from one real trace in its own layout; MB = uncompressed.\n")
    print(header, flush=True)
    if hta is None:
        print(f"The HTA columns are skipped: {args.hta_python} cannot import HolisticTraceAnalysis. Set it up with "
              f"`{HTA_SETUP}`, or pass --hta-python PATH.\n", flush=True)
    table, ok = Table(ANALYZE_COLUMNS), True
    root = make_root("tracefuse-bench-", args.tmp_dir)
    try:
        with ctx.Pool(args.workers) as pool:
            t = time.perf_counter()
            datasets = [(f"synthetic {args.ranks}×{args.rank_mb:g} MB",
                         make_analyze_dataset(pool, root, args.ranks, args.rank_mb))]
            print(f"generated {args.ranks} ranks × {args.rank_mb:g} MB in "
                  f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        for shape in shapes:
            datasets.append((f"{shape} {args.ranks}×{args.rank_mb:g} MB",
                             make_real(shape, root, args.ranks, args.rank_mb)[0]))
        if os.path.isdir(args.real):
            datasets.append((f"real {os.path.basename(os.path.normpath(args.real))}", args.real))
        else:
            print(f"skipped the real dataset: {args.real} is missing", file=sys.stderr, flush=True)
        with connect(workers=args.workers) as client:
            client.run(_warm_analyze)
            _warm_analyze()
            print("\n".join(table.lines), flush=True)
            for name, folder in datasets:
                line, row_ok = analyze_row(args, client, name, folder, hta is not None)
                table.emit(line)
                ok = ok and row_ok
        print(f"\n{WHOLE_HEADER}\n", flush=True)
        whole = Table(WHOLE_COLUMNS)
        print("\n".join(whole.lines), flush=True)
        for name, folder in datasets:
            line, row_ok = whole_process_row(args, name, folder, os.path.join(root, "report"), hta is not None)
            whole.emit(line)
            ok = ok and row_ok
    finally:
        cleanup(root, args.keep)
    write_report(args.out, [header, *table.lines, "", WHOLE_HEADER, "", *whole.lines])
    return 0 if ok else 1




if __name__ == "__main__":
    sys.exit(main())
