"""A trace's top-level keys, every one but ``traceEvents``, read without decoding the events.

The header pass of a merge needs each rank's ``baseTimeNanoseconds`` and ``distributedInfo``
before any rank is rewritten; reading them must cost a few kB per file, not a parse.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from typing import IO, Any

from isal import igzip
from isal.isal_zlib import error as IsalError

__all__ = ["GZIP_MAGIC", "read_header"]

GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 16
_HEADER_LIMIT = 1 << 24
_TAIL_LIMIT = 1 << 20  # the keys after the events are read from at most this many bytes at the end
_CLOSE_TEXT = re.compile(r"\][ \t\n\r]*[,}]")
_DAMAGED = (OSError, EOFError, ValueError, zlib.error, IsalError)  # what a damaged gzip stream raises
_WS = re.compile(r"[ \t\n\r]*")


def _scan_header(text: str, eof: bool) -> tuple[dict[str, Any], bool] | None:
    """Decode the top-level keys that precede ``traceEvents``.

    Returns ``(keys, reached_events)``, or None when more text is needed.
    """
    dec = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if i >= len(text):
        return None if not eof else ({}, False)
    if text[i] != "{":
        raise ValueError("the file does not start with a JSON object")
    i += 1
    header: dict[str, Any] = {}
    try:
        while True:
            i = _WS.match(text, i).end()
            if i >= len(text):
                return None
            if text[i] == "}":
                return header, False
            if text[i] == ",":
                i += 1
                continue
            key, i = dec.raw_decode(text, i)
            i = _WS.match(text, i).end()
            if text[i : i + 1] != ":":
                raise ValueError(f"expected ':' after key {key!r}")
            i = _WS.match(text, i + 1).end()
            if key == "traceEvents":
                return header, True
            header[key], i = dec.raw_decode(text, i)
    except (json.JSONDecodeError, IndexError):
        if eof:
            raise ValueError("the header is not valid JSON") from None
        return None


def read_header(raw: IO[bytes]) -> tuple[dict[str, Any], bool, int]:
    """Read the top-level keys of the trace in the seekable binary file ``raw`` (plain or gzip).

    Returns ``(header, complete, bytes_read)``. The keys before ``traceEvents`` come from the file's head.
    When those lack ``baseTimeNanoseconds`` or ``distributedInfo`` (traces before 2023 have no base; some
    tools re-save traces with the base after the events; Kineto's on-demand path writes ``distributedInfo``
    there), the keys after the events are read from the file's end: ranged reads of 64 KiB, then at most
    1 MiB less the head, for a plain file; a decompress-only pass for gzip. ``complete`` is False when the
    header could not be read this way (no ``traceEvents``, a damaged or truncated file, keys after the
    events over that size): the caller then parses the file whole, which also says what is wrong.
    """
    gz = raw.read(2) == GZIP_MAGIC
    raw.seek(0)
    header, reached, nbytes = _read_head(igzip.IGzipFile(fileobj=raw, mode="rb") if gz else raw)
    if not reached or ("baseTimeNanoseconds" in header and "distributedInfo" in header):
        return header, reached, nbytes
    raw.seek(0)
    trailer, read = _read_trailer(raw, gz, _TAIL_LIMIT - nbytes)
    if trailer is None:
        return header, False, nbytes + read
    return {**header, **trailer}, True, nbytes + read


def _storage_failure(e: BaseException) -> bool:
    """Whether ``e``, raised by a read, is the storage's (a timeout, a lost connection, an error number), not a
    damaged stream's: the run's storage errors report it, and a stall read again would take its bound twice."""
    return isinstance(e, (TimeoutError, ConnectionError)) or (isinstance(e, OSError) and e.errno is not None)


def _read_head(f: IO[bytes]) -> tuple[dict[str, Any], bool, int]:
    """The keys before ``traceEvents``, whether they end there, and the bytes read."""
    buf = b""
    while len(buf) < _HEADER_LIMIT:
        try:
            chunk = f.read(_CHUNK)
        except _DAMAGED as e:
            if _storage_failure(e):
                raise
            chunk = b""  # a damaged stream: the whole-file read reports it (or repairs it)
        buf += chunk
        try:
            got = _scan_header(buf.decode("utf-8", errors="replace"), eof=not chunk)
        except ValueError:
            return {}, False, len(buf)
        if got is not None:
            return got[0], got[1], len(buf)
        if not chunk:
            break
    return {}, False, len(buf)


def _read_trailer(raw: IO[bytes], gz: bool, limit: int) -> tuple[dict[str, Any] | None, int]:
    """The keys after ``traceEvents`` (None when they cannot be told) and the bytes read."""
    if gz:
        tail, whole = b"", True
        try:
            with igzip.IGzipFile(fileobj=raw, mode="rb") as f:
                while chunk := f.read(_TAIL_LIMIT):
                    whole = whole and len(tail) + len(chunk) <= _TAIL_LIMIT
                    tail = (tail + chunk)[-_TAIL_LIMIT:]
        except _DAMAGED as e:
            if _storage_failure(e):
                raise
            return None, raw.tell()
        return _scan_trailer(tail, whole), raw.tell()
    size = raw.seek(0, os.SEEK_END)
    tail = b""
    for want in (min(_CHUNK, limit), limit):  # the keys after the events are usually a few bytes
        start = max(0, size - want)
        raw.seek(start)
        tail = raw.read(size - len(tail) - start) + tail
        trailer = _scan_trailer(tail, start == 0)
        if trailer is not None or start == 0:
            break
    return trailer, len(tail)


def _scan_trailer(tail: bytes, whole: bool) -> dict[str, Any] | None:
    """The top-level keys after ``traceEvents`` from the last bytes of a document (all of it when ``whole``),
    or None when they cannot be told for sure.

    The events' array ends at the first ``]`` whose remainder is ``}`` or ``, "key": value, ... }`` and
    nothing more: a ``]`` inside an event leaves that event's ``}`` and the array's ``]`` after it, and a
    top-level list before the events leaves ``traceEvents`` in the remainder. Only a top-level list after the
    events could also end that way, and it comes after the array's ``]``; so the first such ``]`` is the
    array's, provided that the bytes hold the array's end: they do when they hold the whole document or when
    an event (``"ph"``) comes before that ``]``. Otherwise (the keys after the events are too long) None.
    A remainder is read one key and value at a time, so that a ``]`` inside an event costs what is read up to
    its event's end, not the rest of the bytes.
    """
    text = tail.decode("utf-8", errors="replace")  # the bytes may start inside a character
    for m in _CLOSE_TEXT.finditer(text):
        trailer = _members(text, m.end() - 1)
        if trailer is None or "traceEvents" in trailer:
            continue
        return trailer if whole or text.find('"ph"', 0, m.start()) >= 0 else None
    return None


def _members(text: str, i: int) -> dict[str, Any] | None:
    """The object whose members follow ``text[i]`` (``,`` or ``}``) to the end of ``text``; None when they are
    not that."""
    dec = json.JSONDecoder()
    out: dict[str, Any] = {}
    try:
        while text[i] == ",":
            i = _WS.match(text, i + 1).end()
            key, i = dec.raw_decode(text, i)
            i = _WS.match(text, i).end()
            if not isinstance(key, str) or text[i] != ":":
                return None
            out[key], i = dec.raw_decode(text, _WS.match(text, i + 1).end())
            i = _WS.match(text, i).end()
    except (json.JSONDecodeError, IndexError):
        return None
    return out if text[i : i + 1] == "}" and _WS.match(text, i + 1).end() == len(text) else None