"""The merge's plan: the request checked before any IO, then the header pass (Phase A) and the one
cross-rank reduce, which fix the ranks, their time bases and the rank tasks in a frozen ``MergePlan``.

Phase A reads each rank's header in a task and returns a ``RankHeader``; the metadata a rank
carries into the output goes to a file next to the output, not to the client. The client reduces
the headers into the plan, the only cross-rank state of a merge.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
from dask.base import tokenize
from distributed import Client

from ..cluster import BATCH_BYTES, batches, flat, outcomes
from ..errors import SKIPPABLE, MergeError, RankError, TraceFormatError, skipped_rank
from ..kineto.array_form import COMPOSER_KEYS, COMPOSER_MERGED, MERGED_BY_COMPOSER
from ..kineto.document import check_document, paused_gc
from ..kineto.events import RankEvents
from ..kineto.layout import is_merged
from ..model import (
    KEEP_PRESETS,
    InputFile,
    Marks,
    MergeOptions,
    PortableFilter,
    RankHeader,
    RankSet,
    RankTask,
    parse_steps,
    parse_window,
    ranges,
    rank_subset,
)
from ..storage.files import parse_json, read_header, retry_unreachable, storage_errors
from ..storage.inputs import resolve_rank
from ..storage.output import open_write, writing

__all__ = ["RANK_META", "UI_LIMIT", "MergeNotes", "MergePlan", "MergeRequest", "base_of", "build_options", "plan_merge",
           "settle", "split_ranges"]

log = logging.getLogger("tracefuse_dask")

# auto: Composer's clock sync when every rank carries it (``_clock_sync``), else the base times
ALIGN = ("auto", "base", "clock-sync", "collectives")

# What estimates each rank's clock offset for ``align="collectives"``: ``(client, {rank: path}, storage_options)``
# to a summary with ``clock_offset_us``, ``clock_offset_spread_us`` and ``clock_note``, as ``analyze`` gives it.
ClockEstimate = Callable[[Client, dict[int, str], dict[str, Any]], dict[str, Any]]

# What computes one device's counter series for ``counters``: the analysis's ``analysis.per_rank.counters.counter_series``, which
# ``api`` hands in (``RankTask.counter_series``), so that the tracks follow the analysis's definitions.
CounterSeries = Callable[..., tuple[Any, Any]]


@dataclass(frozen=True)
class MergeRequest:
    """What a merge was asked to do, checked on creation: the output, the filters (``build_options``) and every
    other choice of ``merge_traces``, before any IO.

    Raises
    ------
    MergeError
        On a choice that is unknown, malformed or that does not go with another.
    """

    out: str
    options: MergeOptions
    storage_options: dict[str, Any]
    ranks: Any  # as given: the manifest records it
    rank_regex: str
    gzip_members: str
    on_error: str
    repair: bool
    align: str
    split: int | None
    format: str
    force: bool
    skip_if_unchanged: bool
    show_progress: bool
    marks: Mapping[int, Marks] | None = None  # events to add to some ranks' (``Marks``); json format only
    counter_series: CounterSeries | None = None  # needed by ``options.counters``
    subset: RankSet | None = field(init=False)

    def __post_init__(self) -> None:
        out, split, fmt = self.out, self.split, self.format
        if self.gzip_members not in ("rank", "single"):
            raise MergeError(f"gzip_members={self.gzip_members!r}; use 'rank' or 'single'")
        if self.on_error not in ("raise", "skip"):
            raise MergeError(f"on_error={self.on_error!r}; use 'raise' or 'skip'")
        if self.align not in ALIGN:
            raise MergeError(f"align={self.align!r}; use one of {', '.join(map(repr, ALIGN))}")
        if split is not None and (type(split) is not int or split < 1):
            raise MergeError(f"split={split!r}; give the number of output files, 1 or more")
        if fmt not in ("json", "perfetto-archive"):
            raise MergeError(f"format={fmt!r}; use 'json' or 'perfetto-archive'")
        if fmt == "perfetto-archive" and not out.endswith((".tar", ".tar.gz")):
            raise MergeError(f"{out}: --format perfetto-archive writes a TAR archive; name the output .tar, or "
                             ".tar.gz to gzip it")
        if fmt == "perfetto-archive" and split and split > 1:
            raise MergeError("--split writes several merged JSON traces, and a perfetto archive already holds one "
                             "trace per rank; drop --split or --format perfetto-archive")
        if self.options.counters and self.counter_series is None:
            raise MergeError("counters=True needs the analysis's counter series (counter_series); merge through "
                             "tracefuse_dask.merge_traces, which passes them")
        if self.marks is not None and (fmt != "json" or (split and split > 1)):
            raise MergeError("marks go into one merged JSON trace; drop --split and --format perfetto-archive")
        if split and split > 1 and self.skip_if_unchanged:
            raise MergeError("--skip-if-unchanged works with one output file; drop --split or --skip-if-unchanged")
        try:
            object.__setattr__(self, "subset", rank_subset(self.ranks))
        except ValueError as e:
            raise MergeError(str(e)) from None
        object.__setattr__(self, "split", split or 1)


@dataclass(frozen=True)
class MergePlan:
    """A merge after its header pass: the inputs, the chosen ranks in order, the time base and the rank tasks.

    Every later phase (the rewrite, the assembly) is a function of the plan.
    """

    request: MergeRequest
    files: list[InputFile]
    tmp_dir: str  # this run's own folder beside the output (``storage.runs.run_folder``)
    ranks: list[tuple[int, RankHeader]]
    world_size: int | None
    base_out: int
    alignment: str  # what aligned the ranks: "base", "clock-sync" or "collectives"
    clock_offsets: dict[int, int]
    tasks: list[RankTask]
    split_groups: list[range]  # the tasks of each output file


@dataclass
class MergeNotes:
    """What a merge has to tell, gathered across its phases."""

    warnings: list[str] = field(default_factory=list)  # what needs the user's attention
    notes: list[str] = field(default_factory=list)  # what was done as asked, worth saying
    ignored: list[str] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)


RANK_META = ("distributedInfo", "deviceProperties", "host_name")  # per rank in the output's metadata
UI_LIMIT = 1_500_000_000  # bytes of JSON that Perfetto's web UI opens (it has about 2 GB of memory)


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
    counters: bool = False,
    keep_overlaps: bool = False,
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
                        annotate_rank, counters, keep_overlaps)


def plan_merge(c: Client, request: MergeRequest, files: list[InputFile], unlisted: list[str], tmp_dir: str,
               estimate: ClockEstimate | None, notes: MergeNotes, futures: list[Any]) -> MergePlan:
    """Phase A and the reduce: read the headers, choose and check the ranks, fix the time base and the tasks.

    ``unlisted`` are the names ``expand_inputs`` passed over; ``estimate`` serves ``align="collectives"``.
    """
    options, so, repair = request.options, request.storage_options, request.repair
    notes.ignored.extend(f"{p}: not a JSON trace by name, or written by tracefuse" for p in unlisted)
    earliest = None
    if options.window_ns is not None:
        earliest = MergeOptions(options.include_pyfunc, options.keep, options.steps, None, options.filter_fn)
    t0 = time.perf_counter()
    groups = [[files[i] for i in b] for b in batches([f.trace_bytes for f in files], BATCH_BYTES)]
    metas = [f"{tmp_dir}/meta-{k:08d}.json" for k in range(len(groups))]
    keys = [f"tracefuse-header-{tokenize(g, so, earliest, repair, m)}" for g, m in zip(groups, metas)]
    futures[:] = c.map(_read_headers, groups, metas, storage_options=so, earliest=earliest, repair=repair, key=keys)
    read = settle(flat(outcomes(c, futures)), [f.path for f in files], [f.rank_hint for f in files],
                  request.on_error, notes.skipped)
    log.info("read %d headers in %.2f s", len(read), time.perf_counter() - t0)
    chosen, resolve_notes, more_ignored = _resolve_ranks([files[k] for k, _ in read], [h for _, h in read],
                                                         request.rank_regex)
    notes.warnings.extend(resolve_notes)
    notes.ignored.extend(more_ignored)
    if request.subset is not None:
        chosen = [(r, h) for r, h in chosen if r in request.subset]
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
            base_of(h.base, h.path)
        if h.repair_note:
            notes.warnings.append(h.repair_note)
    headers = [h for _, h in chosen]
    notes.warnings.extend(_assume_bases(chosen))
    if options.window_ns is not None or (any(h.base is not None for h in headers)
                                         and any(h.base is None for h in headers)):
        _fill_earliest(c, headers, so, earliest or MergeOptions(), repair, futures)
    base_out = _plan_bases(headers)
    offsets: dict[int, int] = {}
    alignment = "base"
    if request.align == "collectives":
        if estimate is None:
            raise MergeError("align='collectives' needs a clock estimate; call tracefuse_dask.merge_traces")
        offsets = _clock_offsets(estimate(c, {r: h.path for r, h in chosen}, so), chosen, notes.warnings)
        alignment = "collectives"
    elif request.align in ("auto", "clock-sync"):
        offsets = _clock_sync(chosen, request.align == "clock-sync", notes)
        alignment = "clock-sync" if offsets else "base"
    if offsets:  # a rank without a base keeps absolute times, which a shift of seconds leaves positive
        base_out = min([base_out] + [h.base - offsets.get(r, 0) for r, h in chosen if h.base is not None])
    window_abs = None
    if options.window_ns is not None:
        t0s = [h.earliest_kept_ns - offsets.get(r, 0) for r, h in chosen if h.earliest_kept_ns is not None]
        if not t0s:
            raise MergeError("no event passes the filters, so --window has no start; loosen the filters")
        start = min(t0s)
        window_abs = (start + options.window_ns[0], start + options.window_ns[1])
    compress = request.out.endswith(".gz") and request.gzip_members == "rank" and request.format == "json"
    marks = request.marks or {}
    series = request.counter_series if options.counters else None
    sizes_in = {f.path: f.trace_bytes or 0 for f in files}
    estimate = not options.keep and sum(sizes_in.get(h.path, 0) for _, h in chosen) > UI_LIMIT
    tasks = [RankTask(r, h.path, (h.base or 0) - offsets.get(r, 0), base_out, options, window_abs, compress, repair,
                      marks.get(r), series, estimate) for r, h in chosen]
    split_groups = split_ranges(len(tasks), 1 if request.format == "perfetto-archive" else request.split)
    return MergePlan(request, files, tmp_dir, chosen, next(iter(sizes), None), base_out, alignment, offsets, tasks,
                     split_groups)


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
    if COMPOSER_MERGED in doc:
        return RankHeader(f.path, None, None, None, {}, is_merged=True, merged_by="Composer", full_read=True)
    header = {k: v for k, v in doc.items() if k != "traceEvents"}
    merged = is_merged(header.get("metadata"))
    base = header.get("baseTimeNanoseconds")
    h = RankHeader(f.path, None, None, base, header, is_merged=merged, full_read=True, bytes_in=nbytes,
                   repair_note=note)
    if note and base is None:
        h.relative_times = any(type(ev) is dict and isinstance(ev.get("ts"), (int, float)) and ev["ts"] < 1e14
                               for ev in doc["traceEvents"][:1000])
    if earliest is not None and not merged:
        sel = RankEvents(doc["traceEvents"], base_of(base, f.path), earliest, f.path)
        h.earliest_ns = sel.earliest_ns(kept_only=False)
        h.earliest_kept_ns = sel.earliest_ns(kept_only=True)
    return h


def base_of(base: Any, path: str) -> int:
    """A file's ``baseTimeNanoseconds`` (0 when it has none), checked."""
    if base is None:
        return 0
    if type(base) is not int or base < 0:
        raise TraceFormatError(f"{path}: baseTimeNanoseconds={base!r} is not a non-negative integer")
    return base


def _resolve_ranks(
    files: list[InputFile], headers: list[RankHeader], rank_regex: str
) -> tuple[list[tuple[int, RankHeader]], list[str], list[str]]:
    chosen: list[tuple[int, RankHeader]] = []
    notes: list[str] = []
    ignored: list[str] = []
    for f, h in zip(files, headers):
        if h.is_merged:
            what = MERGED_BY_COMPOSER if h.merged_by == "Composer" else "a merged trace written by tracefuse"
            if f.listed:
                ignored.append(f"{f.path}: {what}")
                continue
            raise TraceFormatError(f"{f.path}: this is {what}, not a per-rank trace; pass the original per-rank "
                                   "files instead")
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


def settle(outcomes: list[tuple[Any, BaseException | None]], paths: list[str], ranks: list[int | None],
            on_error: str, skipped: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """Keep the successes; raise the first failure, or record the bad ranks with ``on_error="skip"``."""
    kept = []
    for k, ((result, exc), path, rank) in enumerate(zip(outcomes, paths, ranks)):
        if exc is None:
            kept.append((k, result))
        else:
            skipped.append(skipped_rank(exc, rank, path, on_error))
    return kept


@retry_unreachable
def _read_headers(files: list[InputFile], meta_path: str, storage_options: Mapping[str, Any] | None,
                  earliest: MergeOptions | None, repair: bool) -> list[tuple[RankHeader | None, BaseException | None]]:
    """Phase A task: the headers of several files, or why a file could not be read.

    The metadata each rank carries into the output (``RANK_META``) goes to the file
    ``meta_path``, not to the client: a job of 10,000 ranks has 10,000 copies of its
    process groups, which can take gigabytes. A header holds where its text lies.
    """
    outcomes: list[tuple[RankHeader | None, BaseException | None]] = []
    with contextlib.ExitStack() as stack:
        fo = None
        for f in files:
            try:
                h, text = _slim(_read_header_rank(f, storage_options, earliest, repair))
            except SKIPPABLE as e:
                outcomes.append((None, e))
                continue
            with writing(meta_path), storage_errors(meta_path, storage_options):
                if fo is None:
                    fo = stack.enter_context(open_write(meta_path, storage_options))
                h.meta = (meta_path, fo.tell(), len(text))
                fo.write(text)
            outcomes.append((h, None))
    return outcomes


def _slim(h: RankHeader) -> tuple[RankHeader, bytes]:
    """Keep of the header only what the client reads, and return what the output's metadata holds as JSON text."""
    try:
        text = orjson.dumps({k: h.header.get(k) for k in RANK_META})
    except TypeError as e:
        raise TraceFormatError(f"{h.path}: a header value cannot be written as JSON ({e}); fix the header or "
                               "drop this file") from None
    info = h.header.get("distributedInfo")
    slim = {"distributedInfo": {k: info[k] for k in ("rank", "world_size") if k in info}} \
        if isinstance(info, dict) else {}
    h.header = slim | {k: h.header[k] for k in COMPOSER_KEYS if k in h.header}
    return h, text


def split_ranges(n: int, split: int) -> list[range]:
    """``split`` contiguous ranges of ``n`` ranks, of as even sizes as can be (at most ``n`` of them)."""
    k = min(split, n)
    bounds = [n * j // k for j in range(k + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _clock_offsets(summary: dict[str, Any], chosen: list[tuple[int, RankHeader]],
                   warnings: list[str]) -> dict[int, int]:
    """Each rank's clock offset in ns (what to subtract), from the estimate's ``summary``; what was done, in
    ``warnings``."""
    offsets = {int(r): round(us * 1000) for r, us in summary["clock_offset_us"].items()}
    if not offsets:
        warnings.append(f"--align collectives: {summary['clock_note']}; kept base-time alignment")
    elif missing := sorted(r for r, _ in chosen if r not in offsets):
        warnings.append(f"--align collectives: no GPU collective links rank(s) {ranges(missing)} to rank "
                        f"{min(offsets)}; their clocks were not corrected")
    for r, off in sorted(offsets.items()):
        if off:
            spread = summary["clock_offset_spread_us"][str(r)]
            warnings.append(f"--align collectives: rank {r} shifted by {-off / 1000:+,.3f} µs (spread {spread} µs)")
    return offsets


def _clock_sync(chosen: list[tuple[int, RankHeader]], required: bool, notes: MergeNotes) -> dict[int, int]:
    """Each rank's clock offset in ns (what to subtract) from Composer's clock sync, as its merger shifts: by
    the lowest rank's ``clock_sync_timestamp_us`` less the rank's own; {} when the ranks do not all carry one
    (with ``required``, an error). What was done is a note; a warning when only some ranks carry one, or when
    the largest ``clock_sync_error_bound`` is larger than the largest shift (the shifts are within the sync's
    error)."""
    warnings = notes.warnings
    stamps = {r: h.header.get("clock_sync_timestamp_us") for r, h in chosen}
    have = {r: v for r, v in stamps.items() if type(v) is int or type(v) is float}
    what = "--align clock-sync" if required else "clock sync"
    if len(stamps) == 1 and have:
        return dict.fromkeys(have, 0) if required else {}  # one rank: nothing to align it with
    if len(have) < len(stamps):
        if not have and not required:
            return {}
        lack = f"rank(s) {ranges(sorted(set(stamps) - set(have)))} carry no clock_sync_timestamp_us"
        if required:
            raise MergeError(f"--align clock-sync: {lack} (Composer's JSONTraceHandler writes it); merge only "
                             "Composer traces of one job, or use --align base")
        warnings.append(f"{what}: {lack} and rank(s) {ranges(sorted(have))} do; aligned every rank by its base "
                        "time alone, not a mix of the two; drop the ranks without it to align by Composer's "
                        "clock sync, or pass --align base to choose base times")
        return {}
    ref = min(have)
    offsets = {r: round((v - have[ref]) * 1000) for r, v in have.items()}
    bounds = [b for _, h in chosen if type(b := h.header.get("clock_sync_error_bound")) in (int, float)]
    largest = max(offsets.values(), key=abs)
    text = (f"{what}: aligned {len(offsets):,} ranks by Composer's clock_sync_timestamp_us to rank {ref}, as its "
            f"merger does: largest shift {-largest / 1000:+,.3f} µs; largest clock_sync_error_bound "
            + (f"{max(bounds):,} µs" if bounds else "not given"))
    if bounds and max(bounds) * 1000 > abs(largest):
        warnings.append(f"{text}: the shifts are within the clock sync's error bound, so the ranks may still be "
                        f"up to {max(bounds):,} µs apart")
    else:
        notes.notes.append(text)
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
        if h.repair_note and not isinstance((h.header.get("distributedInfo") or {}).get("rank"), int) \
                and not isinstance(h.header.get("global_rank"), int):
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


@retry_unreachable
def _earliest(f: InputFile, storage_options: Mapping[str, Any] | None, earliest: MergeOptions,
              repair: bool) -> tuple[int | None, int | None]:
    """Task: a rank's earliest event, over all events and over those kept (nothing else of its header)."""
    h = _read_header_rank(f, storage_options, earliest, repair)
    return h.earliest_ns, h.earliest_kept_ns


