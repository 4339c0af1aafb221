"""A trace's events as the analysis reads them: msgspec structs whose types check what ``RankEvents`` checks and
whose ``args`` hold only the keys the analysis reads (``decode_trace``), and Chrome's ``B``/``E`` pairs as
durations (``durations``)."""
from __future__ import annotations

from typing import Any

import msgspec
import orjson
from msgspec import UNSET, Raw, Struct, UnsetType

from ...kineto.events import begin_end_pairs, decode_or_none
from ...kineto.times import Duration, Micros, to_ns
from ...kineto.vocabulary import KnownCategory, KnownPhase

__all__ = ["NO_ARGS", "Args", "Event", "Trace", "decode_trace", "durations", "events_decoder", "json_text"]

_ARG_KEYS = {"collective": "Collective name", "pg_name": "Process Group Name",
             "pg_desc": "Process Group Description", "group_ranks": "Process Group Ranks", "group_size": "Group size",
             "in_nelems": "In msg nelems", "out_nelems": "Out msg nelems", "seq": "Seq", "comms_id": "Comms Id",
             "input_dims": "Input Dims", "input_types": "Input type", "concrete_inputs": "Concrete Inputs",
             "memory_bw": "memory bandwidth (GB/s)", "sequence": "Sequence number"}

class Args(Struct, gc=False, rename=_ARG_KEYS):
    """The ``args`` keys the analysis reads; the decoder skips the others unread.

    ``Input Dims``, ``Input type`` and ``Concrete Inputs`` stay JSON text: few of them are read, and
    ``rank.analyze_events`` empties them once read (each is a view into the whole text decoded).
    """

    correlation: Any = None
    stream: Any = None
    collective: Any = None
    pg_name: Any = None
    pg_desc: Any = None
    group_ranks: Any = None
    group_size: Any = None
    dtype: Any = None
    in_nelems: Any = None
    out_nelems: Any = None
    seq: Any = None
    comms_id: Any = None
    memory_bw: Any = None  # a copy's or set's, as Kineto measures it
    input_dims: Raw = Raw()  # empty when absent
    input_types: Raw = Raw()
    concrete_inputs: Raw = Raw()
    sequence: Any = None  # autograd's sequence number: a forward op and its backward share it


NO_ARGS = Args()


class Event(Struct, kw_only=True, gc=False):
    """One event, typed as ``RankEvents`` checks it (which skips ``python_function`` events, and lets ``M`` lack ts)."""

    ph: str
    cat: str = ""
    name: str = ""
    pid: int | str
    tid: int | str | None = None
    ts: Micros
    dur: Duration = 0
    id: int | str | UnsetType = UNSET
    args: Args | list | str | int | float | bool | None = None


class Trace(Struct, gc=False):
    """A trace file as ``decode_trace`` gives it: its events and the top-level keys the analysis reads."""

    traceEvents: list[Event]
    distributedInfo: Any = None
    host_name: Any = None
    global_rank: Any = None  # Composer's, at the top of an object-form trace
    deviceProperties: Any = None
    baseTimeNanoseconds: Any = None
    metadata: Any = None


class _KinetoEvent(Event):
    """An event whose ph and cat decode as shared string objects (see ``fastpath``); others decode as ``Event``."""

    ph: KnownPhase  # type: ignore[assignment]
    cat: KnownCategory = ""  # type: ignore[assignment]


class _KinetoTrace(Trace):
    traceEvents: list[_KinetoEvent]  # type: ignore[assignment]


_trace_decoders = (msgspec.json.Decoder(_KinetoTrace), msgspec.json.Decoder(Trace))
events_decoder = msgspec.json.Decoder(list[Event])


def decode_trace(data: bytes) -> Trace | None:
    """A trace's text as structs, or None when it needs the general path (``orjson`` and ``RankEvents``).

    None for whatever the types reject: bad JSON, a bad event (the general path
    then says what is wrong), and a few things the general path accepts (an odd
    ``python_function`` event, which it skips unread, or an ``M`` event without ``ts``).
    One difference the other way: an int id wider than 64 bits, which orjson reads
    as a float that ``RankEvents`` rejects, is taken as it is.

    Parameters
    ----------
    data
        The whole file, uncompressed.

    Returns
    -------
    Trace or None
    """
    return decode_or_none(data, *_trace_decoders)


def json_text(raw: bytes) -> str:
    """A raw ``args`` value as compact JSON text ("" when absent or null)."""
    value = orjson.loads(raw) if raw else None
    return "" if value is None else orjson.dumps(value).decode()


def durations(events: list[Event]) -> tuple[list[Event], int, int]:
    """The ``B``/``E`` pairs as ``X`` events (``kineto.events.begin_end_pairs``), ``args`` and ``cat`` from the ``B``;
    a ``B`` left open ends at the rank's last time. Also how many ``B`` were left open and ``E`` closed nothing."""
    marks = [(i, e.ph, e.pid, e.tid, e.ts, e.name, e.cat) for i, e in enumerate(events)
             if (e.ph == "B" or e.ph == "E") and e.cat != "python_function"]
    if not marks:
        return [], 0, 0
    pairs, unclosed, unopened = begin_end_pairs(marks)
    ends = [(events[b], to_ns(events[e].ts)) for b, e in pairs]
    if unclosed:
        last = max(to_ns(e.ts) + to_ns(e.dur) for e in events if e.ph != "M" and e.cat != "python_function")
        ends += [(events[b], last) for b in unclosed]
    spans = []
    for b, end in ends:
        ns = end - to_ns(b.ts)
        spans.append(msgspec.structs.replace(b, ph="X", dur=ns // 1000 if ns % 1000 == 0 else ns / 1000))
    return spans, len(unclosed), len(unopened)
