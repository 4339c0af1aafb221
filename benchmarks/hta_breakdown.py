"""Time HolisticTraceAnalysis's temporal breakdown of one trace folder; ``benchmarks/analyze.py`` and
``benchmarks/merge.py`` run it.

Usage: ``HTA_DISABLE_NS_ROUNDING=1 /work/hta-venv/bin/python benchmarks/hta_breakdown.py FOLDER [RANKS_JSON]``

``RANKS_JSON``, a ``{rank: file}`` object, is handed to HTA as ``trace_files``: then HTA loads those files as
those ranks, instead of finding each file's rank with its regex over the file's start (which misses a
``distributedInfo`` written after the events, as in the h100 shape, and loads every such file as rank 0).

Runs with the python of a venv that has HTA (``python3 -m venv /work/hta-venv &&
/work/hta-venv/bin/pip install HolisticTraceAnalysis==0.5.0``); it imports HTA and the standard library only.
Prints one JSON line: the seconds of the imports, of ``TraceAnalysis(trace_files=RANKS, trace_dir=FOLDER,
include_last_profiler_step=True)`` and of ``get_temporal_breakdown(visualize=False)``, HTA's row per rank, and
the RSS of this process and its descendants (HTA's fork pool), summed, sampled every 25 ms from /proc: just
before the load (baseline) and at its peak.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass  # it exited
    return out


def _rss(pid: int) -> int:
    """RSS in bytes, summed over ``pid`` and its descendants."""
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except OSError:
            pass  # it exited
    return total


class TreeRSS:
    """Peak summed RSS of this process and its descendants while the ``with`` block runs."""

    def __init__(self, interval: float = 0.025) -> None:
        self.interval, self.pid = interval, os.getpid()
        self.baseline = self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss(self.pid))

    def __enter__(self) -> TreeRSS:
        gc.collect()
        self.baseline = self.peak = _rss(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss(self.pid))


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        sys.exit(__doc__)
    if os.environ.get("HTA_DISABLE_NS_ROUNDING") != "1":
        sys.exit("set HTA_DISABLE_NS_ROUNDING=1: without it HTA rounds timestamps to whole µs")
    folder = argv[0]
    t = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis

    imports = time.perf_counter() - t
    with TreeRSS() as mem:
        t = time.perf_counter()
        files = {int(r): p for r, p in json.loads(argv[1]).items()} if len(argv) == 2 else None
        analysis = TraceAnalysis(trace_files=files, trace_dir=folder, include_last_profiler_step=True)
        loaded = time.perf_counter()
        df = analysis.get_temporal_breakdown(visualize=False)
        done = time.perf_counter()
    rows = {str(int(r["rank"])): {k: float(v) for k, v in r.items() if k != "rank"} for r in df.to_dict("records")}
    print(json.dumps({"imports_s": imports, "load_s": loaded - t,
                      "breakdown_s": done - loaded, "seconds": done - t, "ranks": rows,
                      "rss_baseline": mem.baseline, "rss_peak": mem.peak}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
