"""The Chrome trace's array form (a bare JSON list of events), as MosaicML Composer's ``JSONTraceHandler`` and the
legacy autograd profiler write it, read as the object form that the rest of the package reads.

The Chrome format lets the array lack its closing ``]``, so that a writer that died still leaves a trace. An array
with the ``global_rank`` of several ranks is Composer's merge of them (``COMPOSER_MERGED``), which a merge or an
analysis passes over in a folder, as it passes over its own merged outputs.
Composer keeps the rank and its clock sync in ``M`` events, which become the top-level keys Composer's own
merger reads from an object-form trace (``global_rank``, ``clock_sync_timestamp_us``) plus
``clock_sync_error_bound``. Composer writes its own events in absolute wall-clock µs and appends the rank's torch
profiler (Kineto) events with their ``ts`` relative to a ``baseTimeNanoseconds`` it drops; that base is found
again (``_kineto_base``) and every time made relative to it, so the file reads as one Kineto trace.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import TraceFormatError

__all__ = ["COMPOSER_KEYS", "COMPOSER_MERGED", "KINETO_QUARTER_NS", "MERGED_BY_COMPOSER", "as_object", "close_array",
           "is_array_text"]

COMPOSER_KEYS = ("global_rank", "clock_sync_timestamp_us", "clock_sync_error_bound")
COMPOSER_MERGED = "composer_merged_ranks"  # the key ``as_object`` sets on a trace Composer's merge_traces wrote
MERGED_BY_COMPOSER = ("a trace merged by Composer's merge_traces (its JSONTraceHandler writes merged_trace.json "
                      "beside the rank files)")
KINETO_QUARTER_NS = 7_889_238 * 10**9  # Kineto's base is the wall clock floored to this (output_json.h)
_ABSOLUTE_US = 1e14  # µs: at or above, an absolute Unix time (after 1973); below, relative to a base
_QUARTERS_LIMIT = 2**62 // KINETO_QUARTER_NS  # a base beyond is no time (2116)
_OPEN = re.compile(rb"\s*\[")


def is_array_text(data: bytes) -> bool:
    """True when the text starts a JSON list (after white space)."""
    return _OPEN.match(data) is not None


def close_array(data: bytes) -> bytes:
    """The text of an array-form trace that lacks its closing ``]``, closed: a trailing ``,`` becomes ``]``, and
    a ``]`` follows a last event that ends the text."""
    text = data.rstrip()
    return (text[:-1] if text.endswith(b",") else text) + b"]"


def as_object(events: list[Any], who: str) -> dict[str, Any]:
    """The object form of the array-form trace ``events``: ``traceEvents`` plus Composer's keys, and
    ``baseTimeNanoseconds`` when absolute and relative times mix.

    Raises
    ------
    TraceFormatError
        When the list does not hold events (objects), such as a list of numbers.
    """
    if events and type(events[0]) is not dict:
        raise TraceFormatError(f"{who}: the top level is a JSON list of {type(events[0]).__name__}s, not of trace "
                               "events; is this a Kineto/Chrome trace?")
    doc: dict[str, Any] = {}
    ranks = set()
    for ev in events:
        if type(ev) is dict and ev.get("ph") == "M" and ev.get("name") in COMPOSER_KEYS:
            args = ev.get("args")
            if type(args) is dict and "value" in args:
                doc.setdefault(ev["name"], args["value"])
                if ev["name"] == "global_rank" and type(args["value"]) is int:
                    ranks.add(args["value"])
    if len(ranks) > 1:  # every rank's metadata in one file: Composer's merge of the ranks
        return {COMPOSER_MERGED: sorted(ranks), "traceEvents": events}
    base = _kineto_base(events)
    if base is not None:
        shift = base // 1000
        for ev in events:
            ts = ev.get("ts") if type(ev) is dict else None
            if (type(ts) is int or type(ts) is float) and ts >= _ABSOLUTE_US:
                ev["ts"] = ts - shift
        doc["baseTimeNanoseconds"] = base
    doc["traceEvents"] = events
    return doc


def _kineto_base(events: list[Any]) -> int | None:
    """The ``baseTimeNanoseconds`` of the relative times among absolute ones, or None when the times do not mix.

    Both clocks end with the profiling cycle (Composer writes its last events as it ends), so the latest
    absolute time less the latest relative one is the base plus less than the cycle; Kineto's base is a
    multiple of a quarter year (``KINETO_QUARTER_NS``), the nearest one to that difference. Exact while the two
    last times lie within 45 days of each other.
    """
    absolute = relative = None
    for ev in events:
        ts = ev.get("ts") if type(ev) is dict else None
        if type(ts) is not int and type(ts) is not float or ev.get("ph") == "M":
            continue
        if ts >= _ABSOLUTE_US:
            absolute = ts if absolute is None or ts > absolute else absolute
        elif ts >= 0:
            relative = ts if relative is None or ts > relative else relative
    if absolute is None or relative is None:
        return None
    quarters = round((absolute - relative) * 1000 / KINETO_QUARTER_NS)
    return quarters * KINETO_QUARTER_NS if 0 < quarters < _QUARTERS_LIMIT else None
