"""The map and combine tasks of ``tracefuse analyze``: each parses its files and analyses their ranks
(``per_rank``); combine tasks join many tasks' tables into one (``transport``) on the cluster."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pandas as pd

from ..errors import SKIPPABLE, RankError, TraceFormatError, skipped_rank
from ..kineto.array_form import COMPOSER_MERGED, MERGED_BY_COMPOSER
from ..kineto.document import check_document, decode_json, paused_gc
from ..kineto.layout import is_merged, split_merged
from ..model import InputFile
from ..storage.files import read_bytes, read_start, retry_unreachable
from ..storage.inputs import TRACE_NAME, rank_from_name, resolve_rank
from .cross_rank.critical_path import walks_in
from .per_rank.collective_trace import looks_like_collective_trace, parse_collective_trace
from .per_rank.decode import decode_trace
from .per_rank.rank import analyze_events, analyze_rank, rows_for
from .schema import PIECES, TABLES, AnalyzeRequest, RankTables
from .transport import as_categories, join_parts

__all__ = ["analyze_files", "batch", "combine", "segments_in", "without_segments"]

_CT_RANK = r"[-_.](?P<rank>\d+)(?:\.(?:csv|log|txt))?$"  # collective_trace names its logs <file>-<rank>

# what a folder or glob lists for analysis: traces, and collective_trace logs and CSV exports
_MERGED_HEAD = b'"metadata":{"tracefuse":'


def _analyze_file(f: InputFile, request: AnalyzeRequest) -> dict[str, Any]:
    """Task: parse one file and analyse each rank it holds (one, or all of a merged trace); a file of an event
    store (``f.part``) is read from its part instead.

    A collective_trace log or CSV export (recognised by its content) gives its calls instead. With ``repair``, a
    truncated trace gives its complete events, and a note says what was recovered.
    """
    storage_options, subset, rank_regex = request.storage_options, request.subset, request.rank_regex
    options = {"keep_unlaunched_gpu": request.keep_unlaunched_gpu, "devices": request.devices,
               "cutoffs": request.cutoffs, "sequences_of": request.sequences_of}
    if f.part is not None and request.read_part is not None:  # an event store's part, not the file
        with paused_gc():
            events, header, base, notes, not_stored = request.read_part(f, storage_options)
            rank, world_size, _ = resolve_rank(f, header, rank_regex)
            ranks = [analyze_events(events, rank, f.path, request.steps, base=base, header=header,
                                    read_before=not_stored, **options)
                     ] if subset is None or rank in subset else []
        return {"ranks": ranks, "world_size": world_size, "notes": notes, "repaired": [], "parts": []}
    if looks_like_collective_trace(read_start(f.path, storage_options)):
        return {"ct_calls": _collective_trace_calls(f, storage_options, rank_regex)}
    if f.listed and not TRACE_NAME.search(f.path):
        return {"ignored": f"{f.path}: neither a trace nor a collective_trace log or CSV"}
    with paused_gc():
        data, cut_gzip = read_bytes(f.path, storage_options, repair=request.repair)
        # A merged trace is split per rank on the orjson path; ours say so in their first bytes.
        trace = None if data.find(_MERGED_HEAD, 0, 256) >= 0 else decode_trace(data)
        if trace is not None and not is_merged(trace.metadata):
            header = {"distributedInfo": trace.distributedInfo, "host_name": trace.host_name,
                      "global_rank": trace.global_rank, "deviceProperties": trace.deviceProperties}
            rank, world_size, note = resolve_rank(f, header, rank_regex)
            wanted = subset is None or rank in subset
            stored = [request.write_part(f, data, cut_gzip, rank, header, trace.baseTimeNanoseconds)
                      ] if wanted and request.write_part is not None else []
            del data  # the analysis frees it once it has read the events' list texts, which point into it
            ranks = [analyze_events(trace.traceEvents, rank, f.path, request.steps,
                                    base=_base(trace.baseTimeNanoseconds), header=header, **options)
                     ] if wanted else []
            return {"ranks": ranks, "world_size": world_size, "notes": [note] if note else [], "repaired": [],
                    "parts": stored}
        del trace
        doc, _, repaired = decode_json(data, f.path, rank=f.rank_hint, cut_gzip=cut_gzip, repair=request.repair)
        text = data if request.write_part is not None else None  # for the rank's part, once its rank is known
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
        lane_metadata: Counter[int] = Counter()  # of a merged trace: the lanes' thread metadata, per rank
        if is_merged(meta):
            parts = split_merged(doc["traceEvents"], lane_metadata)
            world_size = None
            notes.append(f"{f.path}: a merged trace; analysed per rank ({len(parts):,} ranks)")
            by_rank = meta["tracefuse"].get("ranks") if isinstance(meta["tracefuse"], dict) else None
            headers = {int(r): h for r, h in by_rank.items()} if isinstance(by_rank, dict) else {}
        else:
            rank, world_size, note = resolve_rank(f, doc, rank_regex)
            parts = {rank: doc["traceEvents"]}
            notes += [note] if note else []
            headers = {rank: {k: v for k, v in doc.items() if k != "traceEvents"}}
        stored = [request.write_part(f, text, cut_gzip, rank, headers[rank], doc.get("baseTimeNanoseconds"))
                  for rank in parts if not is_merged(meta) and request.write_part is not None
                  and (subset is None or rank in subset)]
        del doc, text
        ranks = [analyze_rank(events, rank, f.path, request.steps, base=base, header=headers.get(rank),
                              read_before={"metadata": lane_metadata[rank]}, **options)
                 for rank, events in sorted(parts.items()) if subset is None or rank in subset]
        return {"ranks": ranks, "world_size": world_size, "notes": notes, "repaired": [repaired] if repaired else [],
                "parts": stored}


@retry_unreachable
def analyze_files(files: list[InputFile], request: AnalyzeRequest) -> dict[str, Any]:
    """Task: ``_analyze_file`` of consecutive files; small ones share a task (``cluster.batches``). With
    ``on_error="skip"``, a bad file gives why instead (``{"skipped": {rank, path, reason}}``), as in merge."""
    results = []
    for f in files:
        try:
            results.append(_analyze_file(f, request))
        except SKIPPABLE as e:
            results.append({"skipped": skipped_rank(e, f.rank_hint, f.path, request.on_error)})
    return batch(results)


def batch(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The results of ``_analyze_file`` as one, with each table's rows of all their ranks joined (a DataFrame costs
    ~10 kB whatever its rows)."""
    ranks: list[RankTables] = []
    ct: list[pd.DataFrame] = []
    out: dict[str, Any] = {"notes": [], "world_sizes": [], "ignored": [], "skipped": [], "repaired": [], "parts": []}
    for res in results:
        if "ignored" in res:
            out["ignored"].append(res["ignored"])
        elif "skipped" in res:
            out["skipped"].append(res["skipped"])
        elif "ct_calls" in res:
            ct.append(res["ct_calls"])
        else:
            ranks += res["ranks"]
            out["parts"] += res["parts"]
            out["notes"] += res["notes"]
            out["repaired"] += res["repaired"]
            out["world_sizes"].append(res["world_size"])
    out["tables"] = {name: rows_for(ranks, name) for name in (*TABLES, *PIECES)}
    out["ranks"] = [replace(rt, tables={}) for rt in ranks]
    out["ct_files"] = len(ct)
    out["ct_calls"] = pd.concat(ct, ignore_index=True) if ct else None
    return out


def combine(parts: list[dict[str, Any]], coded: bool = False) -> dict[str, Any]:
    """Reduce task: the results of consecutive ``analyze_files`` tasks as one (``batch``'s form), so that the
    client gets one DataFrame per table for many tasks; ``coded``: with their text columns as categoricals
    (``as_categories``), for the trip to the client."""
    out: dict[str, Any] = {key: [v for p in parts for v in p[key]] for key in ("notes", "world_sizes", "ignored",
                                                                           "skipped", "repaired", "ranks", "parts")}
    out["tables"] = {name: join_parts([p["tables"][name] for p in parts]) for name in (*TABLES, *PIECES)}
    if coded:
        out["tables"] = {name: as_categories(table) for name, table in out["tables"].items()}
    out["ct_files"] = sum(p["ct_files"] for p in parts)
    ct = [p["ct_calls"] for p in parts if p["ct_calls"] is not None]
    out["ct_calls"] = pd.concat(ct, ignore_index=True) if ct else None
    return out


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


def without_segments(result: dict[str, Any]) -> dict[str, Any]:
    """Task: a reduce task's result without the critical path's segments, for the client (10,000 A100 ranks:
    79 MiB of them pickled, of which the path takes a few walks)."""
    return {**result, "tables": {k: v for k, v in result["tables"].items() if k != "path_segments"}}


def segments_in(result: dict[str, Any], wanted: list[tuple[int, int]]) -> pd.DataFrame:
    """Task: the segments of the walks ``wanted`` in a reduce task's result (``stitch``)."""
    return walks_in(result["tables"]["path_segments"], wanted)
