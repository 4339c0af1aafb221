"""The end of a merge: the output's header, then the partitions in rank order, joined into the output
(one file, the ``--split`` parts, or a perfetto archive), which appears only when complete.

Tasks write the header from Phase A's metadata files; the joins run server side on S3 and GCS
(``storage.joins``). The client only plans: it never holds trace bytes, nor the ranks' metadata.
"""
from __future__ import annotations

import contextlib
import logging
import tarfile
import time
from collections.abc import Mapping
from typing import Any

import fsspec
import orjson
from dask.base import tokenize
from distributed import Client

from .._version import __version__
from ..cluster import BATCH_RANKS
from ..errors import OutputExistsError
from ..model import RankResult, ranges
from ..storage.files import options_for, retry_unreachable, storage_errors
from ..storage.inputs import relative_sources
from ..storage.joins import MIN_PART, Piece, join, plan_groups, protocol_of, write_group
from ..storage.output import gzip_member, gzip_writer, open_write, split_name, writing
from . import plan as _plan
from .plan import MergeNotes, MergePlan, split_ranges
from .tasks import SEP

__all__ = ["PERFETTO_MANIFEST", "archive_member", "assemble_outputs", "too_big"]

log = logging.getLogger("tracefuse_dask")

_INLINE_HEADS = 1 << 20  # headers up to this many bytes travel in the task graph


_FOOT = b"\n]}\n"


PERFETTO_MANIFEST = "perfetto_manifest.json"


@retry_unreachable
def _write_group(out: str, pieces: list[Piece], dest: str, recompress: bool,
                 storage_options: Mapping[str, Any] | None) -> int:
    """Task: write consecutive pieces of the output as one object (a part of at least 5 MiB)."""
    with writing(dest), storage_errors(dest, storage_options):
        fs, path = fsspec.core.url_to_fs(dest, **options_for(out, storage_options))
        return write_group(fs, pieces, path, recompress)


@retry_unreachable
def _finish(out: str, tmp_dir: str, sources: list[str], sizes: list[int],
            storage_options: Mapping[str, Any] | None) -> int:
    """Task: make the output from its parts (server side on S3 and GCS, a rename elsewhere)."""
    with writing(out), storage_errors(out, storage_options):
        fs, out_path = fsspec.core.url_to_fs(out, **options_for(out, storage_options))
        paths = [fsspec.core.url_to_fs(u, **options_for(out, storage_options))[1] for u in sources]
        if len(paths) == 1 and protocol_of(fs) == "other":
            fs.mv(paths[0], out_path)
        else:
            _, tmp_path = fsspec.core.url_to_fs(tmp_dir, **options_for(out, storage_options))
            join(fs, out_path, paths, sizes, tmp_path)
        return fs.size(out_path)


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


@retry_unreachable
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
            with writing(dest), storage_errors(dest, storage_options), \
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
                    raise OutputExistsError(f"{o}: the output exists; pass {{force}} to replace it")
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
                    if fs.exists(path):
                        fs.rm(path)
        raise
    return total


def _head_job(dest: str, base_out: int, meta: dict[str, Any], results: list[RankResult], entries: dict[int, Any],
              compress: bool) -> tuple[str, bytes, list[Any], bytes, bool]:
    """A ``_write_heads`` job: the header of a merged trace of ``results``, up to its first events."""
    pre = b"".join([b'{"schemaVersion":1,"displayTimeUnit":"ms","baseTimeNanoseconds":', str(base_out).encode(),
                    b',"metadata":{"tracefuse":', orjson.dumps(meta)[:-1], b',"ranks":{'])
    post = b"".join([b'}}},"traceEvents":[\n', SEP.join(r.head for r in results if r.head)])
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


def assemble_outputs(c: Client, plan: MergePlan, notes: MergeNotes, results: list[RankResult],
                     futures: list[Any]) -> tuple[list[str], int]:
    """Write the outputs of ``results``; their names and total size."""
    request, so = plan.request, plan.request.storage_options
    out, tmp_dir, base_out = request.out, plan.tmp_dir, plan.base_out
    sources = relative_sources([f.path for f in plan.files])
    by_rank = dict(plan.ranks)
    entries = {res.rank: (res.rank, sources[res.path], by_rank[res.rank].base, by_rank[res.rank].meta)
               for res in results}
    meta = {
        "version": __version__,
        "base_time_ns": base_out,
        "options": {**request.options.describe(), "align": plan.alignment},
        "skipped": [{"rank": sk["rank"], "source": sources[sk["path"]],
                     "reason": sk["reason"].replace(sk["path"], sources[sk["path"]])} for sk in notes.skipped],
    }
    if plan.alignment != "base":
        meta["clock_offsets_ns"] = {str(r): v for r, v in sorted(plan.clock_offsets.items())}
    parts = _split_parts(out, results, [plan.tasks[g[-1]].rank for g in plan.split_groups])
    gzip_out = out.endswith(".gz")
    t0 = time.perf_counter()
    futures.clear()
    if request.format == "perfetto-archive":
        jobs = [_head_job(f"{tmp_dir}/head-{r.rank:08d}.json", base_out, meta, [r], entries, False) for r in results]
        heads: list[Piece] = [(job[0], size) for job, size in zip(jobs, _heads(c, jobs, so, futures))]
        bytes_out = _assemble(c, out, tmp_dir, _archive_pieces(results, meta, heads), gzip_out, so, futures)
    else:
        bytes_out = _assemble_parts(c, parts, meta, entries, base_out, tmp_dir, gzip_out,
                                    gzip_out and request.gzip_members == "single", so, request.force, futures)
    log.info("wrote %s (%d bytes) in %.2f s", ", ".join(o for o, _ in parts), bytes_out, time.perf_counter() - t0)
    return [o for o, _ in parts], bytes_out


def too_big(plan: MergePlan, results: list[RankResult]) -> list[str]:
    """A warning, from the partitions' sizes before the outputs are joined, when an output file will hold more
    JSON than Perfetto's web UI opens (``plan.UI_LIMIT``): how big, which ``--split``, which ``--ranks`` and, where
    the tasks measured it, how big ``--keep gpu,comm`` give files it opens, and what opens the whole merge.
    Nothing for a perfetto archive, which the UI opens rank by rank."""
    if plan.request.format == "perfetto-archive" or not results:
        return []
    limit = _plan.UI_LIMIT
    by_rank = dict(plan.ranks)
    size_of = {r.rank: r.json_bytes + (by_rank[r.rank].meta or (0, 0, 0))[2] for r in results}
    sizes = [size_of.get(t.rank, 0) for t in plan.tasks]  # as --split cuts them: a skipped rank counts, empty
    parts = [sum(sizes[g.start:g.stop]) for g in plan.split_groups]
    if max(parts) <= limit:
        return []
    whole = "the merged trace" if len(parts) == 1 else "the largest part"

    def largest(n: int) -> int:  # the largest file of --split n
        return max(sum(sizes[g.start:g.stop]) for g in split_ranges(len(sizes), n))

    pieces = []
    split = next((n for n in range(len(parts) + 1, len(sizes) + 1) if largest(n) <= limit), None)
    if split is not None:
        pieces.append(f"--split {split} ({split} files of at most {_size(largest(split))})")
    total, last = 0, None
    for k, r in enumerate(results):
        if total + size_of[r.rank] > limit:
            break
        total, last = total + size_of[r.rank], k
    if last is not None:
        pieces.append(f"--ranks {ranges([r.rank for r in results[:last + 1]])} ({_size(total)})")
    notes = _narrower(plan, results, by_rank, limit, pieces)
    warning = (f"{whole} will be {_size(max(parts))} of JSON, more than Perfetto's web UI opens (about "
               f"{_size(limit)}: it has about 2 GB of memory); pieces it opens: {'; '.join(pieces + notes)}; the "
               f"whole merge opens with trace_processor --httpd {plan.request.out} and ui.perfetto.dev")
    return [warning]


def _narrower(plan: MergePlan, results: list[RankResult], by_rank: dict[int, Any], limit: int,
              pieces: list[str]) -> list[str]:
    """What narrows every rank: ``--keep gpu,comm`` and ``--steps A-B``, added to ``pieces`` with their sizes
    where the tasks measured them and they give files the UI opens; else what they would write."""
    if not all(r.keep_bytes is not None for r in results):
        return ["--keep gpu,comm or --steps A-B narrow every rank"]
    notes = []
    kept = {r.rank: r.keep_bytes + (by_rank[r.rank].meta or (0, 0, 0))[2] for r in results}
    most = max(sum(kept.get(plan.tasks[t].rank, 0) for t in g) for g in plan.split_groups)
    if most <= limit:
        pieces.append(f"--keep gpu,comm ({_size(most)})")
    else:
        notes.append(f"--keep gpu,comm still writes {_size(most)}")
    if not all(r.step_bytes for r in results):  # a rank without ProfilerStep#N
        return [*notes, "--steps A-B narrows every rank"]
    (first, last), most = _steps_run(plan, results, by_rank, limit)
    if most <= limit:
        pieces.append(f"--steps {first}-{last} (about {_size(most)})")
    else:
        notes.append(f"one step, --steps {first}-{first}, still writes about {_size(most)}")
    return notes


def _steps_run(plan: MergePlan, results: list[RankResult], by_rank: dict[int, Any],
               limit: int) -> tuple[tuple[int, int], int]:
    """The longest run of steps from the first whose files the UI opens (``--steps A-B``), and the size of its
    largest file, as ``--split`` cuts the ranks; about, since the tasks measured each step's events by their own
    start. When not even the first step fits: that step, and its size."""
    steps = sorted({s for r in results for s in r.step_bytes or {}})
    fixed = {r.rank: len(r.head) + (by_rank[r.rank].meta or (0, 0, 0))[2] for r in results}
    of = {r.rank: r for r in results}

    def size(run: list[int]) -> int:
        return max(sum(fixed[k] + sum((of[k].step_bytes or {}).get(s, 0) for s in run)
                       for k in (plan.tasks[t].rank for t in g) if k in of) for g in plan.split_groups)

    n = 1
    while n < len(steps) and size(steps[:n + 1]) <= limit:
        n += 1
    return (steps[0], steps[n - 1]), size(steps[:n])


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 100_000_000 else f"{nbytes / 1e6:.2f} MB"
