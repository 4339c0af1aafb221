"""``tracefuse index``: the merge's plan and rank tasks, writing each rank's events as Parquet parts of a store
(``schema.py``) instead of a merged trace; then the manifest, last.

Every rank task parses its file once, applies the merge's filters, pids, tids and ids (``merge.rewrite``), and
writes its own part under a name that hashes what it was made from; the client never holds events. The manifest,
one object written last, lists the complete parts: a reader sees the store before or after a run, never during.
Runs that index one store at once each write their own parts (identical inputs give identical parts, under the
same name) and each its whole manifest; the last one stands. A run removes the parts no manifest lists only when
no other run of the store is alive (``storage.runs.alone``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import msgspec
import orjson
import pyarrow.parquet as pq
from dask.base import tokenize
from distributed import Client

from .._version import __version__
from ..cluster import BATCH_BYTES, batches, biggest_first, connect, flat, outcomes
from ..errors import (
    SKIPPABLE,
    MergeError,
    OutputExistsError,
    OutputWriteError,
    every_rank_failed,
)
from ..info import figures_of_dicts, figures_of_structs
from ..kineto.document import check_document, decode_json, paused_gc
from ..kineto.events import RankEvents
from ..kineto.layout import map_tid, out_pid
from ..kineto.times import to_ns
from ..merge.fastpath import handles, rewritten_fast
from ..merge.manifest import manifest_of
from ..merge.plan import (
    RANK_META,
    ClockEstimate,
    MergeNotes,
    MergePlan,
    MergeRequest,
    base_of,
    build_options,
    plan_merge,
    settle,
)
from ..merge.rewrite import order_slots, rewrite
from ..model import InputFile, MergeSummary, RankTask
from ..storage.files import options_for, read_bytes, retry_unreachable, storage_errors
from ..storage.inputs import expand_inputs, resolve_rank
from ..storage.output import put_whole
from ..storage.runs import alone, run_folder
from . import MANIFEST
from .columns import fields_of_dicts, fields_of_structs, joined, rank_tables
from .schema import ORIGINS, PART_TABLES, SCHEMA_VERSION

__all__ = ["AnalysisStore", "analysis_store", "index", "part_of_analysis"]

log = logging.getLogger("tracefuse_dask")

# Columns that mostly grow from row to row: stored as deltas, a third of their size as dictionaries (2.6x smaller
# parts on hta_negative_queue_length's rank; zstd level 9 costs 5% of its indexing over level 1, and saves 10%)
_DELTA = ("ts_ns", "correlation", "external_id", "id")


@dataclass
class IndexedRank:
    """What a rank task returns: where its part is and small facts, never events."""

    rank: int
    path: str
    part: str  # the part's folder, relative to the store
    events_in: int
    rows: dict[str, int]  # per table
    bytes_in: int
    bytes_out: int
    host: str | None
    device: str | None
    info: dict[str, Any]  # ``tracefuse info``'s row of the rank's trace, but its path and sizes
    warnings: list[str] = dataclasses.field(default_factory=list)


@functools.cache
def _code() -> str:
    """A hash of the code whose changes change a part's bytes or its manifest entry (the rewrite rules, the columns,
    info's figures): a part written by other code is never reused, whatever the tool's version says."""
    from .. import info
    from ..kineto import events, times, vocabulary
    from ..merge import fastpath
    from ..merge import rewrite as rules
    from . import columns, schema

    return tokenize(*(Path(m.__file__).read_bytes() for m in (events, times, vocabulary, fastpath, rules, columns,
                                                              schema, info, sys.modules[__name__])))


PART = re.compile(r"\d{6,}-[0-9a-f]{32}")  # a part's folder name: the rank, then a hash


def _options(options: Any) -> dict[str, Any]:
    """The options as the manifest and a part's name record them: a ``filter_fn`` by its code, not its name."""
    described = options.describe()
    if options.filter_fn is not None:
        described["filter_fn"] = f"{options.filter_fn.name} {tokenize(options.filter_fn.blob)}"
    return described


def _part_name(task: RankTask, identity: Mapping[str, Any]) -> str:
    """The folder of a rank's part, relative to the store: the rank and a hash of all it was made from."""
    made_from = (SCHEMA_VERSION, _code(), dict(identity), task.rank, task.base, _options(task.options),
                 task.window_abs_ns, task.repair)
    return f"parts/{task.rank:06d}-{tokenize(*made_from)}"


@retry_unreachable
def _index_batch(tasks: list[RankTask], heads: list[tuple[tuple[str, int, int] | None, Any]], parts: list[str],
                 store: str, storage_options: Mapping[str, Any] | None,
                 skip: bool) -> list[tuple[IndexedRank | None, BaseException | None]]:
    """A rank task: each rank's part, or (with ``skip``) why a rank could not be read."""
    done: list[tuple[IndexedRank | None, BaseException | None]] = []
    for task, head, part in zip(tasks, heads, parts):
        try:
            with paused_gc():
                done.append((_index_rank(task, head, part, store, storage_options), None))
        except SKIPPABLE as e:
            if not skip:
                raise
            done.append((None, e))
    return done


def _index_rank(task: RankTask, head: tuple[tuple[str, int, int] | None, Any], part: str, store: str,
                storage_options: Mapping[str, Any] | None) -> IndexedRank:
    """One rank read and written as its part (``_index_data``); ``head``: where the header pass put the rank's
    header text (``(file, offset, length)``), and the file's ``baseTimeNanoseconds``."""
    data, cut_gzip = read_bytes(task.path, storage_options, repair=task.repair)
    return _index_data(task, data, cut_gzip, _header(head[0], storage_options), head[1], part, store,
                       storage_options)


def _index_data(task: RankTask, data: bytes, cut_gzip: bool, header: dict[str, Any], base_time: Any, part: str,
                store: str, storage_options: Mapping[str, Any] | None) -> IndexedRank:
    """One rank's trace text (``data``), filtered and rewritten as the merge does (its fast path where the merge
    would take it), written as its part's tables; ``header``: the trace's ``distributedInfo``,
    ``deviceProperties`` and ``host_name``; ``base_time``: its ``baseTimeNanoseconds``."""
    who = f"{task.path} (rank {task.rank})"
    nbytes, note = len(data), None
    own_base = base_time if type(base_time) is int else None
    figures: dict[str, Any] = {}  # info's, of the events as read
    fast = rewritten_fast(data, task.rank, task.base, task.base_out, task.options, who,
                          lambda events: figures.update(figures_of_structs(events, own_base))) \
        if handles(task.options, task.window_abs_ns) else None
    if fast is not None:
        first, body, n_in, slots, kinds = fast
        keys = set(kinds.present())
        fields = joined(fields_of_dicts(first, [None] * len(first)), fields_of_structs(body, task.base_out))
        durs = {type(e.dur) for e in body}
        negative = 0  # the fast path takes no negative duration
    else:
        doc, nbytes, note = decode_json(data, task.path, rank=task.rank, cut_gzip=cut_gzip, repair=task.repair)
        check_document(doc, who)
        events = doc["traceEvents"]
        n_in = len(events)
        figures = figures_of_dicts(events, own_base)
        sel = RankEvents(events, task.base, task.options, who, task.window_abs_ns)
        slots = order_slots(*sel.pids, who)
        keys = {(ev.get("ph"), ev.get("pid"), ev.get("tid", msgspec.UNSET), ev.get("cat", msgspec.UNSET))
                for ev, kept in zip(events, sel.keep) if kept and ev.get("ph") != "M"}
        before = {id(ev): ev.get("ts") for i, ev in enumerate(events) if sel.keep[i]}  # the rewrite shifts them
        first, body = rewrite(sel, task.rank, task.base_out)
        merged = first + body
        fields = fields_of_dicts(merged, [None if (t := before.get(id(ev))) is None else to_ns(t) + task.base
                                          for ev in merged])
        durs = {type(ev["dur"]) for ev in merged if "dur" in ev}
        negative = sel.left_out["negative_dur"]
        del doc, events, sel
    del data
    origins = {"rank": task.rank, "file": task.path, "base_ns": task.base, "base_time_ns": base_time, "header": header,
               "pids": [[out_pid(task.rank, j), pid] for j, (_, pid) in enumerate(slots)],
               **dict(zip(("tids", "tids_merged"), _tid_origins(keys))),
               "durations": "mixed" if {int, float} <= durs else "float" if float in durs else "int",
               # for an analysis's account of the trace (``source.read_part``): what it read, of which metadata
               # (which no part holds) and python_function events
               "events_in": n_in, "metadata_in": figures["events"] - sum(figures["categories"].values()),
               "python_function_in": figures["categories"].get("python_function", 0), "negative_dur_in": negative}
    tables = rank_tables(task.rank, fields)
    fs, root = fsspec.core.url_to_fs(store, **options_for(store, storage_options))
    written = 0
    for name, table in tables.items():
        if name == "events":
            table = table.replace_schema_metadata({ORIGINS: orjson.dumps(origins)})
        buf = io.BytesIO()
        delta = [c for c in _DELTA if c in table.column_names]
        pq.write_table(table, buf, compression="zstd", compression_level=9,
                       use_dictionary=[c for c in table.column_names if c not in delta],
                       column_encoding=dict.fromkeys(delta, "DELTA_BINARY_PACKED"))
        written += buf.tell()
        put_whole(fs, f"{root}/{part}/{name}.parquet", buf.getvalue(), storage_options)
    world_size = resolve_rank(InputFile(task.path, rank_hint=task.rank, hint_source="key"), header)[1]
    info = {"world_size": world_size, "host_name": header.get("host_name"), **figures, "repaired": note}
    host, props = header.get("host_name"), header.get("deviceProperties")
    devices = {pid for kind, pid in slots if kind == "d"}
    names = sorted({str(d.get("name")) for d in props if isinstance(d, dict) and d.get("id") in devices}) \
        if isinstance(props, list) else []
    return IndexedRank(task.rank, task.path, part, n_in, {k: t.num_rows for k, t in tables.items()}, nbytes,
                       written, host if isinstance(host, str) else None, ", ".join(names) or None, info,
                       [note] if note else [])


def _tid_origins(keys: set[tuple[Any, ...]]) -> tuple[list[list[Any]], list[list[Any]]]:
    """The tids the merge made ints (``"stream 7"``), from the events' distinct ``(ph, pid, tid, cat)`` as read:
    ``[pid, ph, merged tid, tid as read]`` where that int names one tid of its pid's events of that phase, and
    ``[pid, ph, merged tid, [tids as read]]`` where it names more (a tid ``"7"`` and a tid ``7``): those stay one."""
    read: dict[tuple[Any, ...], set[Any]] = {}
    for ph, pid, tid, _ in keys:
        if tid is not msgspec.UNSET:
            read.setdefault((pid, ph, map_tid(tid)), set()).add(tid)
    ones = [[*k, t] for k, tids in read.items() if len(tids) == 1 and (t := next(iter(tids))) != k[2]]
    more = [[*k, sorted(tids, key=lambda t: (type(t) is int, str(t)))] for k, tids in read.items() if len(tids) > 1]
    return sorted(ones, key=str), sorted(more, key=str)


def _header(meta: tuple[str, int, int] | None, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The rank's header keys that a store keeps (``distributedInfo``, ``deviceProperties``, ``host_name``), from the
    text the header pass wrote at ``meta`` (``(file, offset, length)``)."""
    if meta is None:
        return {}
    path, offset, length = meta
    with storage_errors(path, storage_options):
        fs, p = fsspec.core.url_to_fs(path, **options_for(path, storage_options))
        return orjson.loads(fs.cat_file(p, start=offset, end=offset + length))


def _manifest(fs: Any, root: str) -> dict[str, Any] | None:
    """The store's manifest as it is now, None when there is none."""
    try:
        manifest = orjson.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    except (FileNotFoundError, NotADirectoryError, orjson.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _previous(fs: Any, root: str, store: str, request: MergeRequest) -> dict[str, Any] | None:
    """The store's manifest, None when there is none; raises when the folder may not be indexed into as asked."""
    if fs.isfile(root):
        raise OutputExistsError(f"{store}: a file, not a folder; a store is a folder: give a new or empty one")
    manifest = _manifest(fs, root)
    if manifest is None:
        # a folder that holds only parts is one whose first run failed or was killed
        other = [e for e in (fs.ls(root, detail=False) if fs.isdir(root) else [])
                 if e.rstrip("/").rsplit("/", 1)[-1] != "parts"]
        foreign = [e for e in _listed(fs, root, every=True) if not PART.fullmatch(e)]
        if (other or foreign) and not request.force:
            raise OutputExistsError(f"{store}: the folder exists and is not a tracefuse store; give an empty or new "
                                    "folder, or pass {force} to index into it (what is in it stays)")
        return None
    if not (request.force or request.skip_if_unchanged):
        raise OutputExistsError(f"{store}: the store exists; pass {{force}} to replace it, or --skip-if-unchanged "
                                "to index only the ranks whose inputs changed")
    return manifest


def index(urlpath: str | Iterable[str] | Mapping[int, str], request: MergeRequest, *, client: Client | None = None,
          workers: int | None = None, scheduler: str | None = None, scheduler_file: str | None = None,
          timeout: float = 10.0, estimate: ClockEstimate | None = None) -> MergeSummary:
    """Index the inputs ``urlpath`` into the store ``request.out``; see ``api.index_traces``. ``estimate`` gives the
    ranks' clock offsets for ``align="collectives"``."""
    started = time.perf_counter()
    so, store = request.storage_options, request.out.rstrip("/")
    files, unlisted = expand_inputs(urlpath, storage_options=so, rank_regex=request.rank_regex,
                                    subset=request.subset)
    made_from = _made_from([f.identity for f in files], request)
    with storage_errors(store, so):
        fs, root = fsspec.core.url_to_fs(store, **options_for(store, so))
        previous = _previous(fs, root, store, request)
        present = _whole_parts(fs, root) if previous is not None and request.skip_if_unchanged else set()
    # what a run of --skip-if-unchanged may keep: the parts of the store's manifest that are there
    reusable = {r["part"]: r for r in previous.get("ranks", []) if r["part"].rsplit("/", 1)[-1] in present} \
        if previous is not None and previous.get("schema_version") == SCHEMA_VERSION else {}
    if reusable and len(reusable) == len(previous["ranks"]) \
            and previous.get("made_from") == orjson.loads(orjson.dumps(made_from)):
        said = f"{store} is up to date: inputs, options and version as in its {MANIFEST}; nothing to do"
        return _summary(store, previous, "unchanged", started, [said])
    identity = {f.path: f.identity for f in files}
    notes = MergeNotes()
    notes.ignored.extend(f"{p}: not a JSON trace by name, or written by tracefuse" for p in unlisted)
    futures: list[Any] = []
    with run_folder(store, so) as tmp_dir:
        try:
            with connect(client, scheduler=scheduler, scheduler_file=scheduler_file, workers=workers,
                         timeout=timeout, inputs=files) as c:
                plan = plan_merge(c, request, files, unlisted, tmp_dir, estimate, notes, futures)
                parts = [_part_name(t, identity[t.path]) for t in plan.tasks]
                ranks = _run(c, plan, parts, [k for k, p in enumerate(parts) if p not in reusable], store, notes,
                             futures)
            kept = [k for k, p in enumerate(parts) if p in reusable]
            if kept:
                notes.notes.append(f"kept the parts of {len(kept):,} rank{'' if len(kept) == 1 else 's'} whose inputs "
                                   "did not change")
            rows = sorted([*ranks, *({**reusable[parts[k]], "file": plan.tasks[k].path} for k in kept)],
                          key=lambda r: r["rank"])
            if not rows:
                raise every_rank_failed(notes.skipped)
            manifest = {"format": "tracefuse-store", "schema_version": SCHEMA_VERSION, "tool": "tracefuse_dask",
                        "version": __version__, "made_from": made_from, "alignment": plan.alignment,
                        "base_ns": plan.base_out, "world_size": plan.world_size, "ranks": rows,
                        "skipped": notes.skipped, "warnings": notes.warnings, "ignored": notes.ignored}
            with storage_errors(store, so):
                _commit(fs, root, store, manifest, so)
        except BaseException:
            for fut in futures:
                if not fut.done():
                    fut.cancel()
            _tidy(fs, root, tmp_dir, previous, so)
            raise
        finally:
            futures.clear()
        _tidy(fs, root, tmp_dir, manifest, so)
    return _summary(store, manifest, "ok", started, notes.warnings, notes, ranks)


def _made_from(inputs: list[dict[str, Any]], request: MergeRequest) -> dict[str, Any]:
    """What a store was made from, as its manifest records it: its inputs' identities, the options, the code."""
    options = {k: v for k, v in manifest_of([], request)["options"].items() if k not in ("gzip_members", "format")}
    return {"inputs": inputs, "options": {**options, **_options(request.options), "code": _code()}}


def _listed(fs: Any, root: str, every: bool = False) -> set[str]:
    """The names of the part folders under the store ``root`` (``every``: of whatever is in ``parts/``)."""
    fs.invalidate_cache()
    try:
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(f"{root}/parts", detail=False)}
    except FileNotFoundError:
        return set()
    return names if every else {n for n in names if PART.fullmatch(n)}


def _whole_parts(fs: Any, root: str) -> set[str]:
    """The names of the part folders under the store ``root`` that hold every table's file."""
    fs.invalidate_cache()
    try:
        files = fs.find(f"{root}/parts")
    except FileNotFoundError:
        return set()
    held: dict[str, set[str]] = {}
    for f in files:
        folder, _, name = f.rstrip("/").rpartition("/")
        held.setdefault(folder.rsplit("/", 1)[-1], set()).add(name)
    tables = {f"{t}.parquet" for t in PART_TABLES}
    return {n for n, names in held.items() if PART.fullmatch(n) and tables <= names}


def _commit(fs: Any, root: str, store: str, manifest: dict[str, Any], so: Mapping[str, Any]) -> None:
    """Write the manifest, once every part it lists is there."""
    present = _whole_parts(fs, root)
    missing = [r["part"] for r in manifest["ranks"] if r["part"].rsplit("/", 1)[-1] not in present]
    if missing:
        raise OutputWriteError(f"{store}: {len(missing):,} parts went while this run wrote them (the first: "
                               f"{missing[0]}): another run removed them; run again")
    put_whole(fs, f"{root}/{MANIFEST}", orjson.dumps(manifest, option=orjson.OPT_INDENT_2), so)


def _tidy(fs: Any, root: str, tmp_dir: str, manifest: dict[str, Any] | None, so: Mapping[str, Any]) -> None:
    """Remove the parts that neither ``manifest`` (this run's, or the one it found) nor the store's manifest as it
    is now lists, when no other run of the store lives: the replaced parts of a run that worked, the new parts of
    one that failed, never those of a run that finished meanwhile. A store left with no manifest and no parts goes
    too. A storage that fails here fails nothing: the next run tidies."""
    try:
        if not alone(tmp_dir, so):
            return
        now = _manifest(fs, root)
        listed = {r["part"].rsplit("/", 1)[-1] for m in (manifest, now) for r in (m or {}).get("ranks", [])}
        for name in sorted(_listed(fs, root) - listed):
            with contextlib.suppress(FileNotFoundError):
                fs.rm(f"{root}/parts/{name}", recursive=True)
        if now is None and isinstance(fs, fsspec.implementations.local.LocalFileSystem):
            for folder in (f"{root}/parts", root):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
    except Exception as e:  # noqa: BLE001 - the run's own outcome stands
        log.warning("%s: could not remove parts no manifest lists (%s); the next run will", root, e)


def _run(c: Client, plan: MergePlan, parts: list[str], todo: list[int], store: str, notes: MergeNotes,
         futures: list[Any]) -> list[dict[str, Any]]:
    """The rank tasks of the plan's ranks ``todo`` (small ranks batched), biggest first; each rank's manifest
    entry, in rank order."""
    if not todo:
        return []
    request, tasks, so = plan.request, plan.tasks, plan.request.storage_options
    by_path = {f.path: f.trace_bytes for f in plan.files}
    sizes = [by_path.get(tasks[k].path) for k in todo]
    groups = batches(sizes, BATCH_BYTES)
    runs = [[todo[i] for i in b] for b in groups]
    keys = [f"tracefuse-index-{tokenize([tasks[k] for k in run], [parts[k] for k in run], store, so)}"
            for run in runs]
    order = biggest_first([None if None in (got := [sizes[i] for i in b]) else sum(got) for b in groups])
    got = c.map(_index_batch, [[tasks[k] for k in runs[j]] for j in order],
                [[(plan.ranks[k][1].meta, plan.ranks[k][1].base) for k in runs[j]] for j in order],
                [[parts[k] for k in runs[j]] for j in order],
                store=store, storage_options=so, skip=request.on_error == "skip", key=[keys[j] for j in order])
    futures[:] = [f for _, f in sorted(zip(order, got), key=lambda jf: jf[0])]
    done = settle(flat(outcomes(c, futures, request.show_progress)), [tasks[k].path for run in runs for k in run],
                  [tasks[k].rank for run in runs for k in run], request.on_error, notes.skipped)
    by_rank = {t.rank: t for t in tasks}
    out = []
    for _, r in done:
        notes.warnings.extend(w for w in r.warnings if w not in notes.warnings)
        out.append(_row(r, by_rank[r.rank].base, plan.clock_offsets.get(r.rank, 0)))
    return out


def _row(r: IndexedRank, base: int, offset: int) -> dict[str, Any]:
    """A rank's manifest entry: its part and what it was made of; ``base``: the rank's aligned base time, after
    the clock ``offset``."""
    return {"rank": r.rank, "file": r.path, "part": r.part, "host": r.host, "device": r.device, "base_ns": base,
            "offset_ns": offset, "events_in": r.events_in, "rows": r.rows, "bytes_in": r.bytes_in,
            "bytes_out": r.bytes_out, "info": r.info}


def part_of_analysis(f: InputFile, data: bytes, cut_gzip: bool, rank: int, header: Mapping[str, Any],
                     base_time: Any, *, store: str, storage_options: Mapping[str, Any] | None,
                     repair: bool) -> dict[str, Any]:
    """Task side of ``analyze --store``: the part of the rank an analysis task read (``data``, the file's whole
    text; ``header``, its top-level keys), written as ``tracefuse index --align base`` writes it, under the same
    name; its manifest entry (``row``) and the file's ``identity``."""
    own = base_of(base_time, f.path)  # as the header pass checks it
    task = RankTask(rank, f.path, own, own, build_options(), repair=repair)
    part = _part_name(task, f.identity)
    done = _index_data(task, data, cut_gzip, {k: header.get(k) for k in RANK_META}, base_time, part, store,
                       storage_options)
    return {"row": _row(done, own, 0), "identity": f.identity, "warnings": done.warnings}


@dataclass
class AnalysisStore:
    """What ``analyze --store`` hands its store's commit: the parts its tasks wrote (``part_of_analysis``'s
    results), then the analysis's inputs (their identities), what it ignored and which ranks it skipped."""

    parts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)
    skipped: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def analysis_store(request: MergeRequest) -> Iterator[AnalysisStore]:
    """Client side of ``analyze --store``: the store ``request.out`` checked as ``index`` checks it; when the
    analysis ends, the manifest of what it handed over written as ``index`` writes one (``alignment`` ``"base"``),
    and the parts no manifest lists removed; when it fails, its parts."""
    so, store = request.storage_options, request.out.rstrip("/")
    with storage_errors(store, so):
        fs, root = fsspec.core.url_to_fs(store, **options_for(store, so))
        previous = _previous(fs, root, store, request)
    run = AnalysisStore()
    with run_folder(store, so) as tmp_dir:
        manifest = previous
        try:
            yield run
            rows = sorted((p["row"] for p in run.parts), key=lambda r: r["rank"])
            if not rows:
                raise MergeError(f"{store}: no per-rank Kineto trace among the inputs, so no store to write (a "
                                 "store holds per-rank traces, not merged traces or collective_trace logs)")
            manifest = {"format": "tracefuse-store", "schema_version": SCHEMA_VERSION, "tool": "tracefuse_dask",
                        "version": __version__, "made_from": _made_from(run.inputs, request), "alignment": "base",
                        "base_ns": min(r["base_ns"] for r in rows), "world_size": _world_size(rows), "ranks": rows,
                        "skipped": run.skipped, "warnings": [w for p in run.parts for w in p["warnings"]],
                        "ignored": run.ignored}
            with storage_errors(store, so):
                _commit(fs, root, store, manifest, so)
        except BaseException:
            _tidy(fs, root, tmp_dir, previous, so)
            raise
        _tidy(fs, root, tmp_dir, manifest, so)


def _world_size(rows: list[dict[str, Any]]) -> int | None:
    """The world size the ranks' traces agree on, None when they give none or disagree."""
    sizes = {r["info"]["world_size"] for r in rows} - {None}
    return sizes.pop() if len(sizes) == 1 else None


def _summary(store: str, manifest: dict[str, Any], status: str, started: float, warnings: list[str],
             notes: MergeNotes | None = None, read: list[dict[str, Any]] | None = None) -> MergeSummary:
    """The run's summary, in the merge's terms: the store's ranks, and the events, rows and bytes of the ranks this
    run ``read`` (none when nothing changed)."""
    seconds = round(time.perf_counter() - started, 3)
    ranks, read = manifest.get("ranks", []), read or []
    bytes_in = sum(r["bytes_in"] for r in read)
    return MergeSummary(
        ranks=len(ranks), skipped=notes.skipped if notes else [], events_in=sum(r["events_in"] for r in read),
        events_out=sum(sum(r["rows"].values()) for r in read), bytes_in=bytes_in,
        bytes_out=sum(r["bytes_out"] for r in read), seconds=seconds,
        mb_per_s=round(bytes_in / 1e6 / seconds, 1) if seconds and bytes_in else 0.0, output=store, status=status,
        warnings=warnings, ignored=notes.ignored if notes else [], notes=notes.notes if notes else [],
        rank_list=[r["rank"] for r in ranks], outputs=[store])
