"""What HolisticTraceAnalysis's kernel-launch statistics and trace counters measure, per rank: each launch's delay,
the queue of outstanding work on each stream and the bandwidth of memory copies and sets
(``hta/analyzers/cuda_kernel_analysis.py``, ``trace_counters.py``, HTA 0.5.0). Pure functions on one rank's
arrays, no IO: the analysis's map task returns small tables, not the per-launch and per-sample series; the series
(``counter_series``) are the counter tracks of a merged trace.

- **Launches** (``cuda_kernel_launch_stats``): each device event whose launch is a kernel, copy or set launch
  (``vocabulary.LAUNCH_CALLS``: HTA's CUDA names, and the ROCm ones HTA 0.5.0 does not count), with the call's
  CPU duration, the event's GPU duration and the launch delay (the event's start less the call's end, at least
  0). A short kernel runs for less than its launch's CPU time (which is at most ``runtime_cutoff``); a runtime
  outlier's call takes more than ``runtime_cutoff`` µs, a launch-delay outlier waits more than
  ``launch_delay_cutoff`` µs.
- **Queue length** (``get_queue_length_time_series``): per stream, +1 when a launch call (``QUEUE_CALLS``, HTA's
  list, ROCm's included) starts and -1 when its device event starts; a sample at each change. The summary is
  over the samples, as HTA's ``describe()`` is; the time at the stream's maximum and at a full queue
  (``max_queue_length``, CUDA's 1024: ``get_time_spent_blocked_on_full_queue``) and the time-weighted mean are
  over the time between samples.
- **Memory bandwidth** (``get_memory_bw_time_series``): per kind (``Memcpy HtoD``, ``Memcpy DtoH``, ``Memcpy
  DtoD``, ``Memset``, ...), the sum of the bandwidths (``args["memory bandwidth (GB/s)"]``) of the copies
  running, a sample at each start and end (a 0 µs copy lasts 1 µs, as HTA has it); the summary is over the
  samples above 0 (a kind without any has no row).

Where samples share a time, HTA's order is pandas' unstable sort of its frame; here a start comes before an end
at one time for the queue (the call is made before its kernel runs), and an end before a start for the bandwidth
(back-to-back copies do not add up), so that the series are deterministic.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from ..schema import Cutoffs

__all__ = ["LAUNCH_COLUMNS", "MEMORY_COLUMNS", "QUEUE_COLUMNS", "WORST_COLUMNS", "counter_series", "launch_stats",
           "memory_bw", "memory_kind", "queue_length"]

LAUNCH_COLUMNS = ["launches", "short_kernels", "runtime_outliers", "launch_delay_outliers",
                  "median_launch_delay_us", "mean_launch_delay_us", "p95_launch_delay_us", "max_launch_delay_us",
                  "median_runtime_us", "p95_runtime_us", "max_runtime_us"]
WORST_COLUMNS = ["kernel", "call", "op", "launch_delay_us", "runtime_us", "kernel_us", "at_us"]
QUEUE_COLUMNS = ["stream", "samples", "mean", "max", "time_at_max_us", "time_full_us", "weighted_mean"]
MEMORY_COLUMNS = ["kind", "samples", "mean_gbps", "max_gbps"]
WORST = 10  # the longest launch delays kept per rank, with their kernels and ops


def launch_stats(call_start: np.ndarray, call_end: np.ndarray, gpu_start: np.ndarray, gpu_end: np.ndarray,
                 described: Callable[[np.ndarray], tuple[np.ndarray, ...]],
                 cutoffs: Cutoffs) -> tuple[dict[str, Any], pd.DataFrame]:
    """The rank's ``LAUNCH_COLUMNS`` row and its ``WORST`` longest launch delays (``WORST_COLUMNS``); the reduce
    adds the ``rank`` column.

    Parameters
    ----------
    call_start, call_end, gpu_start, gpu_end
        Per launched device event (kernel, copy, set) whose call is a launch: its call's and its own times (ns).
    described
        For the positions of some of them: their names, their calls' names and the ops that made the calls ("" when
        none), asked for the ``WORST`` only.
    """
    cpu_us = (call_end - call_start) / 1e3
    gpu_us = (gpu_end - gpu_start) / 1e3
    delay_us = np.maximum(gpu_start - call_end, 0) / 1e3
    row: dict[str, Any] = {"launches": len(delay_us),
                           "short_kernels": int(((cpu_us <= cutoffs.runtime_us) & (gpu_us < cpu_us)).sum()),
                           "runtime_outliers": int((cpu_us > cutoffs.runtime_us).sum()),
                           "launch_delay_outliers": int((delay_us > cutoffs.launch_delay_us).sum())}
    for what, values in (("launch_delay", delay_us), ("runtime", cpu_us)):
        stats = {"median": np.median, "mean": np.mean, "p95": lambda v: np.percentile(v, 95), "max": np.max}
        for stat, fn in stats.items():
            if f"{stat}_{what}_us" in LAUNCH_COLUMNS:
                row[f"{stat}_{what}_us"] = float(fn(values)) if len(values) else float("nan")
    worst = np.lexsort((gpu_start, -delay_us))[:WORST]  # the longest first, the earliest of equal ones
    kernels, calls, ops = described(worst)
    table = pd.DataFrame({"kernel": kernels, "call": calls, "op": ops,
                          "launch_delay_us": delay_us[worst], "runtime_us": cpu_us[worst],
                          "kernel_us": gpu_us[worst], "at_us": gpu_start[worst] / 1e3}, columns=WORST_COLUMNS)
    return row, table


def _steps(t: np.ndarray, delta: np.ndarray, group: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, ...]:
    """A step function per group: changes ``delta`` at times ``t``, ordered by (group, time, ``first`` before the
    rest). Returns the rows' groups and times in that order, the value after each change (``value``), how long
    that value lasts (``dur``, NaN for a group's last) and where each group's rows begin."""
    order = np.lexsort((~first, t, group))
    g, tt, d = group[order], t[order], delta[order]
    head = np.flatnonzero(np.concatenate([[True], g[1:] != g[:-1]]))
    if d.dtype.kind == "i":  # counts: a running sum, exact, restarted at each group
        total = np.cumsum(d)
        value = total - np.repeat(total[head] - d[head], np.diff(np.append(head, len(d))))
    else:  # bandwidths: pandas' running sum, compensated (Kahan), as HTA's values are
        value = pd.Series(d).groupby(g, sort=False).cumsum().to_numpy()
    later = np.full(len(tt), np.nan)
    later[:-1] = tt[1:]
    later[head[1:] - 1] = np.nan
    return g, tt, value, later - tt, head


def _groups(head: np.ndarray, n: int) -> list[slice]:
    """Each group's rows (``_steps``' ``head``, over ``n`` rows)."""
    return [slice(int(a), int(b)) for a, b in zip(head, np.append(head[1:], n))]


def _queue(call_start: np.ndarray, gpu_start: np.ndarray, stream: np.ndarray) -> tuple[Any, ...]:
    """The streams, and the queue's step function on each (``_steps``, the stream's code its group): +1 at each
    call's start, -1 at its device event's (``queue_length``'s parameters)."""
    n = len(call_start)
    code, streams = pd.factorize(pd.Series(stream, dtype=object), sort=True)
    return streams, *_steps(np.concatenate([call_start, gpu_start]), np.repeat([1, -1], n),
                            np.concatenate([code, code]), np.repeat([True, False], n))


def queue_length(call_start: np.ndarray, gpu_start: np.ndarray, stream: np.ndarray, cutoffs: Cutoffs) -> pd.DataFrame:
    """Per stream, the ``QUEUE_COLUMNS`` row.

    Parameters
    ----------
    call_start, gpu_start, stream
        Per device event whose call is a queue launch (``QUEUE_CALLS``): its call's start, its own start (ns), and
        its stream (as the trace names it).
    """
    if not len(call_start):
        return pd.DataFrame(columns=QUEUE_COLUMNS)
    streams, group, _, values, durs, head = _queue(call_start, gpu_start, stream)
    rows = []
    for rows_of in _groups(head, len(group)):
        value, dur = values[rows_of], durs[rows_of]
        top = int(value.max())
        timed = ~np.isnan(dur)
        span = float(dur[timed].sum())
        rows.append({"stream": streams[group[rows_of.start]], "samples": len(value), "mean": float(value.mean()), "max": top,
                     "time_at_max_us": float(dur[timed & (value == top)].sum()) / 1e3,
                     "time_full_us": float(dur[timed & (value >= cutoffs.max_queue_length)].sum()) / 1e3,
                     "weighted_mean": float((value[timed] * dur[timed]).sum() / span) if span else float("nan")})
    return pd.DataFrame(rows, columns=QUEUE_COLUMNS)


def memory_kind(name: str) -> str:
    """HTA's kind of a copy or set by its name (``get_memory_kernel_type``): ``Memset``, else the first 11
    characters of a ``Memcpy`` (``Memcpy HtoD``), else ``Memcpy Unknown``."""
    if name.startswith("Memset"):
        return "Memset"
    return name[:11] if name.startswith("Memcpy") else "Memcpy Unknown"


def _bandwidth(start: np.ndarray, end: np.ndarray, kinds: np.ndarray, gbps: np.ndarray) -> tuple[Any, ...]:
    """The kinds, and the bandwidth's step function of each (``_steps``, the kind's code its group): its copies'
    bandwidths added at their starts and taken away at their ends (``memory_bw``'s parameters)."""
    n = len(start)
    end = np.where(end > start, end, start + 1000)  # a 0 µs copy lasts 1 µs
    code, names = pd.factorize(pd.Series(kinds, dtype=object), sort=True)
    return names, *_steps(np.concatenate([start, end]), np.concatenate([gbps, -gbps]), np.concatenate([code, code]),
                          np.repeat([False, True], n))


def memory_bw(start: np.ndarray, end: np.ndarray, kinds: np.ndarray, gbps: np.ndarray) -> pd.DataFrame:
    """Per kind, the ``MEMORY_COLUMNS`` row.

    Parameters
    ----------
    start, end, kinds, gbps
        Per copy or set: its times (ns), its ``memory_kind`` and its bandwidth (NaN when the trace gives none).
    """
    if not len(start):
        return pd.DataFrame(columns=MEMORY_COLUMNS)
    names, group, _, values, _, head = _bandwidth(start, end, kinds, gbps)
    rows = []
    for rows_of in _groups(head, len(group)):
        v = values[rows_of]
        v = v[v > 0]
        if len(v):  # a kind whose copies give no bandwidth has no row, as in HTA's summary
            rows.append({"kind": names[group[rows_of.start]], "samples": len(v), "mean_gbps": float(v.mean()),
                         "max_gbps": float(v.max())})
    return pd.DataFrame(rows, columns=MEMORY_COLUMNS)


def counter_series(call_start: np.ndarray, gpu_start: np.ndarray, stream: list[Any], start: np.ndarray,
                   end: np.ndarray, names: list[str], gbps: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One device's queue-length series (``stream``, ``t`` in ns, ``value``) and memory-bandwidth series (``kind``,
    ``t`` in ns, ``value`` in GB/s): the counter tracks of ``merge --counters``. The merge hands in its kept events'
    arrays and gets the step functions ``queue_length`` and ``memory_bw`` sum up, so that the tracks and the tables
    agree.

    Parameters
    ----------
    call_start, gpu_start, stream
        As for ``queue_length``.
    start, end, names, gbps
        Per copy or set: its times (ns), its name (``memory_kind`` gives its kind) and its bandwidth (NaN when
        the trace gives none).
    """
    queue, memory = pd.DataFrame(columns=["stream", "t", "value"]), pd.DataFrame(columns=["kind", "t", "value"])
    if len(call_start):
        streams, group, t, value, _, _ = _queue(call_start, gpu_start, np.asarray(stream, dtype=object))
        queue = pd.DataFrame({"stream": streams[group], "t": t, "value": value})
    if len(start):
        kinds, group, t, value, _, _ = _bandwidth(start, end, np.array([memory_kind(n) for n in names],
                                                                        dtype=object), gbps)
        memory = pd.DataFrame({"kind": kinds[group], "t": t, "value": value})
    return queue, memory
