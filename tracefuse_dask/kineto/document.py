"""A trace file's bytes as a JSON document: orjson with clear errors, the array form read as the object form
(``array_form``), the repair of a truncated file, and the GC pause that parsing big files wants."""
from __future__ import annotations

import contextlib
import gc
import re
import threading
from collections.abc import Iterator
from typing import Any

import orjson

from ..errors import TraceFormatError
from .array_form import as_object, close_array, is_array_text

__all__ = ["check_document", "decode_json", "paused_gc"]


_gc_lock = threading.Lock()
_gc_users = 0
_gc_was_enabled = True  # the collector's state before the first of the current users paused it


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic GC while a rank is parsed and rewritten (or analysed, or the analysis reduced).

    Parsed JSON holds no reference cycles, so the collector only rescans the
    growing object graph: it costs 1.4-3x the parse time on big ranks.
    Reference counting still frees everything. Safe with several task threads; a collector the caller had
    turned off stays off.
    """
    global _gc_users, _gc_was_enabled
    with _gc_lock:
        if not _gc_users:
            _gc_was_enabled = gc.isenabled()
        _gc_users += 1
        gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if not _gc_users and _gc_was_enabled:
                gc.enable()


_EVENT_GAP = re.compile(rb"\}\s*,\s*\{")
_REPAIR_TAIL = 1 << 22
_REPAIR_TRIES = 64


def _repair(data: bytes, who: str, array: bool) -> tuple[Any, str]:
    """Close a truncated trace after its last complete event, as Composer's loader does."""
    start = data.find(b"[") if array else data.find(b'"traceEvents"')
    if start < 0:
        raise TraceFormatError(f"{who}: truncated before its traceEvents; nothing to recover. Re-export the "
                               "trace or drop this file")
    close = b"]" if array else b"]}"
    lo = max(start, len(data) - _REPAIR_TAIL)
    cuts = [m.start() + 1 for m in _EVENT_GAP.finditer(data, lo)][::-1][:_REPAIR_TRIES]
    cuts += [data.find(b"[", start) + 1]  # no complete event at all
    for cut in cuts:
        try:
            doc = orjson.loads(data[:cut] + close)
        except orjson.JSONDecodeError:
            continue
        events = doc if array else doc.get("traceEvents") if isinstance(doc, dict) else None
        if isinstance(events, list):
            note = (f"{who}: repaired a truncated trace: the data ends at byte {len(data):,}; recovered "
                    f"{len(events):,} complete events up to byte {cut:,}")
            return doc, note
    raise TraceFormatError(f"{who}: truncated, and no complete event could be recovered near the cut at byte "
                           f"{len(data):,}. Re-export the trace or drop this file")


def decode_json(data: bytes, path: str, *, rank: int | None = None, cut_gzip: bool = False,
                repair: bool = False) -> tuple[Any, int, str | None]:
    """Parse the bytes of the file ``path`` with orjson (see ``parse_json``); an array-form trace comes back in
    the object form (``array_form.as_object``), also when it lacks its closing ``]``."""
    who = f"{path}" + (f" (rank {rank})" if rank is not None else "")
    doc, note = _decode(data, who, cut_gzip, repair)
    return (as_object(doc, who) if type(doc) is list else doc), len(data), note


def _decode(data: bytes, who: str, cut_gzip: bool, repair: bool) -> tuple[Any, str | None]:
    if not data.strip():
        raise TraceFormatError(f"{who}: the file is empty; the profiler probably died before writing it. "
                               "Re-export the trace or drop this file")
    try:
        return orjson.loads(data), None
    except orjson.JSONDecodeError as e:
        array = is_array_text(data)
        if array:
            with contextlib.suppress(orjson.JSONDecodeError):
                doc = orjson.loads(close_array(data))  # the format lets the array lack its "]"
                return doc, (f"{who}: repaired a truncated trace: the gzip stream ends early, at byte {len(data):,} of "
                             f"its text; recovered {len(doc):,} complete events" if cut_gzip else None)
        truncated = cut_gzip or e.pos >= len(data.rstrip()) - 1
        if repair and truncated:
            return _repair(data, who, array)
        if data[257:262] == b"ustar":  # the magic of a POSIX TAR header
            raise TraceFormatError(f"{who}: a TAR archive, not a JSON trace (`--format perfetto-archive` writes "
                                   "these: open it in Perfetto v58+); give the per-rank traces instead") from None
        if "UTF-8" in e.msg:
            raise TraceFormatError(f"{who}: not UTF-8 text near byte {e.pos:,} ({e.msg}); the file is damaged "
                                   "or not a trace. Re-export the trace or drop this file") from None
        if truncated:
            raise TraceFormatError(f"{who}: not valid JSON: the file ends early, at byte {len(data):,} of its text: it "
                                   "was probably truncated; pass --repair to recover its complete events, or "
                                   "re-export the trace or drop this file") from None
        near = data[max(0, e.pos - 24):e.pos + 24].decode("utf-8", "replace")  # what is there, not the parser's words
        raise TraceFormatError(f"{who}: not valid JSON at byte {e.pos:,}, near {near!r}: the file is damaged or not a "
                               "trace. Re-export the trace or drop this file") from None


def check_document(doc: Any, who: str) -> None:
    """Raise TraceFormatError unless ``doc`` is an object with a ``traceEvents`` list."""
    if not isinstance(doc, dict):
        raise TraceFormatError(f"{who}: the top level is a JSON {type(doc).__name__}, not an object "
                               "with traceEvents; is this a Kineto/Chrome trace?")
    if "traceEvents" not in doc:
        raise TraceFormatError(f"{who}: no traceEvents key; is this a Kineto/Chrome trace?")
    if not isinstance(doc["traceEvents"], list):
        raise TraceFormatError(f"{who}: traceEvents is a {type(doc['traceEvents']).__name__}, not a list")
