"""A store as the input of ``analyze`` and ``diff``: its ranks as the files they were indexed from, each read from
its part (``read_part``) as the events its trace holds, never from the JSON.

A part keeps the events as the merge rewrote them; the JSON of its ``events.parquet`` metadata (``schema.ORIGINS``)
says how to undo that: pids and tids as the trace wrote them, times less the rank's base, durations written as
ints or floats, and the header the analysis reads. The events come back as ``decode_trace`` gives them, so that
the analysis of a store is the analysis of its traces, table for table.
"""
from __future__ import annotations

from collections.abc import Mapping
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
from ..storage.files import options_for, storage_errors
from .query import open_store
from .schema import MANIFEST, ORIGINS

__all__ = ["is_store", "rank_events", "read_part", "stored_input"]

_NO_ARGS = Args()
_READ = {"events": ["pid", "tid", "ph", "cat", "name", "ts_ns", "dur_ns", "stream", "correlation", "collective",
                    "process_group", "group_ranks", "group_size", "in_nelems", "out_nelems", "dtype", "input_dims",
                    "input_types", "concrete_inputs", "args"],
         "flows": ["ph", "cat", "name", "pid", "tid", "ts_ns", "id"]}


def is_store(urlpath: Any, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``urlpath`` is one folder that holds a store's manifest."""
    if not isinstance(urlpath, str) or any(c in urlpath for c in "*?["):
        return False
    url = urlpath.rstrip("/")
    with storage_errors(url, storage_options):
        fs, root = fsspec.core.url_to_fs(url, **options_for(url, storage_options))
        return bool(fs.isfile(f"{root}/{MANIFEST}"))


def stored_input(url: str, storage_options: Mapping[str, Any] | None) -> StoredInput:
    """The store at ``url`` as ``analyze``'s input: its ranks as the files they were indexed from, each with its
    part."""
    store = open_store(url, storage_options)
    identity = {i.get("path"): i for i in store.manifest.get("made_from", {}).get("inputs", [])
                if isinstance(i, dict)}
    files = [InputFile(r["file"], identity.get(r["file"], {}).get("size"), r["rank"], "key",
                       stamp=identity.get(r["file"], {}).get("stamp"),
                       part=store.fs.unstrip_protocol(f"{store.root}/{r['part']}")) for r in store.manifest["ranks"]]
    return StoredInput(files, read_part, list(store.manifest.get("ignored", [])))


def read_part(f: InputFile, storage_options: Mapping[str, Any] | None) -> tuple[list[Event], dict[str, Any], int]:
    """The events of the rank whose part is ``f.part``, as ``decode_trace`` gives them from its trace, its header
    (``distributedInfo``, ``deviceProperties``, ``host_name``) and its ``baseTimeNanoseconds`` (0 when none)."""
    part = f.part or ""
    with storage_errors(part, storage_options):
        fs, root = fsspec.core.url_to_fs(part, **options_for(part, storage_options))
        try:
            events, flows = (pq.read_table(pa.BufferReader(fs.cat_file(f"{root}/{name}.parquet")), columns=columns)
                             for name, columns in _READ.items())
        except FileNotFoundError as e:
            raise StoreError(f"{part}: a part the store's manifest lists is missing ({e.filename or e}); rebuild the "
                             "store with `tracefuse index INPUT... -o STORE --force`") from None
    origins = orjson.loads((events.schema.metadata or {}).get(ORIGINS, b"null"))
    if not isinstance(origins, dict):
        raise StoreError(f"{part}/events.parquet: no {ORIGINS.decode()} metadata, so it was not written by "
                         "`tracefuse index`; rebuild the store with `tracefuse index INPUT... -o STORE --force`")
    base = origins.get("base_time_ns")
    return (rank_events(events, flows, origins), origins.get("header") or {},
            base if type(base) is int and base >= 0 else 0)


def _times(ns: list[int | None], shift: int, durations: str = "mixed") -> list[Any]:
    """µs as the trace wrote them, from integer ns less ``shift``: a float (``durations="float"``), an int
    (``"int"``), or (``"mixed"``) an int for whole µs; the float of ``n / 1000`` is the one the decimal text
    parses to."""
    out: list[Any] = []
    for v in ns:
        if v is None:
            out.append(None)
            continue
        v -= shift
        if durations == "float":
            out.append(v / 1000)
        elif durations == "int" or v % 1000 == 0:
            out.append(v // 1000)
        else:
            out.append(v / 1000)
    return out


def _values(column: pa.ChunkedArray) -> list[Any]:
    """A column's values as Python objects; a dictionary's through its few distinct values."""
    if not pa.types.is_dictionary(column.type):
        return column.to_pylist()
    arr = column.unify_dictionaries().combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    values = np.array([*arr.dictionary.to_pylist(), None], dtype=object)
    return values[arr.indices.fill_null(len(arr.dictionary)).to_numpy()].tolist()


def _raw(values: list[Any], fallback: list[msgspec.Raw]) -> list[msgspec.Raw]:
    """A list column as the raw JSON text ``Args`` holds, or what ``args`` kept where the column has none."""
    return [msgspec.Raw(orjson.dumps(v)) if v is not None else r for v, r in zip(values, fallback)]


def _either(column: list[Any], kept: list[Any]) -> list[Any]:
    """An argument from what ``args`` kept (a value no column could hold as it is), else from its column."""
    return [k if k is not None else c for c, k in zip(column, kept)]


def rank_events(events: pa.Table, flows: pa.Table, origins: Mapping[str, Any]) -> list[Event]:
    """A part's events (but metadata) and flows as the rank's trace holds them, as ``decode_trace`` decodes them;
    ``origins`` is the part's ``schema.ORIGINS`` JSON."""
    events = events.filter(pc.not_equal(events["ph"], "M"))
    col = {name: _values(events.column(name)) for name in events.column_names}
    n = events.num_rows
    pids = {merged: pid for merged, pid in origins["pids"]}
    tids = {(pid, merged): tid for pid, merged, tid in origins["tids"]}
    shift = origins["base_ns"]
    pid = [pids.get(p, p) for p in col["pid"]]
    tid = [tids.get((p, t), t) for p, t in zip(pid, col["tid"])] if tids else col["tid"]
    rest = col["args"]
    at = [i for i, a in enumerate(rest) if a is not None and a.startswith("{")]
    kept = [_NO_ARGS] * n
    if at:
        for i, a in zip(at, msgspec.json.decode(b"[" + ",".join(rest[i] for i in at).encode() + b"]",
                                                type=list[Args])):
            kept[i] = a
    fields = dict(zip(Args.__struct_fields__, zip(*map(msgspec.structs.astuple, kept)))) if n else \
        dict.fromkeys(Args.__struct_fields__, ())
    args = [Args(*values) for values in zip(
        _either(col["correlation"], fields["correlation"]), _either(col["stream"], fields["stream"]),
        _either(col["collective"], fields["collective"]), _either(col["process_group"], fields["pg_name"]),
        fields["pg_desc"], _either(col["group_ranks"], fields["group_ranks"]),
        _either(col["group_size"], fields["group_size"]), _either(col["dtype"], fields["dtype"]),
        _either(col["in_nelems"], fields["in_nelems"]), _either(col["out_nelems"], fields["out_nelems"]),
        fields["seq"], fields["comms_id"], fields["memory_bw"], _raw(col["input_dims"], fields["input_dims"]),
        _raw(col["input_types"], fields["input_types"]), _raw(col["concrete_inputs"], fields["concrete_inputs"]))]
    for i, a in enumerate(rest):  # an event without args, or whose args is not an object
        if a is None:
            args[i] = None
        elif not a.startswith("{"):
            args[i] = orjson.loads(a)
    ts = _times(col["ts_ns"], shift)
    dur = _times(col["dur_ns"], 0, origins["durations"])
    out = [Event(ph=ph, cat=c or "", name=nm or "", pid=p, tid=t, ts=s, dur=0 if d is None else d, args=a)
           for ph, c, nm, p, t, s, d, a in zip(col["ph"], col["cat"], col["name"], pid, tid, ts, dur, args)]
    fl = {name: _values(flows.column(name)) for name in flows.column_names}
    fpid = [pids.get(p, p) for p in fl["pid"]]
    ftid = [tids.get((p, t), t) for p, t in zip(fpid, fl["tid"])] if tids else fl["tid"]
    out += [Event(ph=ph, cat=c or "", name=nm or "", pid=p, tid=t, ts=s, id=i)
            for ph, c, nm, p, t, s, i in zip(fl["ph"], fl["cat"], fl["name"], fpid, ftid,
                                             _times(fl["ts_ns"], shift), fl["id"])]
    return out
