"""A store as the input of ``analyze`` and ``diff``: its ranks as the files they were indexed from, each read from
its part (``read_part``) as the events its trace holds, never from the JSON.

A part keeps the events as the merge rewrote them; the JSON of its ``events.parquet`` metadata (``schema.ORIGINS``)
says how to undo that: pids and tids as the trace wrote them, times less the rank's base, durations written as
ints or floats, and the header the analysis reads. The events come back as ``decode_trace`` gives them, so that
the analysis of a store is the analysis of its traces, table for table.
"""
from __future__ import annotations

from collections.abc import Mapping
from itertools import compress
from typing import Any

import fsspec
import msgspec
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..analysis.per_rank.decode import Args, Event
from ..analysis.schema import StoredInput
from ..errors import StoreError
from ..model import InputFile
from ..storage.files import arrow_file, options_for, storage_errors
from .query import offline_duckdb, open_store
from .schema import ORIGINS

__all__ = ["rank_events", "read_part", "stored_input"]

_NO_ARGS = Args()
_LISTS = ("input_dims", "input_types", "concrete_inputs")
_READ = {"events": ["pid", "tid", "ph", "cat", "name", "ts_ns", "dur_ns", "stream", "correlation", "collective",
                    "process_group", "group_ranks", "group_size", "in_nelems", "out_nelems", "dtype", "input_dims",
                    "input_types", "concrete_inputs", "args"],
         "flows": ["ph", "cat", "name", "pid", "tid", "ts_ns", "id"]}


def stored_input(url: str, storage_options: Mapping[str, Any] | None) -> StoredInput:
    """The store at ``url`` as ``analyze``'s input: its ranks as the files they were indexed from, each with its
    part."""
    store = open_store(url, storage_options)
    return StoredInput(store.inputs(), read_part, list(store.manifest.get("ignored", [])))


def read_part(f: InputFile,
              storage_options: Mapping[str, Any] | None) -> tuple[list[Event], dict[str, Any], int, list[str], dict[str, int]]:
    """The events of the rank whose part is ``f.part``, as ``decode_trace`` gives them from its trace, its header
    (``distributedInfo``, ``deviceProperties``, ``host_name``), its ``baseTimeNanoseconds`` (0 when none), what
    the store could not give back as the trace had it, and the trace's events that the part does not hold (by
    the analysis's reasons, for its account)."""
    part = f.part or ""
    rebuild = "rebuild the store with `tracefuse index INPUT... -o STORE --force`"
    tables = {}
    with storage_errors(part, storage_options):
        fs, root = fsspec.core.url_to_fs(part, **options_for(part, storage_options))
        for name, columns in _READ.items():
            try:
                tables[name] = pq.read_table(arrow_file(fs.cat_file(f"{root}/{name}.parquet")), columns=columns)
            except FileNotFoundError:
                raise StoreError(f"{part}/{name}.parquet, rank {f.rank_hint}: a part the store's manifest lists is "
                                 f"missing; {rebuild}") from None
            except (pa.ArrowException, OSError) as e:
                raise StoreError(f"{part}/{name}.parquet, rank {f.rank_hint}: not a whole Parquet file of a store "
                                 f"({type(e).__name__}: {e}); {rebuild}") from None
    try:
        origins = orjson.loads((tables["events"].schema.metadata or {}).get(ORIGINS, b"null"))
        notes = [f"{f.path} (rank {f.rank_hint}): the tids {', '.join(map(repr, read))} of pid {pid}'s {ph!r} "
                 f"events are one tid, {merged}, in the store, as in a merge; its analysis of them may differ from "
                 "the trace's" for pid, ph, merged, read in origins.get("tids_merged", [])]
        events = rank_events(tables["events"], tables["flows"], origins)
        return (events, origins.get("header") or {},
                base if type(base := origins.get("base_time_ns")) is int and base >= 0 else 0, notes,
                _not_stored(events, origins))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise StoreError(f"{part}/events.parquet, rank {f.rank_hint}: its {ORIGINS.decode()} metadata is missing or "
                         f"not as `tracefuse index` writes it ({type(e).__name__}: {e}); {rebuild}") from None


def _times(ns: pa.ChunkedArray, shift: int, durations: str = "mixed") -> list[Any]:
    """µs as the trace wrote them, from integer ns less ``shift``: floats (``durations="float"``), ints (``"int"``),
    or (``"mixed"``) ints for whole µs; None where null. The float of ``n / 1000``, correctly rounded as numpy
    divides below 2**53 ns and Python above, is the one the trace's decimal text parses to."""
    v = pc.fill_null(ns, 0).to_numpy() - shift
    whole = np.full(len(v), durations == "int") if durations != "mixed" else v % 1000 == 0
    out = np.empty(len(v), dtype=object)
    out[whole] = (v[whole] // 1000).astype(object)
    part = ~whole
    out[part] = (v[part] / 1000).astype(object)
    for i in np.flatnonzero(part & (np.abs(v) >= 2**53)).tolist():
        out[i] = int(v[i]) / 1000
    if ns.null_count:
        out[ns.is_null().to_numpy(zero_copy_only=False)] = None
    return out.tolist()


def _values(column: pa.ChunkedArray) -> list[Any]:
    """A column's values as Python objects; a dictionary's through its few distinct values."""
    if not pa.types.is_dictionary(column.type):
        return column.to_pylist()
    arr = column.unify_dictionaries().combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    values = np.array([*arr.dictionary.to_pylist(), None], dtype=object)
    return values[arr.indices.fill_null(len(arr.dictionary)).to_numpy()].tolist()


def _json_texts(events: pa.Table, columns: tuple[str, ...]) -> dict[str, pa.ChunkedArray]:
    """The list columns ``columns`` as JSON text, written by DuckDB (ten times faster than a loop over them)."""
    lists = events.select(list(columns))  # noqa: F841 - the query's table
    with offline_duckdb(threads=1) as con:
        got = con.sql(f"SELECT {', '.join(f'to_json({c}) AS {c}' for c in columns)} FROM lists").to_arrow_table()
    return {c: got.column(c) for c in columns}


def _raw(texts: pa.ChunkedArray, fallback: tuple[Any, ...]) -> list[Any]:
    """A list column's JSON text as the raw text ``Args`` holds, or what ``args`` kept where the column has none:
    one ``Raw`` per distinct text (shapes repeat)."""
    coded = pc.dictionary_encode(texts.combine_chunks())
    raws = np.fromiter((msgspec.Raw(v.encode()) for v in coded.dictionary.to_pylist()), dtype=object,
                       count=len(coded.dictionary))
    if not coded.null_count:
        return raws[coded.indices.to_numpy()].tolist()
    picked = raws[coded.indices.fill_null(0).to_numpy()] if len(raws) else np.empty(len(coded), dtype=object)
    kept = np.fromiter(fallback, dtype=object, count=len(fallback))
    return np.where(coded.is_null().to_numpy(zero_copy_only=False), kept, picked).tolist()


def _either(column: list[Any], kept: tuple[Any, ...]) -> list[Any]:
    """An argument from what ``args`` kept (a value no column could hold as it is), else from its column."""
    if kept.count(None) == len(kept):
        return column
    return [k if k is not None else c for c, k in zip(column, kept)]


def _not_stored(events: list[Event], origins: Mapping[str, Any]) -> dict[str, int]:
    """The events of the rank's trace that its part does not hold, by the analysis's reasons
    (``analysis.schema.LEFT_OUT``): metadata, python_function events, slices with a negative duration, and what
    the index's filters left out."""
    if "events_in" not in origins:  # a part an older version wrote: the account is of the events it holds
        return {}
    stored_pyfunc = sum(1 for e in events if e.cat == "python_function")
    out = {"metadata": origins["metadata_in"], "python_function": origins["python_function_in"] - stored_pyfunc,
           "negative_dur": origins.get("negative_dur_in", 0)}
    out["not_in_store"] = origins["events_in"] - len(events) - sum(out.values())
    return out


def rank_events(events: pa.Table, flows: pa.Table, origins: Mapping[str, Any]) -> list[Event]:
    """A part's events (but metadata) and flows as the rank's trace holds them, as ``decode_trace`` decodes them;
    ``origins`` is the part's ``schema.ORIGINS`` JSON."""
    col = {name: _values(events.column(name)) for name in events.column_names
           if name not in ("pid", "tid", "ts_ns", "dur_ns", *_LISTS)}
    col |= _json_texts(events, _LISTS)
    n = events.num_rows
    pid, tid = _ids(events, col["ph"], origins)
    rest = col["args"]
    objects = pc.fill_null(pc.starts_with(events.column("args"), "{"), False).to_numpy(zero_copy_only=False)
    at = np.flatnonzero(objects)
    decoded = msgspec.json.decode(b"[" + ",".join(compress(rest, objects)).encode() + b"]",
                                  type=list[Args]) if len(at) else []
    if len(at) == n:
        kept = decoded
    else:  # the others keep no argument: ``Args()``'s defaults
        scattered = np.full(n, _NO_ARGS, dtype=object)
        scattered[at] = _objects(decoded)
        kept = scattered.tolist()
    fields = dict(zip(Args.__struct_fields__, zip(*map(msgspec.structs.astuple, kept)))) if n else \
        dict.fromkeys(Args.__struct_fields__, ())
    args = [Args(*values) for values in zip(
        _either(col["correlation"], fields["correlation"]), _either(col["stream"], fields["stream"]),
        _either(col["collective"], fields["collective"]), _either(col["process_group"], fields["pg_name"]),
        fields["pg_desc"], _either(col["group_ranks"], fields["group_ranks"]),
        _either(col["group_size"], fields["group_size"]), _either(col["dtype"], fields["dtype"]),
        _either(col["in_nelems"], fields["in_nelems"]), _either(col["out_nelems"], fields["out_nelems"]),
        fields["seq"], fields["comms_id"], fields["memory_bw"], _raw(col["input_dims"], fields["input_dims"]),
        _raw(col["input_types"], fields["input_types"]), _raw(col["concrete_inputs"], fields["concrete_inputs"]),
        fields["sequence"])]
    if len(at) < n:
        for i in np.flatnonzero(~objects).tolist():  # an event without args, or whose args is not an object
            args[i] = None if rest[i] is None else orjson.loads(rest[i])
    ts = _times(events.column("ts_ns"), shift := origins["base_ns"])
    dur = _times(events.column("dur_ns"), 0, origins["durations"])
    out = [Event(ph=ph, cat=c or "", name=nm or "", pid=p, tid=t, ts=s, dur=0 if d is None else d, args=a)
           for ph, c, nm, p, t, s, d, a in zip(col["ph"], col["cat"], col["name"], pid, tid, ts, dur, args)
           if ph != "M"]  # metadata: the merge's, not the trace's, and no analysis reads it
    fl = {name: _values(flows.column(name)) for name in ("ph", "cat", "name", "id")}
    fpid, ftid = _ids(flows, fl["ph"], origins)
    out += [Event(ph=ph, cat=c or "", name=nm or "", pid=p, tid=t, ts=s, id=i)
            for ph, c, nm, p, t, s, i in zip(fl["ph"], fl["cat"], fl["name"], fpid, ftid,
                                             _times(flows.column("ts_ns"), shift), fl["id"])]
    return out


def _ids(table: pa.Table, ph: list[Any], origins: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    """A part's pids and tids as the trace wrote them, from the merge's (``origins``' maps): looked up once per
    distinct pid, and per event only where a tid was mapped."""
    pids = {merged: pid for merged, pid in origins["pids"]}
    tids = {(pid, ph, merged): tid for pid, ph, merged, tid in origins["tids"]}
    merged_pid, merged_tid = table.column("pid"), table.column("tid")
    if merged_pid.null_count:
        pid = [pids.get(p, p) for p in merged_pid.to_pylist()]
    else:
        distinct, inverse = np.unique(merged_pid.to_numpy(), return_inverse=True)
        pid = _objects([pids.get(p, p) for p in distinct.tolist()])[inverse].tolist()
    tid = merged_tid.to_pylist()
    if tids:
        for i in np.flatnonzero(pc.is_in(merged_tid, pa.array(sorted({t for _, _, t in tids}), pa.int64()))
                                .fill_null(False).to_numpy(zero_copy_only=False)).tolist():
            tid[i] = tids.get((pid[i], ph[i], tid[i]), tid[i])
    return pid, tid


def _objects(values: list[Any]) -> np.ndarray:
    """``values`` as a 1-d object array, item for item (numpy would unpack an item that is a sequence)."""
    return np.fromiter(values, dtype=object, count=len(values))
