"""Benchmark tracefuse_dask.merge_traces against an orjson floor and a naive TraceLens-style merge.

Usage: ``python benchmarks/run.py [--ranks 8,32] [--rank-mb 20] [--workers 2] [--out report.md]``

Every row runs with the same number of worker processes. Memory is the summed RSS of the whole
process tree (this process, the Dask nanny and worker processes, pool workers), sampled every 25 ms.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import platform
import shlex
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import orjson
import psutil

from tracefuse_dask.synth import make_rank_trace

MB = 1_000_000


class TreeRSS:
    """Peak summed RSS of this process and all its descendants, while the ``with`` block runs."""

    def __init__(self, interval: float = 0.025) -> None:
        self.interval, self.proc = interval, psutil.Process()
        self.baseline = self.peak = 0
        self._stop = threading.Event()

    def sample(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> TreeRSS:
        gc.collect()
        self.baseline = self.peak = self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


def _write_rank(args: tuple[int, int, int, str]) -> int:
    rank, ranks, rank_bytes, path = args
    data = orjson.dumps(make_rank_trace(rank, ranks, target_bytes=rank_bytes, seed=0))
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def make_dataset(pool: Any, root: str, ranks: int, rank_mb: float) -> tuple[str, list[str], int]:
    folder = os.path.join(root, f"in_{ranks}x{rank_mb:g}MB")
    os.makedirs(folder)
    paths = [os.path.join(folder, f"rank{r}.pt.trace.json") for r in range(ranks)]
    sizes = pool.map(_write_rank, [(r, ranks, int(rank_mb * MB), p) for r, p in enumerate(paths)], chunksize=1)
    return folder, paths, sum(sizes)


def _floor_task(args: tuple[str, str, bool]) -> int:
    src, dst, gc_off = args
    if gc_off:
        gc.disable()
    try:
        with open(src, "rb") as f:
            data = orjson.dumps(orjson.loads(f.read()))
        with open(dst, "wb") as f:
            f.write(data)
        return len(data)
    finally:
        gc.enable()


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


def _hta_parse(folder: str) -> int:
    from hta.trace_analysis import TraceAnalysis

    TraceAnalysis(trace_dir=folder)
    return 0


def _child_entry(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - shipped to the parent
        conn.send((False, f"{type(e).__name__}: {e}"))


def in_child(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a fresh (non-daemon) process, so its memory is freed and it may start its own pool."""
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_entry, args=(send, fn, args))
    proc.start()
    ok, value = recv.recv()
    proc.join()
    if not ok:
        raise RuntimeError(value)
    return value


def measure(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, TreeRSS, Any]:
    """Best time of ``repeat`` runs, and the memory of the run with the highest peak."""
    best, worst_mem, result = math.inf, None, None
    for _ in range(repeat):
        with TreeRSS() as mem:
            t = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t)
        if worst_mem is None or mem.peak - mem.baseline > worst_mem.peak - worst_mem.baseline:
            worst_mem = mem
    assert worst_mem is not None
    return best, worst_mem, result


def _warm(_: int = 0) -> None:
    import tracefuse_dask.merge  # noqa: F401

    time.sleep(0.2)  # holds the task so that every pool process must be up


def fmt_row(name: str, dataset: str, bytes_in: int, seconds: float | None, mem: TreeRSS | None,
            floors: dict[str, float], out_bytes: int | None, note: str = "") -> str:
    if seconds is None or mem is None:
        return f"| {name} | {dataset} | – | – | – | – | – | – | – | {note} |"
    ratio = [f"{floors[k] / seconds:.2f}×" if k in floors else "–" for k in ("gc_on", "gc_off")]
    return (f"| {name} | {dataset} | {seconds:.2f} | {bytes_in / MB / seconds:.1f} | {ratio[0]} | {ratio[1]} | "
            f"{(mem.peak - mem.baseline) / 2**20:,.0f} | {mem.peak / 2**20:,.0f} | "
            f"{(out_bytes or 0) / MB:.1f} | {note} |")


class Table:
    """The Markdown rows of one run; each row is printed as soon as it is measured."""

    def __init__(self) -> None:
        self.lines = ["| row | dataset | s | MB/s | speed vs floor GC on | speed vs floor GC off | Δ peak RSS MiB | peak RSS MiB "
                      "| out MB | note |", "|---|---|---|---|---|---|---|---|---|---|"]

    def emit(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def row(self, label: str, dataset: str, size: int, floors: dict[str, float], fn: Callable[[], Any],
            repeat: int = 1, out_bytes: Callable[[Any], int] = lambda r: 0,
            note: Callable[[Any], str] = lambda r: "", floor: str | None = None) -> None:
        """Measure ``fn`` and add its row (as ``floors[floor]`` too); a failure becomes a FAILED row."""
        try:
            seconds, mem, result = measure(fn, repeat)
        except Exception as e:
            traceback.print_exc()
            self.emit(fmt_row(label, dataset, size, None, None, floors, None, f"FAILED: {type(e).__name__}: {e}"))
            return
        if floor:
            floors[floor] = seconds
        self.emit(fmt_row(label, dataset, size, seconds, mem, floors, out_bytes(result), note(result)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,32", help="comma-separated rank counts, one dataset each (default 8,32)")
    ap.add_argument("--rank-mb", type=float, default=20, help="uncompressed MB per rank (default 20)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes for every row (default 2)")
    ap.add_argument("--out", help="also write the Markdown report to this file")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive TraceLens-style merge")
    ap.add_argument("--include-pyfunc", action="store_true", help="merge with include_pyfunc=True")
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs per row (default 1; naive runs once)")
    ap.add_argument("--tmp-dir", help="where to put the datasets and outputs (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the datasets and outputs")
    args = ap.parse_args(argv)
    rank_counts = [int(x) for x in args.ranks.split(",") if x.strip()]

    import dask
    import distributed

    from tracefuse_dask import __version__, merge_traces

    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs a Dask client
    header = (f"Benchmark {datetime.datetime.now().isoformat(timespec='seconds')} · {platform.platform()} · "
              f"{os.cpu_count()} CPUs · {psutil.virtual_memory().total / 2**30:.0f} GiB · Python "
              f"{platform.python_version()} · tracefuse_dask {__version__}, dask {dask.__version__}, "
              f"distributed {distributed.__version__}, orjson {orjson.__version__}\n\n"
              f"Command: `{shlex.join([sys.executable, *sys.argv])}`\n\n"
              f"Every row uses {args.workers} worker processes. MB/s = uncompressed input MB / s. "
              f"RSS = summed over the process tree (benchmark + Dask nannies/workers + pool workers), "
              f"sampled every 25 ms; Δ = peak above the idle tree just before the row. "
              f"tracefuse drops python_function events unless --include-pyfunc "
              f"({'on' if args.include_pyfunc else 'off'} here).\n")
    print(header, flush=True)
    table = Table()
    root = tempfile.mkdtemp(prefix="tracefuse-bench-", dir=args.tmp_dir)
    try:
        datasets = []
        with ctx.Pool(args.workers) as pool:
            for n in rank_counts:
                t = time.perf_counter()
                datasets.append((n, *make_dataset(pool, root, n, args.rank_mb)))
                print(f"generated {n} ranks × {args.rank_mb:g} MB = {datasets[-1][3] / MB:.0f} MB in "
                      f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        with distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
                distributed.Client(cluster) as client, ctx.Pool(args.workers) as pool:
            pool.map(_warm, range(2 * args.workers), chunksize=1)
            client.run(_warm)
            print("\n".join(table.lines), flush=True)
            smallest = min(d[3] for d in datasets)
            for n, folder, paths, size in datasets:
                name, out_dir = f"{n}×{args.rank_mb:g} MB", os.path.join(root, f"out_{n}")
                os.makedirs(out_dir)
                floors: dict[str, float] = {}
                for key, gc_off in (("gc_on", False), ("gc_off", True)):
                    jobs = [(p, os.path.join(out_dir, f"floor_{key}_{r}.json"), gc_off) for r, p in enumerate(paths)]
                    table.row(f"orjson floor (GC {key[3:]})", name, size, floors,
                              lambda jobs=jobs: pool.map(_floor_task, jobs, chunksize=1), args.repeat, sum, floor=key)
                for ext in ("json", "json.gz"):
                    out = os.path.join(out_dir, f"merged.{ext}")
                    table.row(f"tracefuse merge → .{ext}", name, size, floors,
                              lambda out=out: merge_traces(folder, out, client=client, force=True,
                                                           include_pyfunc=args.include_pyfunc),
                              args.repeat, lambda r: r.bytes_out,
                              lambda r: f"{r.events_in:,} → {r.events_out:,} events")
                if importlib.util.find_spec("hta") is not None:
                    table.row("HTA TraceAnalysis (parse only)", name, size, floors,
                              lambda: in_child(ctx, _hta_parse, folder), args.repeat)
                if size == smallest and not args.no_naive:
                    out = os.path.join(out_dir, "naive.json.gz")
                    table.row("naive TraceLens-style (1 process)", name, size, floors,
                              lambda: in_child(ctx, _naive_merge, paths, out), 1, int,
                              lambda r: "json, indent=4, gzip -9")
                if not args.keep:
                    shutil.rmtree(out_dir)
    finally:
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n" + "\n".join(table.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
