"""``analyze()``: its checks and inputs, the map of per-rank tasks (``tasks``), the tree of combine tasks, and the
client's reduce (``reduce``); the report folder (``folder``)."""
from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from functools import partial
from typing import Any

import pandas as pd

from ..cluster import batches, connect, gathered, let_go, progress_bar
from ..errors import MergeError
from ..kineto.document import paused_gc
from ..model import DEFAULT_RANK_REGEX, InputFile, parse_steps, rank_subset
from ..perf.devices import load_devices
from ..storage.inputs import expand_inputs
from . import FILE_COST
from .cross_rank.critical_path import walks_in
from .folder import check_new, unchanged_report, write_report
from .reduce import reduce_ranks
from .schema import Analysis, AnalyzeRequest, Cutoffs, StoredInput, StoreOutput
from .tasks import analyze_files, combine, segments_in, without_segments
from .transport import join_parts

__all__ = ["analyze"]

log = logging.getLogger(__name__)
_NAMES = re.compile(r"\.json(\.gz)?$|\.gz$|\.csv$|\.log(-\d+)?$|\.txt$", re.IGNORECASE)
_COMBINE = 64  # the results of this many tasks are joined by one reduce task on the cluster (fewer: by the client,
# which saves their results a hop: 0.4-0.5 s of 4.4-5.1 s for 8 ranks of 50 MB of the A100 shape)


def analyze(
    urlpath: str | Iterable[str] | Mapping[int, str] | StoredInput,
    out_dir: str | None = None,
    *,
    client: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    ranks: str | Iterable[int] | None = None,
    steps: str | tuple[int, int] | None = None,
    rank_regex: str = DEFAULT_RANK_REGEX,
    format: str = "parquet",
    force: bool = False,
    workers: int | None = None,
    scheduler: str | None = None,
    scheduler_file: str | None = None,
    timeout: float = 10.0,
    show_progress: bool = False,
    keep_unlaunched_gpu: bool = False,
    gpu_spec: str | None = None,
    cutoffs: Cutoffs | None = None,
    kernel_sequences: str | None = None,
    on_error: str = "raise",
    repair: bool = False,
    skip_if_unchanged: bool = False,
    store_output: StoreOutput | None = None,
) -> Analysis:
    """Analyse per-rank traces, one Dask task per file, and reduce the small per-rank tables.

    Parameters
    ----------
    urlpath
        A folder, a glob, a file, a list of those, or a ``{rank: path}`` dict; any fsspec URL.
        A trace merged by tracefuse is analysed per rank. Or an event store (``StoredInput``), whose parts are
        read instead of its traces.
    out_dir
        Write the report folder here: one file per table, ``summary.json`` and ``report.html``.
    client, workers, scheduler, scheduler_file, timeout
        Which Dask cluster runs the tasks, as in ``merge_traces``.
    storage_options
        fsspec options for inputs and output.
    ranks
        A subset: ``"0-63:8,100"`` or an iterable of ints.
    steps
        Only ``ProfilerStep#A`` to ``#B`` (``"A-B"``); GPU work follows its launch.
    rank_regex
        Regex with a named group ``rank``, for files without ``distributedInfo.rank``.
    format
        ``"parquet"`` or ``"csv"``.
    force
        Replace an existing report folder.
    show_progress
        Draw a progress bar on stderr.
    keep_unlaunched_gpu
        Keep the device work whose launch is not in the trace, which HTA leaves out when a rank has two or
        more ``ProfilerStep#N`` (work queued before the profiler started; see ``analysis.per_rank.rank._launched_only``).
        By default it is left out, as HTA does, and ``summary["gpu_events_left_out"]`` counts it.
    gpu_spec
        A JSON file of devices (as ``tracefuse_dask/perf/devices.json``) that add to or override the package's
        device table, for ``op_perf``'s roofline.
    cutoffs
        HTA's thresholds for the launch statistics and the queue length (``Cutoffs``: a runtime call over 50 µs,
        a launch delay over 100 µs, a stream at 1024 outstanding operations); None: those.
    kernel_sequences
        An operator (``"aten::linear"``) whose frequent kernel sequences to find on every rank, as HTA's
        ``get_frequent_cuda_kernel_sequences`` does on one: the ``kernel_sequences`` table and
        ``summary["kernel_sequences"]``.
    on_error
        ``"raise"`` (default) stops at the first bad rank; ``"skip"`` goes on without the ranks whose file is
        bad, missing or unreadable and lists them in ``summary["skipped"]`` (rank, path, reason), as
        ``merge_traces`` does.
    repair
        Recover the complete events of truncated files; ``summary["repaired"]`` says what was recovered.
    skip_if_unchanged
        Analyse nothing when the commit of the report folder ``out_dir`` shows the same inputs (size and etag or
        mtime), options and tool version as now: return the report as read back, with ``summary["status"]``
        ``"unchanged"``. Otherwise analyse, replacing the folder (``force``).
    store_output
        Also write each rank's part of an event store, in the map tasks (``StoreOutput``).

    Returns
    -------
    Analysis

    Examples
    --------
    >>> a = analyze("traces/", "report/")  # doctest: +SKIP
    >>> a.breakdown[["rank", "idle_us", "exposed_comm_us"]]  # doctest: +SKIP
    """
    started = time.perf_counter()
    request = _request(format, on_error, ranks, steps, storage_options, rank_regex, keep_unlaunched_gpu, gpu_spec,
                       cutoffs, kernel_sequences, repair,
                       urlpath.read_part if isinstance(urlpath, StoredInput) else None,
                       store_output.write_part if store_output is not None else None)
    so = request.storage_options
    if skip_if_unchanged and out_dir is None:
        raise MergeError("skip_if_unchanged compares with the report folder: give out_dir too")
    if out_dir is not None:
        check_new(out_dir, so, force or skip_if_unchanged)
    if isinstance(urlpath, StoredInput):
        files, ignored = [f for f in urlpath.files if request.subset is None or f.rank_hint in request.subset], \
            urlpath.ignored
    else:
        files, names = expand_inputs(urlpath, storage_options=storage_options, rank_regex=rank_regex, names=_NAMES,
                                     subset=request.subset)
        ignored = [f"{p}: not a trace or collective_trace file by name, or written by tracefuse" for p in names]
    made_from = {"inputs": [f.identity for f in files],
                 "options": {"ranks": ranks if ranks is None or isinstance(ranks, str)
                             else sorted(int(r) for r in request.subset),
                             "steps": request.steps, "rank_regex": rank_regex, "format": format,
                             "keep_unlaunched_gpu": keep_unlaunched_gpu,
                             "devices": hashlib.sha256(repr(request.devices).encode()).hexdigest(),
                             "cutoffs": asdict(request.cutoffs), "kernel_sequences": kernel_sequences,
                             "on_error": on_error, "repair": repair}}
    if skip_if_unchanged and (done := unchanged_report(out_dir, made_from, so)) is not None:
        return done
    with connect(client, scheduler=scheduler, scheduler_file=scheduler_file, workers=workers,
                 timeout=timeout, inputs=files, per_file=FILE_COST) as c:
        results, segments_of = _map(c, files, request, show_progress)
        if store_output is not None:
            store_output.parts.extend(p for r in results for p in r["parts"])
        with paused_gc():
            if segments_of is None:  # the segments are in the results: the rest needs no cluster
                if client is None:  # nor any other task: a caller's client may have more (diff's other run)
                    let_go(c)
                results = [combine(results)]
                segments_of = partial(walks_in, results[0]["tables"].pop("path_segments"))
            analysis = reduce_ranks(results, segments_of, ignored, request)
    analysis.summary["seconds"] = round(time.perf_counter() - started, 3)
    analysis.made_from = made_from
    if out_dir is not None:
        write_report(analysis, out_dir, so, format=format)
    return analysis


def _request(format: str, on_error: str, ranks: str | Iterable[int] | None, steps: str | tuple[int, int] | None,
             storage_options: Mapping[str, Any] | None, rank_regex: str, keep_unlaunched_gpu: bool,
             gpu_spec: str | None, cutoffs: Cutoffs | None, kernel_sequences: str | None, repair: bool,
             read_part: Callable[..., Any] | None, write_part: Callable[..., Any] | None) -> AnalyzeRequest:
    """``analyze``'s options checked, before any IO, as the request its tasks and its reduce read."""
    if format not in ("parquet", "csv"):
        raise MergeError(f"format={format!r}; use 'parquet' or 'csv'")
    if on_error not in ("raise", "skip"):
        raise MergeError(f"on_error={on_error!r}; use 'raise' or 'skip'")
    try:
        subset = rank_subset(ranks)
        step_range = parse_steps(steps) if isinstance(steps, str) else steps
    except ValueError as e:
        raise MergeError(str(e)) from None
    return AnalyzeRequest(storage_options=dict(storage_options or {}), steps=step_range, subset=subset,
                          rank_regex=rank_regex, keep_unlaunched_gpu=keep_unlaunched_gpu,
                          devices=load_devices(gpu_spec), cutoffs=cutoffs or Cutoffs(),
                          sequences_of=kernel_sequences or None, repair=repair, on_error=on_error,
                          read_part=read_part, write_part=write_part)


def _map(c: Any, files: list[InputFile], request: AnalyzeRequest,
         show_progress: bool) -> tuple[list[dict[str, Any]], Callable[[list[tuple[int, int]]], pd.DataFrame] | None]:
    """The map tasks on the cluster ``c`` (a file each, small ones batched by their bytes and ``FILE_COST`` each),
    and over ``_COMBINE`` of them their combine tasks: the results the client gets, and how the reduce gets the
    critical path's segments that stay on the cluster (None: they are in the results)."""
    costs = [None if f.trace_bytes is None else f.trace_bytes + FILE_COST for f in files]
    futures = c.map(analyze_files, [files[b.start:b.stop] for b in batches(costs)], request=request, pure=False)
    if len(futures) <= _COMBINE:
        return gathered(c, futures, show_progress), None
    if show_progress:
        progress_bar(c, futures)
    reduced = [c.submit(combine, futures[i:i + _COMBINE], coded=True, pure=False)
               for i in range(0, len(futures), _COMBINE)]
    del futures  # each file's result is freed once its reduce task has it
    # the critical path's segments stay on the cluster: the reduce asks for those of the path's walks

    def segments_of(wanted: list[tuple[int, int]]) -> pd.DataFrame:
        return join_parts(c.gather([c.submit(segments_in, r, wanted, pure=False) for r in reduced]))

    return c.gather([c.submit(without_segments, r, pure=False) for r in reduced]), segments_of


