"""The merge on a Dask cluster, in five steps: check the request; list the inputs; plan (Phase A: the
headers and the one cross-rank reduce); rewrite every rank in its own task (Phase B); assemble the
outputs. The client never holds trace bytes, nor the ranks' metadata.

``plan.py`` holds the request and the frozen ``MergePlan``, ``tasks.py`` the rank tasks (with the
rewrite rules of ``rewrite.py`` and their fast path, ``fastpath.py``), ``assemble.py`` the outputs
(single, ``--split``, perfetto archive) and ``manifest.py`` ``--skip-if-unchanged``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec
from distributed import Client

from ..cluster import connect
from ..errors import MergeError, OutputExistsError
from ..model import LEFT_OUT, MergeSummary, RankResult, merge_account
from ..storage.files import options_for, storage_errors
from ..storage.inputs import expand_inputs
from ..storage.runs import run_folder
from .assemble import assemble_outputs, too_big
from .manifest import manifest_of, unchanged, write_manifest
from .plan import ClockEstimate, MergeNotes, MergePlan, MergeRequest, build_options, plan_merge
from .tasks import rewrite_ranks

__all__ = ["MergeRequest", "build_options", "merge"]

def merge(urlpath: str | Iterable[str] | Mapping[int, str], request: MergeRequest, *, client: Client | None = None,
          workers: int | None = None, scheduler: str | None = None, scheduler_file: str | None = None,
          timeout: float = 10.0, performance_report: str | None = None,
          estimate: ClockEstimate | None = None) -> MergeSummary:
    """Carry out ``request`` on the inputs ``urlpath``; see ``merge_traces``.

    ``estimate`` gives the ranks' clock offsets for ``align="collectives"``.
    """
    started = time.perf_counter()
    so = request.storage_options
    files, unlisted = expand_inputs(urlpath, storage_options=so, rank_regex=request.rank_regex,
                                    subset=request.subset)
    manifest = None
    if request.skip_if_unchanged:
        manifest = manifest_of(files, request)
        done = unchanged(request.out, manifest, so)
        if done is not None:
            done.seconds = round(time.perf_counter() - started, 3)
            return done
        request = dataclasses.replace(request, force=True)
    out = request.out
    with storage_errors(out, so):
        fs, out_path = fsspec.core.url_to_fs(out, **options_for(out, so))
        if fs.exists(out_path) and not request.force:
            raise OutputExistsError(f"{out}: the output exists; pass {{force}} to replace it")
    in_memory = any(url.startswith("memory://") for url in [out] + [f.path for f in files])
    report = contextlib.nullcontext()
    if performance_report:
        from distributed import performance_report as _perf

        report = _perf(filename=performance_report)
    notes = MergeNotes()
    futures: list[Any] = []
    # A folder of its own per run (the task keys name its files, so no run reuses another's results), leased while
    # the run lives, so that runs writing the same output at once leave each other's temporaries alone.
    with run_folder(out, so) as tmp_dir:
        try:
            with connect(client, scheduler=scheduler, scheduler_file=scheduler_file, workers=workers,
                         timeout=timeout, in_process=in_memory, inputs=files) as c, report:
                if in_memory and set(c.run(os.getpid).values()) != {os.getpid()}:
                    raise MergeError("memory:// paths live in one process, but this Dask cluster runs its workers "
                                     "in other processes; use a local path or object storage, or an in-process "
                                     "cluster (LocalCluster(processes=False))")
                plan = plan_merge(c, request, files, unlisted, tmp_dir, estimate, notes, futures)
                results = rewrite_ranks(c, plan, notes, futures)
                notes.warnings.extend(too_big(plan, results))
                outputs, bytes_out = assemble_outputs(c, plan, notes, results, futures)
        except BaseException:
            # Only unfinished work is cancelled: a finished key that is cancelled would also
            # cancel the same (deterministic) key of a rerun in this client.
            for fut in futures:
                if not fut.done():
                    fut.cancel()
            raise
        finally:
            futures.clear()
    if manifest is not None:
        write_manifest(out, manifest, bytes_out, so)
    seconds = round(time.perf_counter() - started, 3)
    bytes_in = sum(r.bytes_in for r in results)
    _what_happened(results, notes)
    return MergeSummary(
        ranks=len(results),
        skipped=notes.skipped,
        events_in=sum(r.events_in for r in results),
        events_out=sum(r.events_out for r in results),
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        seconds=seconds,
        mb_per_s=round(bytes_in / 1e6 / seconds, 1) if seconds else 0.0,
        output=outputs[0],
        status="ok",
        warnings=notes.warnings,
        ignored=notes.ignored,
        notes=notes.notes,
        rank_list=[r.rank for r in results],
        outputs=outputs,
        on_lanes=sum(r.on_lanes for r in results),
        account=merge_account(results, _not_read(plan, len(results) + len(notes.skipped))),
    )


def _not_read(plan: MergePlan, read: int) -> int | None:
    """The ranks of the job that ``--ranks`` left unread, where the traces say the job's size."""
    return None if plan.request.subset is None or plan.world_size is None else max(plan.world_size - read, 0)


def _what_happened(results: list[RankResult], notes: MergeNotes) -> None:
    """The notes and warnings of the ranks' rewrite: the slices moved to lanes (``lanes.to_lanes``), and a merge
    whose filters left out every event."""
    slices, ranks = sum(r.on_lanes for r in results), sum(1 for r in results if r.on_lanes)
    if slices > 1:
        notes.notes.append(f"{slices:,} slices that Perfetto cannot nest on their thread (in {ranks:,} "
                           f"rank{'s' if ranks > 1 else ''}) went to lanes of their own, threads named '… · overlap' "
                           "right after theirs; --keep-overlaps leaves them where they were")
    elif slices:
        notes.notes.append("1 slice that Perfetto cannot nest on its thread went to a lane of its own, a thread named "
                           "'… · overlap' right after its own; --keep-overlaps leaves it where it was")
    read = sum(r.events_in for r in results)
    if read and all(r.events_in == sum(r.left_out.values()) for r in results):
        why: Counter[str] = sum((Counter(r.left_out) for r in results), Counter())
        filters = {"keep", "steps", "window", "filter_fn"} & set(why)
        notes.warnings.append(f"every one of the {read:,} events read was left out ("
                              + ", ".join(f"{why[k]:,} {k}" for k in LEFT_OUT if why[k]) + ")"
                              + ("; check --keep, --steps, --window or filter_fn against the traces" if filters else ""))
