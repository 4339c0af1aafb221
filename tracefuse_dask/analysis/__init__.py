"""``tracefuse analyze``: per-rank analysis as Dask map tasks, reduced to small cross-rank tables and a report."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import fsspec
import numpy as np
import orjson
import pandas as pd
from distributed import progress
from pandas.api.types import union_categoricals

from .._version import __version__
from ..errors import (SKIPPABLE, MergeError, OutputExistsError, RankError, TraceFormatError, every_rank_failed,
                      skipped_rank)
from ..storage.files import (options_for, path_info, read_bytes, read_start, retry_unreachable,
                             storage_errors)
from ..cluster import batches, connect
from ..model import DEFAULT_RANK_REGEX, InputFile, parse_steps, rank_subset
from .collective_trace import CALL_COLUMNS as CT_COLUMNS
from .collective_trace import looks_like_collective_trace, parse_collective_trace, summarize
from .counters import Cutoffs, launch_summary, rank_metrics
from .collectives import clock_offsets, group_members, instance_metrics, match_collectives, op_summary, straggler
from .critical_path import bound, stitch, straggler_cause, walks_in
from .what_if import stragglers as what_ifs
from .what_if import timeline as replay_graph
from .what_if import verdict as straggler_verdict
from .diff import Diff
from .efficiency import gpu_speed, link_use, node_of
from .op_perf import by_category, roofline_summary
from .rank import PIECES, TABLES, RankTables, analyze_events, analyze_rank, rows_for
from .sequences import top_sequences
from .trace import decode_trace
from ..kineto.array_form import COMPOSER_MERGED, MERGED_BY_COMPOSER
from ..kineto.document import check_document, decode_json, paused_gc
from ..perf.devices import Device, load_devices
from ..kineto.layout import is_merged, split_merged
from ..merge.plan import ranges
from ..storage.inputs import TRACE_NAME, expand_inputs, rank_from_name, resolve_rank
from ..storage.output import open_write
from ..storage.folders import COMMIT, Committed, commit_folder, read_committed
from ..storage.runs import run_folder

__all__ = ["Analysis", "analyze", "check_new", "is_report", "rank_stats", "read_report", "write_diff", "write_report"]

log = logging.getLogger(__name__)
_REDUCED = ("rank_stats", "collective_instances", "collective_waits", "collective_summary", "straggler_ranks",
            "critical_path", "collective_trace_calls", "collective_trace_summary", "collective_trace_hints",
            "op_perf_by_category", "gpu_speed")
_CT_RANK = r"[-_.](?P<rank>\d+)(?:\.(?:csv|log|txt))?$"  # collective_trace names its logs <file>-<rank>
# what a folder or glob lists for analysis: traces, and collective_trace logs and CSV exports
_MERGED_HEAD = b'"metadata":{"tracefuse":'
_NAMES = re.compile(r"\.json(\.gz)?$|\.gz$|\.csv$|\.log(-\d+)?$|\.txt$", re.IGNORECASE)
_COMBINE = 64  # the results of this many tasks are joined by one reduce task on the cluster (fewer: by the client,
# which saves their results a hop: 0.4-0.5 s of 4.4-5.1 s for 8 ranks of 50 MB of the A100 shape)
_MAD_LIMIT = 3.0
_CANDIDATES = 8  # the ranks that caused most waiting, each replayed without its extra work (``what_if``)
_MIN_REL_DEVIATION = 0.10
_BOOKKEEPING = ("gpu_events_left_out", "kernels_clipped")  # breakdown columns that rank_stats leaves out


@dataclass
class Analysis:
    """The reduced cross-rank tables (pandas DataFrames, each with a ``rank`` column) and the summary."""

    breakdown: pd.DataFrame
    breakdown_by_step: pd.DataFrame
    kernels: pd.DataFrame
    kernel_categories: pd.DataFrame
    ops: pd.DataFrame
    kernel_launchers: pd.DataFrame
    op_perf: pd.DataFrame
    idle: pd.DataFrame
    collectives: pd.DataFrame
    launch_stats: pd.DataFrame
    launch_worst: pd.DataFrame
    queue_length: pd.DataFrame
    memory_bw: pd.DataFrame
    kernel_sequences: pd.DataFrame
    rank_stats: pd.DataFrame
    collective_instances: pd.DataFrame
    collective_waits: pd.DataFrame
    collective_summary: pd.DataFrame
    straggler_ranks: pd.DataFrame
    critical_path: pd.DataFrame
    collective_trace_calls: pd.DataFrame
    collective_trace_summary: pd.DataFrame
    collective_trace_hints: pd.DataFrame
    op_perf_by_category: pd.DataFrame
    gpu_speed: pd.DataFrame
    summary: dict[str, Any] = field(default_factory=dict)
    made_from: dict[str, Any] | None = field(default=None, repr=False)
    """What the analysis was made from (inputs with their size and etag or mtime, options, version), which its
    report folder's commit records for ``--skip-if-unchanged``; None when it is not known."""

    def tables(self) -> dict[str, pd.DataFrame]:
        """Every table by name, as the report folder names its files."""
        return {name: getattr(self, name) for name in (*TABLES, *_REDUCED)}


def _analyze_file(f: InputFile, storage_options: Mapping[str, Any] | None, steps: tuple[int, int] | None,
                  subset: Any, rank_regex: str, keep_unlaunched_gpu: bool, devices: tuple[Device, ...],
                  cutoffs: Cutoffs, sequences_of: str | None, repair: bool) -> dict[str, Any]:
    """Task: parse one file and analyse each rank it holds (one, or all of a merged trace).

    A collective_trace log or CSV export (recognised by its content) gives its calls instead. With ``repair``, a
    truncated trace gives its complete events, and a note says what was recovered.
    """
    if looks_like_collective_trace(read_start(f.path, storage_options)):
        return {"ct_calls": _collective_trace_calls(f, storage_options, rank_regex)}
    if f.listed and not TRACE_NAME.search(f.path):
        return {"ignored": f"{f.path}: neither a trace nor a collective_trace log or CSV"}
    with paused_gc():
        data, cut_gzip = read_bytes(f.path, storage_options, repair=repair)
        # A merged trace is split per rank on the orjson path; ours say so in their first bytes.
        trace = None if data.find(_MERGED_HEAD, 0, 256) >= 0 else decode_trace(data)
        if trace is not None and not is_merged(trace.metadata):
            header = {"distributedInfo": trace.distributedInfo, "host_name": trace.host_name,
                      "global_rank": trace.global_rank, "deviceProperties": trace.deviceProperties}
            rank, world_size, note = resolve_rank(f, header, rank_regex)
            ranks = [analyze_events(trace.traceEvents, rank, f.path, steps, base=_base(trace.baseTimeNanoseconds),
                                    header=header, keep_unlaunched_gpu=keep_unlaunched_gpu, devices=devices,
                                    cutoffs=cutoffs, sequences_of=sequences_of)
                     ] if subset is None or rank in subset else []
            return {"ranks": ranks, "world_size": world_size, "notes": [note] if note else [], "repaired": []}
        del trace
        doc, _, repaired = decode_json(data, f.path, rank=f.rank_hint, cut_gzip=cut_gzip, repair=repair)
        del data
        if f.listed and isinstance(doc, dict) and "traceEvents" not in doc:
            return {"ignored": f"{f.path}: a JSON file without traceEvents, not a trace"}
        check_document(doc, f.path)
        if COMPOSER_MERGED in doc:
            if f.listed:
                return {"ignored": f"{f.path}: {MERGED_BY_COMPOSER}"}
            raise TraceFormatError(f"{f.path}: this is {MERGED_BY_COMPOSER}, not a per-rank trace; analyse the "
                                   "per-rank files instead")
        meta = doc.get("metadata")
        notes: list[str] = []
        base = _base(doc.get("baseTimeNanoseconds"))
        if is_merged(meta) and f.listed:  # beside per-rank traces, its ranks would be theirs twice
            return {"ignored": f"{f.path}: a trace merged by tracefuse, found in a folder or glob; name it on its "
                               "own to analyse its ranks"}
        if is_merged(meta):
            parts = split_merged(doc["traceEvents"])
            world_size = None
            notes.append(f"{f.path}: a merged trace; analysed per rank ({len(parts):,} ranks)")
            by_rank = meta["tracefuse"].get("ranks") if isinstance(meta["tracefuse"], dict) else None
            headers = {int(r): h for r, h in by_rank.items()} if isinstance(by_rank, dict) else {}
        else:
            rank, world_size, note = resolve_rank(f, doc, rank_regex)
            parts = {rank: doc["traceEvents"]}
            notes += [note] if note else []
            headers = {rank: {k: v for k, v in doc.items() if k != "traceEvents"}}
        del doc
        ranks = [analyze_rank(events, rank, f.path, steps, base=base, header=headers.get(rank),
                              keep_unlaunched_gpu=keep_unlaunched_gpu, devices=devices, cutoffs=cutoffs,
                              sequences_of=sequences_of)
                 for rank, events in sorted(parts.items()) if subset is None or rank in subset]
        return {"ranks": ranks, "world_size": world_size, "notes": notes, "repaired": [repaired] if repaired else []}


@retry_unreachable
def _analyze_files(files: list[InputFile], storage_options: Mapping[str, Any] | None,
                   steps: tuple[int, int] | None, subset: Any, rank_regex: str,
                   keep_unlaunched_gpu: bool, devices: tuple[Device, ...], cutoffs: Cutoffs,
                   sequences_of: str | None, repair: bool, on_error: str) -> dict[str, Any]:
    """Task: ``_analyze_file`` of consecutive files; small ones share a task (``cluster.batches``). With
    ``on_error="skip"``, a bad file gives why instead (``{"skipped": {rank, path, reason}}``), as in merge."""
    results = []
    for f in files:
        try:
            results.append(_analyze_file(f, storage_options, steps, subset, rank_regex, keep_unlaunched_gpu,
                                         devices, cutoffs, sequences_of, repair))
        except SKIPPABLE as e:
            results.append({"skipped": skipped_rank(e, f.rank_hint, f.path, on_error)})
    return _batch(results)


def _batch(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The results of ``_analyze_file`` as one, with each table's rows of all their ranks joined (a DataFrame costs
    ~10 kB whatever its rows)."""
    ranks: list[RankTables] = []
    ct: list[pd.DataFrame] = []
    out: dict[str, Any] = {"notes": [], "world_sizes": [], "ignored": [], "skipped": [], "repaired": []}
    for res in results:
        if "ignored" in res:
            out["ignored"].append(res["ignored"])
        elif "skipped" in res:
            out["skipped"].append(res["skipped"])
        elif "ct_calls" in res:
            ct.append(res["ct_calls"])
        else:
            ranks += res["ranks"]
            out["notes"] += res["notes"]
            out["repaired"] += res["repaired"]
            out["world_sizes"].append(res["world_size"])
    out["tables"] = {name: rows_for(ranks, name) for name in (*TABLES, *PIECES)}
    out["ranks"] = [replace(rt, tables={}) for rt in ranks]
    out["ct_files"] = len(ct)
    out["ct_calls"] = pd.concat(ct, ignore_index=True) if ct else None
    return out


def _combine(parts: list[dict[str, Any]], coded: bool = False) -> dict[str, Any]:
    """Reduce task: the results of consecutive ``_analyze_files`` tasks as one (``_batch``'s form), so that the
    client gets one DataFrame per table for many tasks; ``coded``: with their text columns as categoricals
    (``_coded``), for the trip to the client."""
    out: dict[str, Any] = {key: [v for p in parts for v in p[key]] for key in ("notes", "world_sizes", "ignored",
                                                                           "skipped", "repaired", "ranks")}
    out["tables"] = {name: _joined([p["tables"][name] for p in parts]) for name in (*TABLES, *PIECES)}
    if coded:
        out["tables"] = {name: _coded(table) for name, table in out["tables"].items()}
    out["ct_files"] = sum(p["ct_files"] for p in parts)
    ct = [p["ct_calls"] for p in parts if p["ct_calls"] is not None]
    out["ct_calls"] = pd.concat(ct, ignore_index=True) if ct else None
    return out


def _coded(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its text columns as categoricals, as reduce tasks' results travel to the client: the same
    names repeat in every rank (10,000 ranks of an A100 job: 0.3 GB of text in the ops, kernels and launchers
    tables, which the client held up to three times while it gathered and joined them). ``_joined`` keeps them
    so; ``_texts`` turns them back."""
    text = [c for c, t in table.dtypes.items() if isinstance(t, pd.StringDtype)]  # pandas 3's text (2's is object:
    # left as it is, since categories of object text come back as str in pandas 3)
    return table.astype(dict.fromkeys(text, "category")) if text and len(table) else table


def _texts(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with the categorical columns of ``_coded`` as text again, and pandas's text in its Python storage
    (``_text``) whichever way the table came: the same tables for any number of tasks."""
    coded = {c: table[c] for c, t in table.dtypes.items() if isinstance(t, pd.CategoricalDtype)}
    coded |= {c: table[c].astype("category") for c, t in table.dtypes.items()
              if isinstance(t, pd.StringDtype) and t.storage != "python"}
    return table.assign(**{c: _text(v) for c, v in coded.items()}) if coded else table


def _text(column: pd.Series) -> pd.Series:
    """A categorical column as text again, taken from its categories (``astype`` would build every row's text as
    a Python string first: twice the memory).

    pandas's text (``str``, ``string``) comes back in its Python storage, where each row refers to its category's
    one string: Arrow's would copy every row's text (10,000 A100 ranks: 315 MB of ops, kernels and launchers).
    Other categories (pandas 2's object text) give their own type."""
    if not isinstance(column.dtype, pd.CategoricalDtype):
        return column
    values = column.cat.categories.array
    if isinstance(values.dtype, pd.StringDtype) and values.dtype.storage != "python":
        with contextlib.suppress(TypeError):  # pandas < 2.3 has no Python storage for text missing as NaN
            python = pd.StringDtype("python", na_value=values.dtype.na_value)
            values = pd.array(values.to_numpy(dtype=object), dtype=python)
    return pd.Series(values.take(column.cat.codes.to_numpy(), allow_fill=True), index=column.index, name=column.name)


def _joined(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """One table from the tasks' parts, their rows one after the other (one part: that part itself); a column
    that is categorical in every part, over categories of one type, stays categorical over their union."""
    rows = [p for p in parts if len(p)]
    if not rows:
        return max(parts, key=lambda p: len(p.columns))  # the columns of a task that had ranks
    if len(rows) == 1:
        return rows[0]
    if not any(isinstance(t, pd.CategoricalDtype) for p in rows for t in p.dtypes):
        return pd.concat(rows, ignore_index=True)
    if any(not p.columns.equals(rows[0].columns) for p in rows):
        return pd.concat([_texts(p) for p in rows], ignore_index=True)
    columns = {}
    for c in rows[0].columns:
        col = [p[c] for p in rows]
        coded = all(isinstance(s.dtype, pd.CategoricalDtype) for s in col) and len(
            {s.cat.categories.dtype for s in col}) == 1
        columns[c] = union_categoricals(col) if coded else pd.concat([_text(s) for s in col], ignore_index=True)
    return pd.DataFrame(columns)


def _one_source_per_rank(calls: pd.DataFrame, warnings: list[str]) -> pd.DataFrame:
    """Drop a rank's CSV calls when its log is there too: the same calls, which would count twice."""
    csv = calls["kind"] == "csv"
    logged = set(calls.loc[~csv, "rank"].dropna())
    twice = csv & calls["rank"].isin(logged)
    for rank, paths in calls[twice].groupby("rank")["path"]:
        warnings.append(f"rank {rank}: both a collective_trace log and a CSV export ({', '.join(sorted(set(paths)))}); "
                        "the CSV's calls were left out, as the log holds the same calls with their groups")
    return calls[~twice].reset_index(drop=True)


def _base(value: Any) -> int:
    """A file's ``baseTimeNanoseconds``, 0 when it has none."""
    return value if type(value) is int and value >= 0 else 0


def _collective_trace_calls(f: InputFile, storage_options: Mapping[str, Any] | None,
                            rank_regex: str) -> pd.DataFrame:
    data, _ = read_bytes(f.path, storage_options)
    rank = f.rank_hint if f.rank_hint is not None else rank_from_name(f.path, _CT_RANK)
    calls = parse_collective_trace(data, f.path, rank)
    if calls["rank"].isna().any():
        raise RankError(f"{f.path}: a collective_trace CSV export holds no rank and its name gives none (regex "
                        f"{rank_regex!r}); rename it (e.g. rank3.csv), pass --rank-regex, or give a {{rank: path}} "
                        "dict")
    return calls


def rank_stats(breakdown: pd.DataFrame, by_step: pd.DataFrame, launches: pd.DataFrame,
               queues: pd.DataFrame) -> pd.DataFrame:
    """One row per metric: min, median and max across ranks, and the outlier ranks.

    A rank is an outlier when it is more than 3 median absolute deviations from
    the median, and at least 10% away from it. The counts of GPU events left out
    and kernels clipped say how the trace was read, not how the rank ran: no rows.
    The metrics are the breakdown's, the mean step time, and each rank's median launch delay and longest queue
    (``counters.rank_metrics``).
    """
    per_rank = breakdown.set_index("rank").drop(columns=list(_BOOKKEEPING), errors="ignore")
    if len(by_step):
        per_rank = per_rank.join(by_step.groupby("rank")["step_us"].mean().rename("step_us_mean"))
    per_rank = per_rank.join(rank_metrics(launches, queues))
    rows = []
    for metric in per_rank.columns:
        values = per_rank[metric].dropna()
        if values.empty:
            continue
        med = float(values.median())
        dev = (values - med).abs()
        mad = float(dev.median())
        far = dev[(dev > _MAD_LIMIT * mad) & (dev >= _MIN_REL_DEVIATION * abs(med)) & (dev > 0)]
        outliers = sorted(int(r) for r in far.index)
        notes = []
        for r in outliers:
            x = float(values[r])
            how = f"{x / med:.1f}× the median" if med else f"{x:,.1f} against a median of 0"
            notes.append(f"rank {r}'s {metric} is {how} ({x:,.1f} vs {med:,.1f})")
        rows.append({"metric": metric, "min": float(values.min()), "median": med, "max": float(values.max()),
                     "min_rank": int(values.idxmin()), "max_rank": int(values.idxmax()),
                     "outlier_ranks": outliers, "note": "; ".join(notes)})
    return pd.DataFrame(rows, columns=["metric", "min", "median", "max", "min_rank", "max_rank", "outlier_ranks",
                                       "note"])


def analyze(
    urlpath: str | Iterable[str] | Mapping[int, str],
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
) -> Analysis:
    """Analyse per-rank traces, one Dask task per file, and reduce the small per-rank tables.

    Parameters
    ----------
    urlpath
        A folder, a glob, a file, a list of those, or a ``{rank: path}`` dict; any fsspec URL.
        A trace merged by tracefuse is analysed per rank.
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
        more ``ProfilerStep#N`` (work queued before the profiler started; see ``analysis.rank._launched_only``).
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

    Returns
    -------
    Analysis

    Examples
    --------
    >>> a = analyze("traces/", "report/")  # doctest: +SKIP
    >>> a.breakdown[["rank", "idle_us", "exposed_comm_us"]]  # doctest: +SKIP
    """
    started = time.perf_counter()
    if format not in ("parquet", "csv"):
        raise MergeError(f"format={format!r}; use 'parquet' or 'csv'")
    if on_error not in ("raise", "skip"):
        raise MergeError(f"on_error={on_error!r}; use 'raise' or 'skip'")
    try:
        subset = rank_subset(ranks)
        step_range = parse_steps(steps) if isinstance(steps, str) else steps
    except ValueError as e:
        raise MergeError(str(e)) from None
    so = dict(storage_options or {})
    devices = load_devices(gpu_spec)
    if skip_if_unchanged and out_dir is None:
        raise MergeError("skip_if_unchanged compares with the report folder: give out_dir too")
    if out_dir is not None:
        check_new(out_dir, so, force or skip_if_unchanged)
    files, skipped_names = expand_inputs(urlpath, storage_options=storage_options, rank_regex=rank_regex,
                                         names=_NAMES, subset=subset)
    made_from = {"inputs": [f.identity for f in files],
                 "options": {"ranks": ranks if ranks is None or isinstance(ranks, str)
                             else sorted(int(r) for r in subset),
                             "steps": step_range, "rank_regex": rank_regex, "format": format,
                             "keep_unlaunched_gpu": keep_unlaunched_gpu,
                             "devices": hashlib.sha256(repr(devices).encode()).hexdigest(),
                             "cutoffs": asdict(cutoffs or Cutoffs()), "kernel_sequences": kernel_sequences,
                             "on_error": on_error, "repair": repair}}
    if skip_if_unchanged and (done := unchanged_report(out_dir, made_from, so)) is not None:
        return done
    with connect(client, scheduler=scheduler, scheduler_file=scheduler_file, workers=workers,
                 timeout=timeout, inputs=files) as c:
        futures = c.map(_analyze_files, [files[b.start:b.stop] for b in batches([f.trace_bytes for f in files])],
                        storage_options=so, steps=step_range, subset=subset, rank_regex=rank_regex,
                        keep_unlaunched_gpu=keep_unlaunched_gpu, devices=devices, cutoffs=cutoffs or Cutoffs(),
                        sequences_of=kernel_sequences or None, repair=repair, on_error=on_error, pure=False)
        if show_progress:
            with contextlib.redirect_stdout(sys.stderr):
                progress(futures, scheduler=c.scheduler.address)
        joined = len(futures) > _COMBINE
        if joined:
            reduced = [c.submit(_combine, futures[i:i + _COMBINE], coded=True, pure=False)
                       for i in range(0, len(futures), _COMBINE)]
            del futures  # each file's result is freed once its reduce task has it
            # the critical path's segments stay on the cluster: the reduce asks for those of the path's walks
            results = c.gather([c.submit(_without_segments, r, pure=False) for r in reduced])

            def segments_of(wanted: list[tuple[int, int]]) -> pd.DataFrame:
                return _joined(c.gather([c.submit(_segments_in, r, wanted, pure=False) for r in reduced]))

            with paused_gc():
                analysis = _reduce(results, segments_of, skipped_names, step_range, keep_unlaunched_gpu, devices,
                                   cutoffs or Cutoffs(), kernel_sequences or None, subset)
        else:
            results = c.gather(futures)
    if not joined:  # the reduce needs no cluster
        with paused_gc():
            results = [_combine(results)]
            segments = results[0]["tables"].pop("path_segments")
            analysis = _reduce(results, lambda wanted: walks_in(segments, wanted), skipped_names, step_range,
                               keep_unlaunched_gpu, devices, cutoffs or Cutoffs(), kernel_sequences or None, subset)
    analysis.summary["seconds"] = round(time.perf_counter() - started, 3)
    analysis.made_from = made_from
    if out_dir is not None:
        write_report(analysis, out_dir, so, format=format)
    return analysis


def _without_segments(result: dict[str, Any]) -> dict[str, Any]:
    """Task: a reduce task's result without the critical path's segments, for the client (10,000 A100 ranks:
    79 MiB of them pickled, of which the path takes a few walks)."""
    return {**result, "tables": {k: v for k, v in result["tables"].items() if k != "path_segments"}}


def _segments_in(result: dict[str, Any], wanted: list[tuple[int, int]]) -> pd.DataFrame:
    """Task: the segments of the walks ``wanted`` in a reduce task's result (``stitch``)."""
    return walks_in(result["tables"]["path_segments"], wanted)


# The reduce runs with the cyclic collector paused, as the tasks do: it builds and frees many objects and no
# cycles, and a full collection over the client's objects cost 50-70 ms of an 8-rank analysis.
def _reduce(results: list[dict[str, Any]], segments_of: Callable[[list[tuple[int, int]]], pd.DataFrame],
            skipped_names: list[str], steps: tuple[int, int] | None, keep_unlaunched_gpu: bool,
            devices: tuple[Device, ...], cutoffs: Cutoffs, sequences_of: str | None,
            subset: Any = None) -> Analysis:
    """The cross-rank reduce of the tasks' joined results (``_combine``, without the critical path's segments,
    which ``segments_of`` gives for the walks asked for); it takes their tables out of them."""
    warnings: list[str] = []
    ignored = [f"{p}: not a trace or collective_trace file by name, or written by tracefuse" for p in skipped_names]
    per_rank: list[RankTables] = []
    world_sizes = set()
    where: dict[int, str] = {}
    ct_calls: list[pd.DataFrame] = []
    skipped = sorted((sk for res in results for sk in res["skipped"]),
                     key=lambda sk: (sk["rank"] is None, sk["rank"] or 0, sk["path"]))
    for res in results:
        ignored += res["ignored"]
        if res["ct_calls"] is not None:
            ct_calls.append(res["ct_calls"])
        warnings += res["notes"]
        world_sizes.update(ws for ws in res["world_sizes"] if ws is not None)
        for rt in res["ranks"]:
            if rt.rank in where:
                raise RankError(f"rank {rt.rank} appears twice: {where[rt.rank]} and {rt.path}; drop one, or give "
                                "the files as a {rank: path} dict")
            where[rt.rank] = rt.path
            per_rank.append(rt)
    if not per_rank and not ct_calls:
        if skipped:
            raise every_rank_failed(skipped)
        if ignored and not subset:
            raise RankError(f"no traces to analyse: {'; '.join(ignored[:3])}"
                            f"{f' and {len(ignored) - 3} more' if len(ignored) > 3 else ''}; give Kineto traces "
                            "(.json, .json.gz) or collective_trace logs")
        raise RankError("no ranks to analyse after --ranks; check the inputs and --ranks")
    per_rank.sort(key=lambda rt: rt.rank)
    if len(world_sizes) == 1:
        world_size = world_sizes.pop()
        missing = sorted(set(range(world_size)) - set(where))
        if missing:
            bad = sorted(set(missing) & {sk["rank"] for sk in skipped})
            warnings.append(f"{len(missing):,} of the world size's {world_size:,} ranks "
                            f"{'is' if len(missing) == 1 else 'are'} not analysed: rank(s) {ranges(missing)}"
                            + (f" ({ranges(bad)} skipped as bad)" if bad else ""))
    elif len(world_sizes) > 1:
        warnings.append(f"the inputs report different world sizes {sorted(world_sizes)}: several jobs mixed?")
    # each table's parts are dropped once joined, so that the client holds each table about once
    tables = {name: _texts(_in_rank_order([res["tables"].pop(name) for res in results])) for name in TABLES}
    stats = rank_stats(tables["breakdown"], tables["breakdown_by_step"], tables["launch_stats"],
                       tables["queue_length"])
    pg_members: dict[str, set[int]] = {}
    for pg, spec in {(pg, spec) for rt in per_rank for pg, spec in rt.pg_config.items()}:  # each group once
        pg_members.setdefault(pg, set()).update(group_members(spec))
    matched, problems = match_collectives(tables["collectives"], pg_members)
    clocks = clock_offsets(matched, {rt.rank: rt.host for rt in per_rank})
    offsets = {int(r): us * 1e3 for r, us in clocks["clock_offset_us"].items()}
    instances, waits = instance_metrics(matched, offsets)
    by_name: dict[str, Device] = {}
    for d in devices:  # a --gpu-spec device comes first and wins over the package's of the same name
        by_name.setdefault(d.name, d)
    instances = link_use(instances, matched, {rt.rank: node_of(rt.rank, rt.host, rt.device[2]) for rt in per_rank},
                         {rt.rank: by_name.get(rt.device[0]) for rt in per_rank})
    stragglers, verdict = straggler(instances, waits, matched)
    gpu = bool("kernel_count" in tables["breakdown"] and (tables["breakdown"]["kernel_count"] > 0).any())
    pieces = {name: _texts(_in_rank_order([res["tables"].pop(name) for res in results]))
              for name in PIECES if name != "path_segments"}
    texts = {rt.rank: rt.texts for rt in per_rank}
    path, path_steps, path_origin = stitch(pieces["path_anchors"], segments_of, tables["collectives"], matched,
                                           offsets, texts)
    speed, slow_gpu = gpu_speed(tables["op_perf"])
    graph = replay_graph(matched, pieces["path_anchors"], offsets)
    candidates = stragglers.sort_values(["wait_caused_us", "rank"], ascending=[False, True])["rank"]
    what_if = what_ifs(graph, candidates.astype(int).tolist()[:_CANDIDATES])
    # a rank late in a few steps is late for what it did in those: its cause is found there
    named = [(n["rank"], n["late_steps"] if n["pattern"] == "transient" else None) for n in what_if["ranks"]] \
        if what_if else [(verdict["rank"], None)]
    causes = {r: straggler_cause(r, instances, matched, pieces["path_work"], len(late or path_steps), gpu, texts, late,
                                 behind=k > 0)  # the ranks after the first: held up behind it, seldom the last
              for k, (r, late) in enumerate(named) if r is not None}
    verdict = straggler_verdict(verdict, stragglers, what_if, causes)
    ct = _one_source_per_rank(pd.concat(ct_calls, ignore_index=True), warnings) if ct_calls \
        else pd.DataFrame(columns=CT_COLUMNS)
    ct_summary, ct_hints, ct_verdict = summarize(ct)
    summary = {
        "tool": "tracefuse_dask",
        "version": __version__,
        "inputs": [rt.path for rt in per_rank],
        "ranks": [rt.rank for rt in per_rank],
        "steps": sorted({s for rt in per_rank for s in rt.steps}),
        "step_range": list(steps) if steps else None,
        "gpu": gpu,
        "why_no_gpu": None if gpu else "no GPU kernels, memcpy or memset in the traces: a CPU-only job (such as "
                                       "gloo); the GPU tables are empty, the ops and step tables are not",
        "per_rank": {str(rt.rank): _plain(rt.numbers) for rt in per_rank},
        "gpu_events_left_out": {
            "count": sum(rt.numbers["gpu_events_left_out"] for rt in per_rank),
            "why": "HTA's rule, for parity with its figures: in a rank with two or more ProfilerStep#N, device "
                   "work whose launch (correlation) is not among the host events up to the end of the last step, "
                   "such as work queued before the profiler started, is left out; --keep-unlaunched-gpu keeps it",
        } if not keep_unlaunched_gpu else None,
        "kernels_clipped": {
            "count": sum(rt.numbers["kernels_clipped"] for rt in per_rank),
            "why": "a kernel, memcpy or memset that ends after the next one on its stream starts (a clock quirk) "
                   "counts up to that start in the per-kernel durations (kernels, ops and kernel_launchers "
                   "tables); the breakdowns and the idle table use the raw times, as HTA does",
        },
        "begin_end": {
            "pairs": sum(rt.begin_end[0] for rt in per_rank),
            "unclosed": sum(rt.begin_end[1] for rt in per_rank),
            "unclosed_ranks": [rt.rank for rt in per_rank if rt.begin_end[1]],
            "unopened": sum(rt.begin_end[2] for rt in per_rank),
            "why": "B/E duration events (Composer's and other Chrome-trace writers') count as ops once paired on "
                   "their thread, as Perfetto pairs them; a B whose E is not in the trace (it was cut, or the span "
                   "outlives it, as Composer's event/fit and event/epoch outlive a profiling cycle) ends at its "
                   "rank's last timestamp; an E whose B came before the trace began is left out",
        },
        "devices": _devices(per_rank),
        "slow_gpu": _slow_gpu_verdict(slow_gpu, verdict),
        "roofline": roofline_summary(op_perf_categories := by_category(tables["op_perf"])),
        "outliers": [n for n in stats["note"] if n],
        "launches": (launches := launch_summary(tables["launch_stats"], tables["queue_length"], tables["memory_bw"],
                                                stats, cutoffs)),
        "kernel_sequences": top_sequences(sequences_of, tables["kernel_sequences"]),
        "collectives": {"calls": len(tables["collectives"]), "matched": len(instances), "problems": len(problems),
                        "problem_examples": problems[:20]},
        "straggler": verdict,
        "critical_path": path_steps,
        "bound": bound(path_steps, launches, float(np.nanmedian([rt.numbers["idle_pct"] for rt in per_rank])))
        if gpu else None,  # a CPU-only job's path is the host's
        "critical_path_origin_ns": path_origin,
        "base_time_ns": {str(rt.rank): rt.base for rt in per_rank},
        "collective_trace": {"files": sum(res["ct_files"] for res in results), "calls": len(ct),
                             "straggler_hint": ct_verdict} if ct_calls else None,
        **clocks,
        "warnings": warnings,
        "ignored": ignored,
        "skipped": skipped,
        "repaired": [note for res in results for note in res["repaired"]],
    }
    return Analysis(**tables, rank_stats=stats, collective_instances=instances, collective_waits=waits,
                    collective_summary=op_summary(instances), straggler_ranks=stragglers, critical_path=path,
                    collective_trace_calls=ct, collective_trace_summary=ct_summary,
                    collective_trace_hints=ct_hints, op_perf_by_category=op_perf_categories, gpu_speed=speed,
                    summary=summary)


def _slow_gpu_verdict(slow: dict[str, Any] | None, straggler: dict[str, Any]) -> dict[str, Any] | None:
    """The slow GPU (``efficiency.gpu_speed``), told apart from the straggler: a straggler whose GPU is not slow
    is late for what the critical path shows (host work, launches, waits), not for its kernels."""
    late = straggler.get("rank")
    if slow is None:
        return None if late is None else {"rank": None, "text": f"no GPU is slower than the others at equal shapes: "
                                          f"rank {late} is late for what the critical path shows, not for its kernels"}
    if late == slow["rank"]:
        slow["text"] += "; it is also the straggler, and its GPU is why"
    elif late is not None:
        slow["text"] += f"; the straggler, rank {late}, is late for what the critical path shows, not for its kernels"
    return slow


def _devices(per_rank: list[RankTables]) -> dict[str, Any]:
    """Which device each rank ran on, as the device table names it (``op_perf``'s roofline), and which it lacks."""
    by_name: dict[str, list[int]] = {}
    unknown: dict[str, list[int]] = {}
    for rt in per_rank:
        name, called, _ = rt.device
        if name is not None:
            by_name.setdefault(name, []).append(rt.rank)
        elif called or rt.numbers.get("kernel_count"):
            unknown.setdefault(called or "(no deviceProperties)", []).append(rt.rank)
    return {
        "ranks": by_name,
        "unknown": unknown,
        "note": ("op_perf has no roofline for the ranks of " + ", ".join(map(repr, unknown)) + ": add the device to a "
                 "JSON file shaped as tracefuse_dask/perf/devices.json and pass it with --gpu-spec FILE.json"
                 ) if unknown else None,
    }


def _in_rank_order(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """One table from the tasks' parts: their rows by rank (a rank is in one task), each rank's in its order.
    ``parts`` is emptied, so that the parts can be freed once joined."""
    out = _joined(parts)
    parts.clear()
    return out if out["rank"].is_monotonic_increasing else out.sort_values("rank", kind="stable", ignore_index=True)


def _plain(numbers: Mapping[str, Any]) -> dict[str, Any]:
    """JSON-ready numbers: NaN becomes null."""
    return {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in numbers.items()}


def check_new(out_dir: str, so: Mapping[str, Any], force: bool) -> None:
    """Raise ``OutputExistsError`` when ``out_dir`` (a folder or a file) exists and ``force`` is not set."""
    with storage_errors(out_dir, so):
        fs, path = fsspec.core.url_to_fs(out_dir, **options_for(out_dir, so))
        if fs.exists(path) and not force:
            raise OutputExistsError(f"{out_dir} exists; pass {{force}} to replace it, or choose "
                                    "another name")


def write_report(analysis: Analysis, out_dir: str, storage_options: Mapping[str, Any] | None = None, *,
                 format: str = "parquet") -> None:
    """Write the report folder: a file per table, ``report.html``, ``summary.json`` and its commit (last; see
    ``storage.folders``), which records ``analysis.made_from`` for ``--skip-if-unchanged``."""
    from .report import render_report

    files: dict[str, bytes | pd.DataFrame] = dict(
        (f"{name}.{format}", df) for name, df in analysis.tables().items())
    files["report.html"] = render_report(analysis.tables(), analysis.summary).encode()
    files["summary.json"] = json.dumps(analysis.summary, indent=1).encode()
    write_folder(files, out_dir, storage_options, format=format, made_from=analysis.made_from)


def write_diff(diff: Diff, out_dir: str, storage_options: Mapping[str, Any] | None = None, *,
               format: str = "parquet") -> None:
    """Write ``tracefuse diff``'s folder: its tables, ``diff.html``, ``diff.json`` and its commit (last)."""
    from .report import render_diff

    files: dict[str, bytes | pd.DataFrame] = {f"{name}.{format}": df for name, df in diff.tables.items()}
    files["diff.html"] = render_diff(diff).encode()
    files["diff.json"] = json.dumps(diff.summary, indent=1).encode()
    write_folder(files, out_dir, storage_options, format=format)


def write_folder(files: Mapping[str, bytes | pd.DataFrame], out_dir: str,
                 storage_options: Mapping[str, Any] | None = None, *, format: str = "parquet",
                 made_from: Mapping[str, Any] | None = None) -> None:
    """Write ``files`` (bytes, or tables in ``format``) into the folder ``out_dir``, in the place of whatever is
    there: the caller checked before any work that it may (``check_new``), and a run that ended meanwhile is
    replaced; of runs that commit at once, one run's whole folder stays.

    The files are written in this run's own temporary folder first (``storage.runs.run_folder``), then committed in
    the place of ``out_dir`` with ``commit.json`` last (``storage.folders.commit_folder``): a failed run leaves
    nothing behind, runs that write the same folder at once leave one run's whole folder, and readers trust only a
    committed folder.
    """
    so = dict(storage_options or {})
    data = {name: content if isinstance(content, bytes) else _table_bytes(content, format)
            for name, content in files.items()}
    with run_folder(out_dir, so) as tmp, storage_errors(out_dir, so):
        fs, path = fsspec.core.url_to_fs(out_dir, **options_for(out_dir, so))
        staged = f"{tmp}/folder"
        for name, content in data.items():
            with open_write(f"{staged}/{name}", so) as fh:
                fh.write(content)
        commit_folder(fs, fsspec.core.url_to_fs(staged, **options_for(out_dir, so))[1], path, data, made_from)


def _table_bytes(df: pd.DataFrame, format: str) -> bytes:
    if format == "csv":
        return df.to_csv(index=False).encode()
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    return buf.getvalue()


def unchanged_report(out_dir: str, made_from: Mapping[str, Any], so: Mapping[str, Any]) -> Analysis | None:
    """The report folder ``out_dir`` read back, with ``summary["status"]`` ``"unchanged"``, when its commit shows
    it was made from ``made_from`` by this version; None when the folder must be (re)written."""
    try:
        committed = read_committed(out_dir, so)
        if committed.record.get("version") != __version__ \
                or committed.made_from != orjson.loads(orjson.dumps(made_from)):
            return None
        report = _report_in(committed)
    except MergeError:  # none, half-written, being replaced, or another tool's: written again
        return None
    report.summary["status"] = "unchanged"
    return report


def is_report(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``url`` is a folder that ``analyze`` wrote, or is writing (it holds ``commit.json`` or
    ``summary.json``): ``read_report`` reads it, or says why it cannot."""
    so = dict(storage_options or {})
    with storage_errors(url, so):
        fs, path = fsspec.core.url_to_fs(url, **options_for(url, so))
        path = path.rstrip("/")
        try:
            folder = path_info(fs, path)["type"] == "directory"
        except FileNotFoundError:
            return False
        return folder and (fs.exists(f"{path}/{COMMIT}") or fs.exists(f"{path}/summary.json"))


def read_report(url: str, storage_options: Mapping[str, Any] | None = None) -> Analysis:
    """An ``analyze`` report folder read back into an ``Analysis``: its tables and ``summary.json``, each checked
    against the folder's commit.

    Raises
    ------
    MergeError
        When the folder has no commit (a run is writing it, or stopped before it finished), a file is not the one
        the commit lists (another run is replacing the folder), or it was not written by ``tracefuse analyze``, or
        by a version without the summary keys this one reads. A table it lacks reads as empty.
    """
    return _report_in(read_committed(url, storage_options))


def _report_in(folder: Committed) -> Analysis:
    """``read_report`` of a folder whose commit is read."""
    url = folder.url
    try:
        summary = json.loads(folder.read("summary.json")) if "summary.json" in folder.names else None
    except ValueError:
        summary = None
    if not isinstance(summary, dict) or summary.get("tool") != "tracefuse_dask":
        raise MergeError(f"{url}: not a report folder of tracefuse analyze (its summary.json is missing or was not "
                         "written by tracefuse analyze)")
    missing = [k for k in ("critical_path", "straggler", "steps", "ranks", "inputs") if k not in summary]
    if missing:
        raise MergeError(f"{url}: an analyze report without {', '.join(missing)} in its summary.json (tracefuse "
                         f"{summary.get('version')}); run tracefuse analyze on the traces again")
    fmt = "parquet" if "breakdown.parquet" in folder.names else "csv"
    tables = {}
    for n in (*TABLES, *_REDUCED):
        name = f"{n}.{fmt}"
        if name not in folder.names:  # a table an older version did not write
            tables[n] = pd.DataFrame()
            continue
        data = io.BytesIO(folder.read(name))
        tables[n] = pd.read_parquet(data) if fmt == "parquet" else pd.read_csv(data)
    return Analysis(**tables, summary=summary, made_from=folder.made_from)
