"""The event store's schema, a public contract with a version: the columns of each rank's parts, the views over
them, and the manifest that lists the complete parts (``docs/store.md`` says it for users).

A store is a folder::

    STORE/tracefuse-store.json                    the manifest, written last: what a reader reads
    STORE/parts/<rank>-<token>/events.parquet     one rank's events, its flows
    STORE/parts/<rank>-<token>/flows.parquet

``<token>`` hashes what the part was made from (the input file's identity, the options, the rank's alignment, the
schema version): a part never changes once written, and a rank whose input did not change keeps its part.
"""
from __future__ import annotations

import pyarrow as pa

__all__ = ["EVENTS", "FLOWS", "ORIGINS", "PART_TABLES", "SCHEMA_VERSION", "VIEWS"]

SCHEMA_VERSION = 2
# The key of the JSON in each ``events.parquet``'s metadata that says how to undo the merge's rewrite, so that the
# analysis reads the rank's events as its trace wrote them: ``rank``, ``file``, ``base_ns`` (what ``ts_ns`` adds to
# the trace's own ns), ``base_time_ns`` (the trace's ``baseTimeNanoseconds``), ``header`` (its ``distributedInfo``,
# ``deviceProperties`` and ``host_name``), ``pids`` ([merged, as read] pairs), ``tids`` ([pid, ph, merged, as
# read], for the tids the merge made ints where the int names one tid of the pid's events of that phase; the pid
# as read), ``tids_merged`` ([pid, ph, merged, [as read]] where it names more) and ``durations`` ("int", "float"
# or "mixed": how the trace wrote ``dur``).
ORIGINS = b"tracefuse"

_TEXT = pa.dictionary(pa.int32(), pa.string())  # names, categories and phases repeat: dictionary-encoded

EVENTS = pa.schema([
    ("rank", pa.int32()),
    ("pid", pa.int64()),  # as the merge writes them: 2**22 + rank * 64 + slot
    ("tid", pa.int64()),
    ("ph", _TEXT),
    ("cat", _TEXT),
    ("name", _TEXT),
    ("ts_ns", pa.int64()),  # absolute integer ns, aligned as the merge aligns the rank
    ("dur_ns", pa.int64()),
    ("kind", _TEXT),  # device work: kernel, memcpy, memset or sync; null on the host
    ("stream", pa.int64()),  # device work: its stream
    ("correlation", pa.int64()),
    ("external_id", pa.int64()),
    ("step", pa.int64()),  # the ProfilerStep#N the event falls in (device work: its launch's), else null
    ("launch_op", _TEXT),  # device work: the innermost CPU op around the call that launched it
    ("input_dims", pa.list_(pa.list_(pa.int64()))),  # null when the trace's are not lists of ints (args has them)
    ("input_types", pa.list_(pa.string())),
    ("concrete_inputs", pa.list_(pa.string())),
    ("collective", _TEXT),  # args "Collective name"
    ("process_group", _TEXT),  # args "Process Group Name"
    ("group_ranks", _TEXT),  # args "Process Group Ranks", as the trace writes it
    ("group_size", pa.int64()),
    ("in_nelems", pa.int64()),
    ("out_nelems", pa.int64()),
    ("dtype", _TEXT),
    ("bytes", pa.int64()),  # args "bytes" (copies)
    ("args", pa.string()),  # the args no column above holds, as JSON text; null for an event without args
])

FLOWS = pa.schema([
    ("rank", pa.int32()),
    ("id", pa.int64()),  # as the merge writes it: unique across ranks
    ("ph", _TEXT),  # s, t or f
    ("cat", _TEXT),
    ("name", _TEXT),
    ("ts_ns", pa.int64()),
    ("pid", pa.int64()),
    ("tid", pa.int64()),
    ("bp", _TEXT),
])

PART_TABLES = {"events": EVENTS, "flows": FLOWS}

# What every store answers besides its parts (``ranks`` is the manifest's own table).
VIEWS = {
    "kernels": "SELECT rank, step, name, stream, ts_ns, dur_ns, correlation, launch_op FROM events "
               "WHERE kind = 'kernel'",
    "steps": "SELECT rank, step, ts_ns AS start_ns, ts_ns + dur_ns AS end_ns FROM events "
             "WHERE ph = 'X' AND regexp_full_match(name, 'ProfilerStep#[0-9]+') "
             "AND coalesce(NOT starts_with(lower(cat), 'gpu_'), true)",
}
