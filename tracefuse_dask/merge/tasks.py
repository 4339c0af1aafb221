"""Phase B of the merge: one task per rank (small ranks batched) reads, filters and rewrites its events
and writes its partition next to the output, returning only counts.

A partition begins with its own separator, so that partitions join as plain bytes (or gzip members).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import orjson
from dask.base import tokenize
from distributed import Client

from ..cluster import BATCH_BYTES, batches, biggest_first, flat, outcomes
from ..errors import SKIPPABLE, MergeError
from ..kineto.document import check_document, decode_json, paused_gc
from ..kineto.events import RankEvents
from ..model import RankResult, RankTask, ranges
from ..storage.files import read_bytes, retry_unreachable, storage_errors
from ..storage.output import gzip_member, open_write, writing
from .fastpath import handles, rewrite_fast
from .anomalies import rank_anomalies
from .lanes import slices, to_lanes
from .plan import MergeNotes, MergePlan, settle
from .rewrite import device_pids, estimates, order_slots, rewrite

__all__ = ["SEP", "rewrite_general", "rewrite_ranks"]

log = logging.getLogger("tracefuse_dask")

SEP = b",\n"


@retry_unreachable
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
            except SKIPPABLE as e:
                if not skip:
                    raise
                outcomes.append((None, e))
                continue
            with writing(part_path), storage_errors(part_path, storage_options):
                if fo is None:
                    fo = open_write(part_path, storage_options)
                fo.write(data)
            outcomes.append((result, None))
    finally:
        if fo is not None:
            with writing(part_path), storage_errors(part_path, storage_options):
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
    left_out: Counter[str] = Counter()
    anomalies: dict[str, int] = {}
    if task.marks is None and handles(task.options, task.window_abs_ns):
        fast = rewrite_fast(data, task.rank, task.base, task.base_out, task.options, who, left_out, anomalies,
                            task.estimate_keep)
    if fast is not None:
        del data
        head_json, body_json, n_in, n_out, moved, narrower = fast
        note = None
    else:
        left_out.clear()  # the fast path may have counted before it stepped aside
        doc, nbytes, note = decode_json(data, task.path, rank=task.rank, cut_gzip=cut_gzip, repair=task.repair)
        del data
        head_json, body_json, n_in, n_out, moved, narrower = rewrite_general(task, doc, who, left_out, anomalies)
        del doc
    data = _partition(body_json)
    del body_json
    json_bytes = len(data) + len(head_json)
    if task.compress and data:
        data = gzip_member(data)
    return RankResult(task.rank, task.path, n_in, n_out, nbytes, len(data), part_path, head_json[1:-1],
                      [note] if note else [], moved, json_bytes, dict(+left_out), anomalies, note is not None,
                      *(narrower if narrower is not None else (None, None))), data


def rewrite_general(task: RankTask, doc: dict[str, Any], who: str, left_out: Counter[str], anomalies: dict[str, int]
                    ) -> tuple[bytes, bytes, int, int, int, tuple[int, dict[int, int]] | None]:
    """The general path of a rank's rewrite (``RankEvents``, ``rewrite``, then the lanes), as ``rewrite_fast``
    returns it; ``left_out`` counts the events left out by each reason, and ``anomalies`` gets those of the
    events kept."""
    check_document(doc, who)
    events = doc["traceEvents"]
    sel = RankEvents(events, task.base, task.options, who, task.window_abs_ns)
    head, body = rewrite(sel, task.rank, task.base_out, task.marks, task.counter_series)
    moved = 0
    devices = device_pids(task.rank, order_slots(*sel.pids, who))
    shifted = task.base != task.base_out
    s = slices(body, structs=False, shifted=shifted)
    anomalies.update(rank_anomalies(body, s, devices, False, shifted, sel.left_out["negative_dur"]))
    if not task.options.keep_overlaps:
        n = len(body)
        moved, threads = to_lanes(body, s, devices, structs=False)
        sel.left_out["thread_metadata"] += n - len(body)
        body += threads
    left_out.update(sel.left_out)
    narrower = estimates(head, body, devices, orjson.dumps, False) if task.estimate_keep else None
    return orjson.dumps(head), orjson.dumps(body), len(events), len(head) + len(body), moved, narrower


def _partition(events: bytes | bytearray) -> bytes | bytearray:
    """A JSON array's events as a partition: after a separator, so that partitions join as plain bytes."""
    if len(events) <= 2:
        return b""
    part = events if isinstance(events, bytearray) else bytearray(events)
    part[:1] = SEP  # "[" (a bytearray shifts its bytes in place: no copy of the events)
    part[-1:] = b"\n"  # "]"
    return part


def rewrite_ranks(c: Client, plan: MergePlan, notes: MergeNotes, futures: list[Any]) -> list[RankResult]:
    """Run the plan's rank tasks, biggest first; their results in rank order.

    An archive needs each rank's partition on its own; a ``--split`` part, whole batches.
    """
    request, tasks, so = plan.request, plan.tasks, plan.request.storage_options
    compress = tasks[0].compress
    ext = ".json.gz" if compress else ".json"
    limit = 0 if request.format == "perfetto-archive" else BATCH_BYTES
    by_path = {f.path: f.trace_bytes for f in plan.files}
    runs = [[tasks[part.start + i] for i in b] for part in plan.split_groups
            for b in batches([by_path.get(tasks[k].path) for k in part], limit)]
    paths = [f"{plan.tmp_dir}/part-{run[0].rank:08d}{ext}" for run in runs]
    keys = [f"tracefuse-rewrite-{tokenize(run, p, so, request.on_error)}" for run, p in zip(runs, paths)]
    t0 = time.perf_counter()
    run_sizes = [[by_path.get(t.path) for t in run] for run in runs]
    order = biggest_first([None if None in rs else sum(rs) for rs in run_sizes])
    got = c.map(_rewrite_batch, [runs[k] for k in order], [paths[k] for k in order], storage_options=so,
                skip=request.on_error == "skip", key=[keys[k] for k in order])
    futures[:] = [f for _, f in sorted(zip(order, got), key=lambda kf: kf[0])]  # back in rank order
    done = settle(flat(outcomes(c, futures, request.show_progress)), [t.path for t in tasks],
                  [t.rank for t in tasks], request.on_error, notes.skipped)
    if not done:
        raise MergeError("every rank failed; see the reasons above, fix or re-export the traces")
    results: list[RankResult] = [res for _, res in done]
    log.info("rewrote %d ranks in %d tasks in %.2f s", len(results), len(runs), time.perf_counter() - t0)
    seen = set(notes.warnings)
    notes.warnings.extend(dict.fromkeys(w for res in results for w in res.warnings if w not in seen))
    if plan.world_size is not None:
        missing = sorted(set(range(plan.world_size)) - {r.rank for r in results} - {s["rank"] for s in notes.skipped})
        if missing and request.subset is None:
            notes.warnings.append(f"{len(missing):,} of {plan.world_size:,} ranks missing: {ranges(missing)}")
    return results
