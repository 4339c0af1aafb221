"""The Dask side of the merge: per-rank tasks, one small reduce, and the final concatenation.

Phase A reads each rank's header in a task and returns a ``RankHeader``; the
metadata a rank carries into the output goes to a file next to the output. The
client reduces the headers into a plan (ranks, base times), which is the only
cross-rank state. Phase B rewrites each rank in a task that writes its own
partition next to the output and returns counts. Tasks write the output's
header from Phase A's files; then the header and the partitions are joined, in
rank order, into the output, which is renamed into place. The client never
holds trace bytes, nor the ranks' metadata.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tarfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

import fsspec
import orjson
from dask.base import tokenize
from distributed import CancelledError, Client, progress

from ._version import __version__
from .cluster import connect
from .errors import (
    MergeError,
    OutputExistsError,
    OutputWriteError,
    RankError,
    TraceFileNotFoundError,
    TraceFormatError,
    TraceFuseError,
)
from .storage.files import options_for, storage_errors, parse_json, read_bytes, read_header
from .model import (
    DEFAULT_RANK_REGEX,
    KEEP_PRESETS,
    InputFile,
    MergeOptions,
    MergeSummary,
    PortableFilter,
    RankHeader,
    RankResult,
    RankTask,
    parse_steps,
    parse_window,
    rank_subset,
)
from .fastpath import handles, rewrite_fast
from .storage.joins import MIN_PART, Piece, abort_uploads, join, plan_groups, protocol_of, write_group
from .kineto.document import check_document, decode_json, paused_gc
from .kineto.events import RankEvents
from .kineto.layout import is_merged
from .rewrite import rewrite
from .storage.inputs import expand_inputs, relative_sources, resolve_rank
from .storage.output import MANIFEST_SUFFIX, TMP_SUFFIX, gzip_member, gzip_writer, open_write

__all__ = ["merge_traces", "build_options"]

log = logging.getLogger("tracefuse_dask")

_BIG_OUTPUT = 1_500_000_000
_RANK_META = ("distributedInfo", "deviceProperties", "host_name")  # per rank in the output's metadata
BATCH_BYTES = 4 * 2**20  # small ranks share tasks of about this many input bytes; bigger ones have their own
BATCH_RANKS = 1024
_INLINE_HEADS = 1 << 20  # headers up to this many bytes travel in the task graph
_SEP = b",\n"
_FOOT = b"\n]}\n"
PERFETTO_MANIFEST = "perfetto_manifest.json"
def build_options(
    *,
    include_pyfunc: bool = False,
    keep: str | Iterable[str] | None = None,
    steps: str | tuple[int, int] | None = None,
    window: str | tuple[float, float] | None = None,
    filter_fn: Callable[[dict[str, Any]], bool] | None = None,
    rewrite_ids: bool = False,
    keep_empty_processes: bool = False,
    annotate_rank: bool = False,
) -> MergeOptions:
    """Check the filter options and turn them into ``MergeOptions``.

    Raises
    ------
    MergeError
        On an unknown preset, a bad step range or window, or an unpicklable ``filter_fn``.
    """
    presets = None
    if keep:
        presets = frozenset(p.strip() for p in (keep.split(",") if isinstance(keep, str) else keep))
        bad = presets - set(KEEP_PRESETS)
        if bad:
            raise MergeError(f"unknown --keep preset(s) {', '.join(sorted(bad))}; "
                             f"choose from {', '.join(KEEP_PRESETS)}")
    try:
        step_range = parse_steps(steps) if isinstance(steps, str) else (tuple(steps) if steps else None)
        if isinstance(window, str):
            window_ns = parse_window(window)
        elif window is not None:
            window_ns = parse_window(f"{window[0]!r}:{window[1]!r}")
        else:
            window_ns = None
    except ValueError as e:
        raise MergeError(str(e)) from None
    portable = None
    if filter_fn is not None:
        try:
            portable = PortableFilter(filter_fn)
        except Exception as e:
            raise MergeError(
                f"filter_fn cannot be pickled ({type(e).__name__}: {e}); it runs in the Dask workers, so "
                "use a module-level function or a lambda that captures only picklable values"
            ) from None
    return MergeOptions(include_pyfunc, presets, step_range, window_ns, portable, rewrite_ids, keep_empty_processes,
                        annotate_rank)


def _read_header_rank(
    f: InputFile, storage_options: Mapping[str, Any] | None, earliest: MergeOptions | None, repair: bool = False
) -> RankHeader:
    """Phase A task: the header of one file; the whole file only where it must."""
    header, complete, _ = read_header(f.path, storage_options)
    merged = is_merged(header.get("metadata"))
    if merged or (complete and earliest is None):
        return RankHeader(f.path, None, None, header.get("baseTimeNanoseconds"), header,
                          is_merged=merged, bytes_in=f.size or 0)
    with paused_gc():
        return _read_whole_rank(f, storage_options, earliest, repair)


def _read_whole_rank(f: InputFile, storage_options: Mapping[str, Any] | None,
                     earliest: MergeOptions | None, repair: bool) -> RankHeader:
    doc, nbytes, note = parse_json(f.path, storage_options, rank=f.rank_hint, repair=repair)
    if f.listed and isinstance(doc, dict) and "traceEvents" not in doc:
        return RankHeader(f.path, None, None, None, {}, is_trace=False)
    check_document(doc, f.path)
    header = {k: v for k, v in doc.items() if k != "traceEvents"}
    merged = is_merged(header.get("metadata"))
    base = header.get("baseTimeNanoseconds")
    h = RankHeader(f.path, None, None, base, header, is_merged=merged, full_read=True, bytes_in=nbytes,
                   repair_note=note)
    if note and base is None:
        h.relative_times = any(type(ev) is dict and isinstance(ev.get("ts"), (int, float)) and ev["ts"] < 1e14
                               for ev in doc["traceEvents"][:1000])
    if earliest is not None and not merged:
        sel = RankEvents(doc["traceEvents"], _base_of(base, f.path), earliest, f.path)
        h.earliest_ns = sel.earliest_ns(kept_only=False)
        h.earliest_kept_ns = sel.earliest_ns(kept_only=True)
    return h


def _base_of(base: Any, path: str) -> int:
    if base is None:
        return 0
    if type(base) is not int or base < 0:
        raise TraceFormatError(f"{path}: baseTimeNanoseconds={base!r} is not a non-negative integer")
    return base


def _rewrite_batch(tasks: list[RankTask], part_path: str, storage_options: Mapping[str, Any] | None,
                   skip: bool) -> list[tuple[RankResult | None, BaseException | None]]:
    """Phase B task: parse, filter and rewrite consecutive ranks, and write their partitions to one file.

    A rank's failure stops the task, unless ``skip``: then a skippable failure is returned in
    the rank's place and the others go on.
    """
    outcomes: list[tuple[RankResult | None, BaseException | None]] = []
    fo = None
    try:
        for task in tasks:
            try:
                with paused_gc():
                    result, data = _rewrite_rank(task, part_path, storage_options)
            except _SKIPPABLE as e:
                if not skip:
                    raise
                outcomes.append((None, e))
                continue
            with _writing(part_path), storage_errors(part_path, storage_options):
                if fo is None:
                    fo = open_write(part_path, storage_options)
                fo.write(data)
            outcomes.append((result, None))
    finally:
        if fo is not None:
            with _writing(part_path), storage_errors(part_path, storage_options):
                fo.close()
    return outcomes


def _rewrite_rank(task: RankTask, part_path: str,
                  storage_options: Mapping[str, Any] | None) -> tuple[RankResult, bytes | bytearray]:
    """One rank's partition (for the file ``part_path``): its kept events, rewritten, as bytes that join by
    plain concatenation."""
    who = f"{task.path} (rank {task.rank})"
    data, cut_gzip = read_bytes(task.path, storage_options, repair=task.repair)
    nbytes = len(data)
    fast = None
    if handles(task.options, task.window_abs_ns):
        fast = rewrite_fast(data, task.rank, task.base, task.base_out, task.options, who)
    if fast is not None:
        del data
        head_json, body_json, n_in, n_out = fast
        note = None
    else:
        doc, nbytes, note = decode_json(data, task.path, rank=task.rank, cut_gzip=cut_gzip, repair=task.repair)
        del data
        check_document(doc, who)
        events = doc["traceEvents"]
        n_in = len(events)
        sel = RankEvents(events, task.base, task.options, who, task.window_abs_ns)
        head, body = rewrite(sel, task.rank, task.base_out)
        del doc, events, sel
        head_json, body_json = orjson.dumps(head), orjson.dumps(body)
        n_out = len(head) + len(body)
        del head, body
    data = _partition(body_json)
    del body_json
    if task.compress and data:
        data = gzip_member(data)
    return RankResult(task.rank, task.path, n_in, n_out, nbytes, len(data), part_path, head_json[1:-1],
                      [note] if note else []), data


def _partition(events: bytes | bytearray) -> bytes | bytearray:
    """A JSON array's events as a partition: after a separator, so that partitions join as plain bytes."""
    if len(events) <= 2:
        return b""
    part = events if isinstance(events, bytearray) else bytearray(events)
    part[:1] = _SEP  # "[" (a bytearray shifts its bytes in place: no copy of the events)
    part[-1:] = b"\n"  # "]"
    return part


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        if isinstance(e, TraceFuseError):
            raise
        raise OutputWriteError(f"{path}: could not write it ({e.strerror or e}); free some space or write "
                               "the output somewhere else, then rerun") from e


def _write_group(out: str, pieces: list[Piece], dest: str, recompress: bool,
                 storage_options: Mapping[str, Any] | None) -> int:
    """Task: write consecutive pieces of the output as one object (a part of at least 5 MiB)."""
    with _writing(dest), storage_errors(dest, storage_options):
        fs, path = fsspec.core.url_to_fs(dest, **options_for(out, storage_options))
        return write_group(fs, pieces, path, recompress)


def _finish(out: str, tmp_dir: str, sources: list[str], sizes: list[int],
            storage_options: Mapping[str, Any] | None) -> int:
    """Task: make the output from its parts (server side on S3 and GCS, a rename elsewhere)."""
    with _writing(out), storage_errors(out, storage_options):
        fs, out_path = fsspec.core.url_to_fs(out, **options_for(out, storage_options))
        paths = [fsspec.core.url_to_fs(u, **options_for(out, storage_options))[1] for u in sources]
        if len(paths) == 1 and protocol_of(fs) == "other":
            fs.mv(paths[0], out_path)
        else:
            _, tmp_path = fsspec.core.url_to_fs(tmp_dir, **options_for(out, storage_options))
            join(fs, out_path, paths, sizes, tmp_path)
        return fs.size(out_path)


def _clean(fs: Any, out: str, tmp_dir: str, so: Mapping[str, Any]) -> None:
    """Abort unfinished multipart uploads of ``out`` and remove its temporary folder."""
    _, out_path = fsspec.core.url_to_fs(out, **options_for(out, so))
    _, tmp_path = fsspec.core.url_to_fs(tmp_dir, **options_for(out, so))
    fs.invalidate_cache()  # the workers wrote the temporaries: a cached listing would miss them
    abort_uploads(fs, out_path, tmp_path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(tmp_path, recursive=True)


def _assemble(c: Client, out: str, tmp_dir: str, pieces: list[Piece], single_member: bool,
              so: dict[str, Any], futures: list[Any]) -> int:
    """Join ``pieces`` into ``out``, as one gzip member with ``single_member``; the client only plans."""
    fs = fsspec.core.url_to_fs(out, **options_for(out, so))[0]
    strategy = protocol_of(fs)
    if strategy == "other" or single_member:
        groups = [list(range(len(pieces)))]
    else:
        groups = plan_groups(pieces, MIN_PART if strategy == "s3" else 1)
    sources: list[Any] = []
    for k, group in enumerate(groups):
        piece = pieces[group[0]]
        if len(group) == 1 and not isinstance(piece, bytes):
            sources.append(piece)  # a big partition: copied server side as it is
            continue
        dest = f"{tmp_dir}/group-{k:08d}"
        fut = c.submit(_write_group, out, [pieces[i] for i in group], dest, single_member, so,
                       key=f"tracefuse-group-{tokenize(out, dest, [pieces[i] for i in group], single_member)}")
        futures.append(fut)
        sources.append((dest, fut))
    # The groups' futures are among the sizes: the finish task waits for them, not the client.
    sizes = [s[1] for s in sources]
    paths = [s[0] for s in sources]
    key = f"tracefuse-finish-{tokenize(out, paths, [getattr(x, 'key', x) for x in sizes])}"
    fut = c.submit(_finish, out, tmp_dir, paths, sizes, so, key=key)
    futures.append(fut)
    return fut.result()


def _resolve_ranks(
    files: list[InputFile], headers: list[RankHeader], rank_regex: str
) -> tuple[list[tuple[int, RankHeader]], list[str], list[str]]:
    chosen: list[tuple[int, RankHeader]] = []
    notes: list[str] = []
    ignored: list[str] = []
    for f, h in zip(files, headers):
        if h.is_merged:
            if f.listed:
                ignored.append(f"{f.path}: a merged trace written by tracefuse")
                continue
            raise TraceFormatError(f"{f.path}: this is a merged trace written by tracefuse, not a per-rank "
                                   "trace; pass the original per-rank files instead")
        if not h.is_trace:
            ignored.append(f"{f.path}: a JSON file without traceEvents, not a trace")
            continue
        rank, world_size, note = resolve_rank(f, h.header, rank_regex)
        if note:
            notes.append(note)
        h.rank = rank
        h.world_size = world_size
        chosen.append((rank, h))
    return chosen, notes, ignored


def _plan_bases(headers: list[RankHeader]) -> int:
    """The one cross-rank reduce of spec §6: the merged base time.

    The earliest base when every rank has one; 0 (absolute times kept) when none
    has; otherwise the earliest absolute event over all ranks, floored to 1 s.
    """
    bases = [h.base for h in headers if h.base is not None]
    if len(bases) == len(headers):
        return min(bases)
    if not bases:
        return 0
    earliest = min(h.earliest_ns for h in headers if h.earliest_ns is not None)
    return earliest // 1_000_000_000 * 1_000_000_000


def merge_traces(
    urlpath: str | Iterable[str] | Mapping[int, str],
    out: str,
    *,
    client: Client | None = None,
    storage_options: Mapping[str, Any] | None = None,
    ranks: str | Iterable[int] | None = None,
    rank_regex: str = DEFAULT_RANK_REGEX,
    include_pyfunc: bool = False,
    keep: str | Iterable[str] | None = None,
    steps: str | tuple[int, int] | None = None,
    window: str | tuple[float, float] | None = None,
    filter_fn: Callable[[dict[str, Any]], bool] | None = None,
    rewrite_ids: bool = False,
    keep_empty_processes: bool = False,
    annotate_rank: bool = False,
    gzip_members: str = "rank",
    on_error: str = "raise",
    repair: bool = False,
    align: str = "base",
    split: int | None = None,
    format: str = "json",
    force: bool = False,
    skip_if_unchanged: bool = False,
    workers: int | None = None,
    scheduler: str | None = None,
    scheduler_file: str | None = None,
    timeout: float = 10.0,
    show_progress: bool = False,
    performance_report: str | None = None,
) -> MergeSummary:
    """Merge per-rank Kineto traces into one Perfetto-loadable trace on a Dask cluster.

    Parameters
    ----------
    urlpath
        A folder, a glob, a file, a list of those, or a ``{rank: path}`` dict; any fsspec URL.
    out
        The merged trace; gzip (one member per rank) when it ends in ``.gz``. With
        ``format="perfetto-archive"``, the archive: ``.tar``, or ``.tar.gz`` to gzip the whole TAR.
    client
        A Dask client to use. Otherwise ``scheduler``/``scheduler_file``/
        ``DASK_SCHEDULER_ADDRESS`` name a cluster, or a LocalCluster of ``workers`` is started.
    storage_options
        fsspec options for inputs and output; they travel to the workers with the tasks.
    ranks
        A subset: a spec such as ``"0-63:8,100"`` or an iterable of ints.
    rank_regex
        Regex with a named group ``rank``, applied to basenames when a file has no ``distributedInfo.rank``.
    include_pyfunc, keep, steps, window, filter_fn
        Filters: keep ``python_function`` events; keep presets ``gpu,comm,cpu``; the
        inclusive ``ProfilerStep#N`` range ``"A-B"``; ``"START_MS:END_MS"`` from the
        earliest kept event; a picklable ``filter_fn(raw_event) -> bool``.
    rewrite_ids
        Also rewrite ``External id`` and ``correlation`` (originals kept as ``<field>_raw``).
    keep_empty_processes
        Keep processes that have no events (Kineto lists 16 GPUs whatever is used).
    annotate_rank
        Also write ``"rank"`` into every event's ``args``, as TraceLens's ``TraceFuse`` does. Each
        process's name says its rank, and so does its pid (``rank = (pid - 2**22) // 64``); the
        annotation costs 32-48% of a rank's rewrite on real traces.
    gzip_members
        ``"rank"`` (one gzip member per rank, Perfetto >= v48) or ``"single"``.
    on_error
        ``"raise"`` stops at the first bad rank; ``"skip"`` goes on without bad ranks and lists
        them in the summary and in the output's ``metadata.tracefuse.skipped``.
    repair
        Recover the complete events of truncated files (reported in the warnings).
    split
        Write this many files instead of one, each a complete merged trace of a contiguous range of
        ranks (``merged.json.gz`` becomes ``merged.ranks-000-127.json.gz``, ...), all on the same time
        base, for viewers that cannot load the whole merge. Capped at the number of ranks.
    format
        ``"json"``: one merged trace. ``"perfetto-archive"``: a TAR of one complete trace per
        rank (``rank-00003.json``, ids and times already merged) plus the ``perfetto_manifest.json``
        with which Perfetto v58+ merges them natively, each rank a machine; not with ``split``,
        and ``gzip_members`` does not apply.
    align
        ``"base"`` aligns ranks exactly by their ``baseTimeNanoseconds``; ``"collectives"``
        also corrects each rank's clock offset, estimated from the ends of matched NCCL/RCCL
        collectives (see ``analyze``), and records the offsets in ``metadata.tracefuse``.
    force
        Replace an existing output.
    skip_if_unchanged
        Do nothing when ``<out>.manifest.json`` shows the same inputs (size and etag or
        mtime), options and tool version as now (status ``"unchanged"``); otherwise merge,
        replacing the output, and write the manifest.
    show_progress
        Draw a progress bar on stderr.
    performance_report
        Write Dask's HTML performance report to this file (needs bokeh).

    Returns
    -------
    MergeSummary

    Raises
    ------
    TraceFuseError
        Subclasses say what is wrong with which file and rank, and how to fix it.

    Examples
    --------
    >>> merge_traces("traces/*.json.gz", "merged.json.gz")  # doctest: +SKIP
    """
    started = time.perf_counter()
    options = build_options(include_pyfunc=include_pyfunc, keep=keep, steps=steps, window=window,
                            filter_fn=filter_fn, rewrite_ids=rewrite_ids,
                            keep_empty_processes=keep_empty_processes, annotate_rank=annotate_rank)
    if gzip_members not in ("rank", "single"):
        raise MergeError(f"gzip_members={gzip_members!r}; use 'rank' or 'single'")
    if on_error not in ("raise", "skip"):
        raise MergeError(f"on_error={on_error!r}; use 'raise' or 'skip'")
    if align not in ("base", "collectives"):
        raise MergeError(f"align={align!r}; use 'base' or 'collectives'")
    if split is not None and (type(split) is not int or split < 1):
        raise MergeError(f"split={split!r}; give the number of output files, 1 or more")
    if format not in ("json", "perfetto-archive"):
        raise MergeError(f"format={format!r}; use 'json' or 'perfetto-archive'")
    if format == "perfetto-archive" and not out.endswith((".tar", ".tar.gz")):
        raise MergeError(f"{out}: --format perfetto-archive writes a TAR archive; name the output .tar, or "
                         ".tar.gz to gzip it")
    if format == "perfetto-archive" and split and split > 1:
        raise MergeError("--split writes several merged JSON traces, and a perfetto archive already holds one trace "
                         "per rank; drop --split or --format perfetto-archive")
    if split and split > 1 and skip_if_unchanged:
        raise MergeError("--skip-if-unchanged works with one output file; drop --split or --skip-if-unchanged")
    try:
        subset = rank_subset(ranks)
    except ValueError as e:
        raise MergeError(str(e)) from None
    files, skipped_names = expand_inputs(urlpath, storage_options=storage_options, rank_regex=rank_regex,
                                         subset=subset)
    so = dict(storage_options or {})
    tmp_root = out.rstrip("/") + TMP_SUFFIX
    # A folder of its own per run: the task keys name its files, so no run reuses another's results.
    tmp_dir = f"{tmp_root}/{uuid.uuid4().hex}"
    manifest = None
    if skip_if_unchanged:
        manifest = _manifest(files, out, options, ranks, rank_regex, gzip_members, on_error, repair, align, format)
        unchanged = _unchanged(out, manifest, so)
        if unchanged is not None:
            unchanged.seconds = round(time.perf_counter() - started, 3)
            return unchanged
        force = True
    with storage_errors(out, so):
        fs, out_path = fsspec.core.url_to_fs(out, **options_for(out, so))
        if fs.exists(out_path) and not force:
            raise OutputExistsError(f"{out}: the output exists; pass --force (force=True) to replace it")
        _clean(fs, out, tmp_root, so)  # leftovers of a crashed run
    in_memory = any(url.startswith("memory://") for url in [out] + [f.path for f in files])
    report = contextlib.nullcontext()
    if performance_report:
        from distributed import performance_report as _perf

        report = _perf(filename=performance_report)
    futures: list[Any] = []
    try:
        with connect(client, scheduler=scheduler, scheduler_file=scheduler_file, workers=workers,
                     timeout=timeout, in_process=in_memory) as c, report:
            if in_memory and set(c.run(os.getpid).values()) != {os.getpid()}:
                raise MergeError("memory:// paths live in one process, but this Dask cluster runs its workers in "
                                 "other processes; use a local path or object storage, or an in-process cluster "
                                 "(LocalCluster(processes=False))")
            summary = _run(c, files, skipped_names, out, tmp_dir, options, subset, rank_regex, so,
                           gzip_members, show_progress, on_error, repair, align, split or 1, force, format,
                           futures)
    except BaseException:
        # Only unfinished work is cancelled: a finished key that is cancelled would also
        # cancel the same (deterministic) key of a rerun in this client.
        for fut in futures:
            if not fut.done():
                fut.cancel()
        raise
    finally:
        futures.clear()
        with storage_errors(out, so):
            _clean(fs, out, tmp_root, so)
    if manifest is not None:
        with storage_errors(out + MANIFEST_SUFFIX, so):
            fs.pipe(out_path + MANIFEST_SUFFIX, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    summary.seconds = round(time.perf_counter() - started, 3)
    summary.mb_per_s = round(summary.bytes_in / 1e6 / summary.seconds, 1) if summary.seconds else 0.0
    if summary.bytes_out > _BIG_OUTPUT:
        summary.warnings.append(
            f"the merged file is {summary.bytes_out / 1e9:.1f} GB: Perfetto's web UI may not load it "
            "(about 2 GB of memory); narrow it with --keep, --steps, --window or --ranks, or open it "
            "with trace_processor --httpd"
        )
    return summary


_SKIPPABLE = (TraceFormatError, TraceFileNotFoundError, MergeError, PermissionError)


def _manifest(files: list[InputFile], out: str, options: MergeOptions, ranks: Any, rank_regex: str,
              gzip_members: str, on_error: str, repair: bool, align: str, format: str) -> dict[str, Any]:
    """What the output was made from: inputs (size and etag or mtime), options, tool version; no credentials."""
    return {
        "tool": "tracefuse_dask",
        "version": __version__,
        "output": out,
        "inputs": [{"path": f.path, "size": f.size, "stamp": f.stamp, "rank": f.rank_hint if f.hint_source == "key"
                    else None} for f in files],
        "options": {**options.describe(), "ranks": ranks if ranks is None or isinstance(ranks, str)
                    else sorted(ranks), "rank_regex": rank_regex, "gzip_members": gzip_members,
                    "on_error": on_error, "repair": repair, "align": align, "format": format},
    }


def _unchanged(out: str, manifest: dict[str, Any], so: Mapping[str, Any]) -> MergeSummary | None:
    """The summary of a run that has nothing to do, or None when the output must be (re)built."""
    with storage_errors(out, so):
        fs, out_path = fsspec.core.url_to_fs(out, **options_for(out, so))
        try:
            previous = orjson.loads(fs.cat(out_path + MANIFEST_SUFFIX))
            size = fs.size(out_path)
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None
    if previous != orjson.loads(orjson.dumps(manifest)):
        return None
    return MergeSummary(ranks=len(manifest["inputs"]), skipped=[], events_in=0, events_out=0, bytes_in=0,
                        bytes_out=size, seconds=0.0, mb_per_s=0.0, output=out, status="unchanged",
                        warnings=[f"{out} is up to date: inputs, options and version as in "
                                  f"{out}{MANIFEST_SUFFIX}; nothing to do"])


def _outcomes(c: Client, futures: list[Any], show_progress: bool = False) -> list[tuple[Any, BaseException | None]]:
    """Each task's result or exception, in order; one gather, which waits for them all, for the successes.

    Everything goes through ``c``: the client need not be the process's default one.
    """
    if show_progress:
        with contextlib.redirect_stdout(sys.stderr):
            progress(futures, scheduler=c.scheduler.address)
    ok = iter(c.gather(futures, errors="skip"))
    return [(next(ok), None) if f.status == "finished"
            else (None, f.exception() if f.status == "error" else CancelledError(f"task {f.key} was cancelled"))
            for f in futures]


def _flat(outcomes: list[tuple[Any, BaseException | None]]) -> list[tuple[Any, BaseException | None]]:
    """Per-item outcomes from those of batch tasks; a batch task that failed as a whole raises its error."""
    flat: list[tuple[Any, BaseException | None]] = []
    for result, exc in outcomes:
        if exc is not None:
            raise exc
        flat.extend(result)
    return flat


def _settle(outcomes: list[tuple[Any, BaseException | None]], paths: list[str], ranks: list[int | None],
            on_error: str, skipped: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """Keep the successes; raise the first failure, or record the bad ranks with ``on_error="skip"``."""
    kept = []
    for k, ((result, exc), path, rank) in enumerate(zip(outcomes, paths, ranks)):
        if exc is None:
            kept.append((k, result))
        elif on_error == "skip" and isinstance(exc, _SKIPPABLE):
            skipped.append({"rank": rank, "path": path, "reason": str(exc)})
        else:
            raise exc
    return kept


def batches(sizes: list[int | None], limit: int = BATCH_BYTES) -> list[range]:
    """Consecutive items grouped into tasks of about ``limit`` input bytes (at most ``BATCH_RANKS`` items).

    A big rank gets a task of its own; small ones share, so that 10,000 tiny ranks do not
    cost 10,000 tasks. An unknown size counts as big. The grouping depends on the inputs
    alone, and does not change the output.
    """
    out: list[range] = []
    start = total = 0
    for i, size in enumerate(sizes):
        total += limit if size is None else size
        if total >= limit or i + 1 - start >= BATCH_RANKS:
            out.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def biggest_first(sizes: list[int | None]) -> list[int]:
    """The order to submit tasks of these input sizes in: biggest first (an unknown size counts as big, as in
    ``batches``), ties in their given order.

    Dask runs the tasks of one ``map`` in the order given; a big rank that started last would keep the
    other workers waiting for it at the end (longest-processing-time-first scheduling).
    """
    return sorted(range(len(sizes)), key=lambda k: (sizes[k] is not None, -(sizes[k] or 0)))


def _read_headers(files: list[InputFile], meta_path: str, storage_options: Mapping[str, Any] | None,
                  earliest: MergeOptions | None, repair: bool) -> list[tuple[RankHeader | None, BaseException | None]]:
    """Phase A task: the headers of several files, or why a file could not be read.

    The metadata each rank carries into the output (``_RANK_META``) goes to the file
    ``meta_path``, not to the client: a job of 10,000 ranks has 10,000 copies of its
    process groups, which can take gigabytes. A header holds where its text lies.
    """
    outcomes: list[tuple[RankHeader | None, BaseException | None]] = []
    with contextlib.ExitStack() as stack:
        fo = None
        for f in files:
            try:
                h, text = _slim(_read_header_rank(f, storage_options, earliest, repair))
            except _SKIPPABLE as e:
                outcomes.append((None, e))
                continue
            with _writing(meta_path), storage_errors(meta_path, storage_options):
                if fo is None:
                    fo = stack.enter_context(open_write(meta_path, storage_options))
                h.meta = (meta_path, fo.tell(), len(text))
                fo.write(text)
            outcomes.append((h, None))
    return outcomes


def _slim(h: RankHeader) -> tuple[RankHeader, bytes]:
    """Keep of the header only what the client reads, and return what the output's metadata holds as JSON text."""
    try:
        text = orjson.dumps({k: h.header.get(k) for k in _RANK_META})
    except TypeError as e:
        raise TraceFormatError(f"{h.path}: a header value cannot be written as JSON ({e}); fix the header or "
                               "drop this file") from None
    info = h.header.get("distributedInfo")
    h.header = {"distributedInfo": {k: info[k] for k in ("rank", "world_size") if k in info}} \
        if isinstance(info, dict) else {}
    return h, text


def _write_heads(jobs: list[tuple[str, bytes, list[tuple[int, str, int | None, tuple[str, int, int]]], bytes, bool]],
                 storage_options: Mapping[str, Any] | None) -> list[int]:
    """Task: write merged traces' headers, each to its own file; returns their sizes.

    A job is ``(dest, pre, ranks, post, compress)``: the header is ``pre``, then the
    ``"rank": {...}`` entries of the output's metadata, their text read from the files
    of Phase A in the order of ``ranks``, then ``post``; one gzip member with ``compress``.
    Jobs come in the order of those files, so each is opened once and read front to back.
    """
    sizes = []
    src_path, src = None, None
    try:
        for dest, pre, ranks, post, compress in jobs:
            with _writing(dest), storage_errors(dest, storage_options), \
                    open_write(dest, storage_options) as raw:
                out = gzip_writer(raw) if compress else raw
                out.write(pre)
                for i, (rank, source, base, (path, offset, length)) in enumerate(ranks):
                    with storage_errors(path, storage_options):
                        if path != src_path:
                            if src is not None:
                                src.close()
                            src_path, src = path, fsspec.open(path, "rb", **options_for(path, storage_options)).open()
                        src.seek(offset)
                        text = src.read(length)
                    out.write(b"".join([b"," if i else b"", b'"%d":' % rank,
                                        orjson.dumps({"source": source, "baseTimeNanoseconds": base})[:-1],
                                        b",", text[1:]]))
                out.write(post)
                if out is not raw:
                    out.close()  # the gzip trailer; raw stays open
                sizes.append(raw.tell())
    finally:
        if src is not None:
            src.close()
    return sizes


def _run(c: Client, files: list[InputFile], skipped_names: list[str], out: str, tmp_dir: str,
         options: MergeOptions, subset: Any, rank_regex: str, so: dict[str, Any], gzip_members: str,
         show_progress: bool, on_error: str, repair: bool, align: str, split: int, force: bool, fmt: str,
         futures: list[Any]) -> MergeSummary:
    warnings: list[str] = []
    ignored = [f"{p}: not a JSON trace by name, or written by tracefuse" for p in skipped_names]
    skipped: list[dict[str, Any]] = []
    earliest = None
    if options.window_ns is not None:
        earliest = MergeOptions(options.include_pyfunc, options.keep, options.steps, None, options.filter_fn)
    t0 = time.perf_counter()
    groups = [[files[i] for i in b] for b in batches([f.size for f in files], BATCH_BYTES)]
    metas = [f"{tmp_dir}/meta-{k:08d}.json" for k in range(len(groups))]
    keys = [f"tracefuse-header-{tokenize(g, so, earliest, repair, m)}" for g, m in zip(groups, metas)]
    futures[:] = c.map(_read_headers, groups, metas, storage_options=so, earliest=earliest, repair=repair, key=keys)
    read = _settle(_flat(_outcomes(c, futures)), [f.path for f in files], [f.rank_hint for f in files], on_error,
                   skipped)
    log.info("read %d headers in %.2f s", len(read), time.perf_counter() - t0)
    chosen, notes, more_ignored = _resolve_ranks([files[k] for k, _ in read], [h for _, h in read], rank_regex)
    warnings.extend(notes)
    ignored.extend(more_ignored)
    if subset is not None:
        chosen = [(r, h) for r, h in chosen if r in subset]
    if not chosen:
        raise RankError("no ranks left to merge after --ranks and skipping; check the inputs and --ranks")
    chosen.sort(key=lambda rh: rh[0])
    for (r1, h1), (r2, h2) in zip(chosen, chosen[1:]):
        if r1 == r2:
            raise RankError(f"rank {r1} appears twice: {h1.path} and {h2.path}; drop one, or give the files "
                            "as a {rank: path} dict")
    sizes = {h.world_size for _, h in chosen if h.world_size is not None}
    if len(sizes) > 1:
        by = {}
        for r, h in chosen:
            by.setdefault(h.world_size, f"rank {r} ({h.path})")
        raise RankError("the inputs come from jobs of different world sizes: "
                        + "; ".join(f"world_size {ws} in {w}" for ws, w in sorted(by.items(), key=str))
                        + ". Merge each job on its own")
    for _, h in chosen:
        if h.base is not None:
            _base_of(h.base, h.path)
        if h.repair_note:
            warnings.append(h.repair_note)
    headers = [h for _, h in chosen]
    warnings.extend(_assume_bases(chosen))
    if options.window_ns is not None or (any(h.base is not None for h in headers)
                                         and any(h.base is None for h in headers)):
        _fill_earliest(c, headers, so, earliest or MergeOptions(), repair, futures)
    base_out = _plan_bases(headers)
    offsets: dict[int, int] = {}
    if align == "collectives":
        offsets = _clock_offsets(c, chosen, so, warnings)
        base_out = min([base_out] + [(h.base or 0) - offsets.get(r, 0) for r, h in chosen])
    window_abs = None
    if options.window_ns is not None:
        t0s = [h.earliest_kept_ns for h in headers if h.earliest_kept_ns is not None]
        if not t0s:
            raise MergeError("no event passes the filters, so --window has no start; loosen the filters")
        t0 = min(t0s)
        window_abs = (t0 + options.window_ns[0], t0 + options.window_ns[1])
    gzip_out = out.endswith(".gz")
    compress = gzip_out and gzip_members == "rank" and fmt == "json"
    ext = ".json.gz" if compress else ".json"
    tasks = [RankTask(r, h.path, (h.base or 0) - offsets.get(r, 0), base_out, options, window_abs, compress, repair)
             for r, h in chosen]
    split_groups = _split_ranges(len(tasks), 1 if fmt == "perfetto-archive" else split)
    # An archive needs each rank's partition on its own; a split part, whole batches.
    limit = 0 if fmt == "perfetto-archive" else BATCH_BYTES
    by_path = {f.path: f.size for f in files}
    runs = [[tasks[part.start + i] for i in b] for part in split_groups
            for b in batches([by_path.get(tasks[k].path) for k in part], limit)]
    paths = [f"{tmp_dir}/part-{run[0].rank:08d}{ext}" for run in runs]
    keys = [f"tracefuse-rewrite-{tokenize(run, p, so, on_error)}" for run, p in zip(runs, paths)]
    t0 = time.perf_counter()
    run_sizes = [[by_path.get(t.path) for t in run] for run in runs]
    order = biggest_first([None if None in rs else sum(rs) for rs in run_sizes])
    got = c.map(_rewrite_batch, [runs[k] for k in order], [paths[k] for k in order], storage_options=so,
                skip=on_error == "skip", key=[keys[k] for k in order])
    futures[:] = [f for _, f in sorted(zip(order, got), key=lambda kf: kf[0])]  # back in rank order
    done = _settle(_flat(_outcomes(c, futures, show_progress)), [t.path for t in tasks], [t.rank for t in tasks],
                   on_error, skipped)
    if not done:
        raise MergeError("every rank failed; see the reasons above, fix or re-export the traces")
    results: list[RankResult] = [res for _, res in done]
    log.info("rewrote %d ranks in %d tasks in %.2f s", len(results), len(runs), time.perf_counter() - t0)
    seen = set(warnings)
    warnings.extend(dict.fromkeys(w for res in results for w in res.warnings if w not in seen))
    if sizes:
        (ws,) = sizes
        missing = sorted(set(range(ws)) - {r.rank for r in results} - {s["rank"] for s in skipped})
        if missing and subset is None:
            warnings.append(f"{len(missing)} of {ws} ranks missing: {_ranges(missing)}")
    sources = relative_sources([f.path for f in files])
    by_rank = dict(chosen)
    entries = {res.rank: (res.rank, sources[res.path], by_rank[res.rank].base, by_rank[res.rank].meta)
               for res in results}
    meta = {
        "version": __version__,
        "base_time_ns": base_out,
        "options": {**options.describe(), "align": align},
        "skipped": [{"rank": sk["rank"], "source": sources[sk["path"]],
                     "reason": sk["reason"].replace(sk["path"], sources[sk["path"]])} for sk in skipped],
    }
    if align == "collectives":
        meta["clock_offsets_ns"] = {str(r): v for r, v in sorted(offsets.items())}
    parts = _split_parts(out, results, [tasks[g[-1]].rank for g in split_groups])
    t0 = time.perf_counter()
    futures.clear()
    if fmt == "perfetto-archive":
        jobs = [_head_job(f"{tmp_dir}/head-{r.rank:08d}.json", base_out, meta, [r], entries, False) for r in results]
        heads: list[Piece] = [(job[0], size) for job, size in zip(jobs, _heads(c, jobs, so, futures))]
        bytes_out = _assemble(c, out, tmp_dir, _archive_pieces(results, meta, heads), gzip_out, so, futures)
    else:
        bytes_out = _assemble_parts(c, parts, meta, entries, base_out, tmp_dir, gzip_out,
                                    gzip_out and gzip_members == "single", so, force, futures)
    log.info("wrote %s (%d bytes) in %.2f s", ", ".join(o for o, _ in parts), bytes_out, time.perf_counter() - t0)
    return MergeSummary(
        ranks=len(results),
        skipped=skipped,
        events_in=sum(r.events_in for r in results),
        events_out=sum(r.events_out for r in results),
        bytes_in=sum(r.bytes_in for r in results),
        bytes_out=bytes_out,
        seconds=0.0,
        mb_per_s=0.0,
        output=parts[0][0],
        status="ok",
        warnings=warnings,
        ignored=ignored,
        rank_list=[r.rank for r in results],
        outputs=[o for o, _ in parts],
    )


def split_name(out: str, first: int, last: int, width: int) -> str:
    """The part of ``out`` with ranks ``first`` to ``last``: ``m.json.gz`` gives ``m.ranks-000-127.json.gz``."""
    for ext in (".json.gz", ".json", ".gz"):
        if out.endswith(ext):
            return f"{out[:-len(ext)]}.ranks-{first:0{width}d}-{last:0{width}d}{ext}"
    return f"{out}.ranks-{first:0{width}d}-{last:0{width}d}"


def _split_ranges(n: int, split: int) -> list[range]:
    """``split`` contiguous ranges of ``n`` ranks, of as even sizes as can be (at most ``n`` of them)."""
    k = min(split, n)
    bounds = [n * j // k for j in range(k + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _split_parts(out: str, results: list[RankResult], lasts: list[int]) -> list[tuple[str, list[RankResult]]]:
    """The output name and results of each part: one part, or those of ``--split`` that end at the ranks ``lasts``."""
    if len(lasts) == 1:
        return [(out, results)]
    width = len(str(results[-1].rank))
    parts: list[list[RankResult]] = [[] for _ in lasts]
    k = 0
    for r in results:  # both in rank order
        while r.rank > lasts[k]:
            k += 1
        parts[k].append(r)
    return [(split_name(out, p[0].rank, p[-1].rank, width), p) for p in parts if p]


def _pieces(results: list[RankResult]) -> list[Piece]:
    """The partition files of ``results``, in order; the ranks of a batch share one file."""
    pieces: list[Piece] = []
    for r in results:
        if not r.part_bytes:
            continue
        if pieces and pieces[-1][0] == r.part_path:  # type: ignore[index]
            pieces[-1] = (r.part_path, pieces[-1][1] + r.part_bytes)  # type: ignore[index]
        else:
            pieces.append((r.part_path, r.part_bytes))
    return pieces


def _assemble_parts(c: Client, parts: list[tuple[str, list[RankResult]]], meta: dict[str, Any],
                    entries: dict[int, Any], base_out: int, tmp_dir: str, gzip_out: bool, single_member: bool,
                    so: dict[str, Any], force: bool, futures: list[Any]) -> int:
    """Write each part's header and partitions; with several parts, none is left behind when one fails."""
    if len(parts) > 1:
        for o, _ in parts:
            with storage_errors(o, so):
                fs, path = fsspec.core.url_to_fs(o, **options_for(o, so))
                if fs.exists(path) and not force:
                    raise OutputExistsError(f"{o}: the output exists; pass --force (force=True) to replace it")
    compress = gzip_out and not single_member
    ext = ".json.gz" if compress else ".json"
    jobs = []
    for k, (o, group) in enumerate(parts):
        part_meta = dict(meta)
        if len(parts) > 1:
            part_meta["split"] = {"part": k + 1, "of": len(parts), "first_rank": group[0].rank,
                                  "last_rank": group[-1].rank, "files": [p.rsplit("/", 1)[-1] for p, _ in parts]}
        jobs.append(_head_job(f"{tmp_dir}/head-{k:06d}{ext}", base_out, part_meta, group, entries, compress))
    heads = _heads(c, jobs, so, futures)
    written: list[str] = []
    total = 0
    try:
        for k, (o, group) in enumerate(parts):
            pieces: list[Piece] = ([(jobs[k][0], heads[k])] + _pieces(group)
                                   + [gzip_member(_FOOT) if compress else _FOOT])
            part_tmp = tmp_dir if len(parts) == 1 else f"{tmp_dir}/split-{k:06d}"
            if len(parts) > 1:
                with storage_errors(part_tmp, so):
                    fs, tmp_path = fsspec.core.url_to_fs(part_tmp, **options_for(o, so))
                    fs.makedirs(tmp_path, exist_ok=True)
            written.append(o)
            total += _assemble(c, o, part_tmp, pieces, single_member, so, futures)
    except BaseException:
        if len(parts) > 1:
            for o in written:
                with contextlib.suppress(Exception), storage_errors(o, so):
                    fs, path = fsspec.core.url_to_fs(o, **options_for(o, so))
                    abort_uploads(fs, path, path + TMP_SUFFIX)
                    if fs.exists(path):
                        fs.rm(path)
        raise
    return total


def _head_job(dest: str, base_out: int, meta: dict[str, Any], results: list[RankResult], entries: dict[int, Any],
              compress: bool) -> tuple[str, bytes, list[Any], bytes, bool]:
    """A ``_write_heads`` job: the header of a merged trace of ``results``, up to its first events."""
    pre = b"".join([b'{"schemaVersion":1,"displayTimeUnit":"ms","baseTimeNanoseconds":', str(base_out).encode(),
                    b',"metadata":{"tracefuse":', orjson.dumps(meta)[:-1], b',"ranks":{'])
    post = b"".join([b'}}},"traceEvents":[\n', _SEP.join(r.head for r in results if r.head)])
    ranks = sorted((entries[r.rank] for r in results), key=lambda e: e[3])  # in the order of Phase A's files
    return dest, pre, ranks, post, compress


def _heads(c: Client, jobs: list[tuple[str, bytes, list[Any], bytes, bool]], so: dict[str, Any],
           futures: list[Any]) -> list[int]:
    """Write the headers of ``jobs`` in tasks of at most ``BATCH_RANKS`` ranks each; their sizes, in order.

    The tasks take the jobs in the order of Phase A's files, which each task then reads front to back.
    """
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][2][0][3] if jobs[i][2] else ("", 0, 0))
    chunks: list[list[Any]] = []
    n = BATCH_RANKS
    for job in (jobs[i] for i in order):
        if n + len(job[2]) > BATCH_RANKS:
            chunks.append([])
            n = 0
        chunks[-1].append(job)
        n += len(job[2])
    keys = [f"tracefuse-head-{tokenize(ch, so)}" for ch in chunks]
    # Big headers are scattered, not put in the graph (10,000 ranks have tens of MB of process metadata
    # events); small ones go with their tasks, which saves the scatter's round trip.
    small = sum(len(dest) + len(pre) + 64 * len(ranks) + len(post)
                for dest, pre, ranks, post, _ in jobs) < _INLINE_HEADS
    got = c.map(_write_heads, chunks if small else c.scatter(chunks), storage_options=so, key=keys)
    futures.extend(got)
    sizes = [0] * len(jobs)
    for i, size in zip(order, (size for fut in got for size in fut.result())):
        sizes[i] = size
    return sizes


def archive_member(rank: int) -> str:
    """The name of a rank's trace inside a perfetto archive: ``rank-00003.json``."""
    return f"rank-{rank:05d}.json"


def _perfetto_manifest(results: list[RankResult], meta: dict[str, Any]) -> bytes:
    """The ``perfetto_manifest.json`` that merges the archive's rank traces on one timeline.

    Format: https://perfetto.dev/docs/reference/perfetto-manifest and docs/analysis/merging-traces.md (v58+).
    Each rank is its own machine (``rank-3``), so its processes stay apart. Perfetto treats
    JSON as clockless (a private per-file timeline; ``baseTimeNanoseconds`` is ignored), and
    every member's times are already rewritten onto the merge's one base, so each file is
    pinned to the first file's timeline at ``offset_ns`` 0: the raw-file offset
    ``base_r - base_0`` (spec §3) and any ``--align collectives`` shift are already applied.
    """
    first = archive_member(results[0].rank)
    files: list[dict[str, Any]] = []
    for r in results:
        entry: dict[str, Any] = {"path": archive_member(r.rank), "machine": {"name": f"rank-{r.rank}"}}
        if entry["path"] != first:
            entry["clocks"] = {"sync_to": {"file": first}, "offset_ns": 0}
        files.append(entry)
    attributes = {"tracefuse.version": meta["version"], "tracefuse.base_time_ns": meta["base_time_ns"]}
    return orjson.dumps({"perfetto_manifest": {"version": 1, "files": files, "attributes": attributes}},
                        option=orjson.OPT_INDENT_2) + b"\n"


def _archive_pieces(results: list[RankResult], meta: dict[str, Any], heads: list[Piece]) -> list[Piece]:
    """The bytes of a TAR of ``perfetto_manifest.json`` and one complete JSON trace per rank, as pieces.

    Members come in a fixed order (the manifest, then ranks ascending) with fixed headers
    (mtime 0, uid/gid 0, mode 0644, no user names). GNU format, because Perfetto's TAR reader
    takes its base-256 sizes (members over 8 GiB) but not pax headers.
    """
    members: list[tuple[str, list[Piece]]] = [(PERFETTO_MANIFEST, [_perfetto_manifest(results, meta)])]
    for r, head in zip(results, heads):
        body: list[Piece] = [(r.part_path, r.part_bytes)] if r.part_bytes else []
        members.append((archive_member(r.rank), [head, *body, _FOOT]))
    pieces: list[Piece] = []
    pending = b""
    offset = 0
    for name, parts in members:
        info = tarfile.TarInfo(name)
        info.size = sum(len(p) if isinstance(p, bytes) else p[1] for p in parts)
        info.mtime, info.mode = 0, 0o644  # uid and gid 0, no user names: TarInfo's defaults
        pending += info.tobuf(tarfile.GNU_FORMAT, "utf-8", "strict")
        for p in parts:
            if isinstance(p, bytes):
                pending += p
            else:
                if pending:
                    pieces.append(pending)
                pieces.append(p)
                pending = b""
        pad = -info.size % tarfile.BLOCKSIZE
        pending += bytes(pad)
        offset += tarfile.BLOCKSIZE + info.size + pad
    end = 2 * tarfile.BLOCKSIZE  # two zero blocks, then zeros up to a whole record, as tar ends an archive
    pieces.append(pending + bytes(end + (-(offset + end)) % tarfile.RECORDSIZE))
    return pieces


def _clock_offsets(c: Client, chosen: list[tuple[int, RankHeader]], so: dict[str, Any],
                   warnings: list[str]) -> dict[int, int]:
    """Each rank's clock offset in ns (what to subtract), from an analysis of its collectives."""
    from .analysis import analyze

    summary = analyze({r: h.path for r, h in chosen}, client=c, storage_options=so).summary
    offsets = {int(r): round(us * 1000) for r, us in summary["clock_offset_us"].items()}
    if not offsets:
        warnings.append(f"--align collectives: {summary['clock_note']}; kept base-time alignment")
    elif missing := sorted(r for r, _ in chosen if r not in offsets):
        warnings.append(f"--align collectives: no GPU collective links rank(s) {_ranges(missing)} to rank "
                        f"{min(offsets)}; their clocks were not corrected")
    for r, off in sorted(offsets.items()):
        if off:
            spread = summary["clock_offset_spread_us"][str(r)]
            warnings.append(f"--align collectives: rank {r} shifted by {-off / 1000:+,.3f} µs (spread {spread} µs)")
    return offsets


def _assume_bases(chosen: list[tuple[int, RankHeader]]) -> list[str]:
    """Give a repaired rank that lost its base (cut before it) the job's base, and say so."""
    bases = sorted(h.base for _, h in chosen if h.base is not None)
    notes = []
    for r, h in chosen:
        if h.relative_times and h.base is None:
            if bases:
                h.base = bases[0]
                notes.append(f"rank {r} ({h.path}): baseTimeNanoseconds came after the cut; assumed the "
                             f"earliest base of the other ranks, {h.base}")
            else:
                notes.append(f"rank {r} ({h.path}): baseTimeNanoseconds came after the cut and no other rank has "
                             "one; its times are kept relative, so they will not line up with absolute ones")
        if h.repair_note and not isinstance((h.header.get("distributedInfo") or {}).get("rank"), int):
            notes.append(f"rank {r} ({h.path}): distributedInfo came after the cut (or is missing); the rank "
                         "was taken from the file name or list position")
    return notes


def _fill_earliest(c: Client, headers: list[RankHeader], so: dict[str, Any], opts: MergeOptions, repair: bool,
                   futures: list[Any]) -> None:
    todo = [h for h in headers if h.earliest_ns is None]
    files = [InputFile(h.path) for h in todo]
    keys = [f"tracefuse-earliest-{tokenize(f, so, opts, repair)}" for f in files]
    futures[:] = c.map(_earliest, files, storage_options=so, earliest=opts, repair=repair, key=keys)
    for h, got in zip(todo, c.gather(futures)):
        h.earliest_ns, h.earliest_kept_ns = got


def _earliest(f: InputFile, storage_options: Mapping[str, Any] | None, earliest: MergeOptions,
              repair: bool) -> tuple[int | None, int | None]:
    """Task: a rank's earliest event, over all events and over those kept (nothing else of its header)."""
    h = _read_header_rank(f, storage_options, earliest, repair)
    return h.earliest_ns, h.earliest_kept_ns


def _ranges(values: list[int]) -> str:
    out: list[str] = []
    start = prev = values[0]
    for v in values[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)
