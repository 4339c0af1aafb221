"""collective_trace input: its per-rank ``[TRACE]`` logs and CSV exports, parsed and summarised.

collective_trace (PyPI ``collective-trace``) wraps ``torch.distributed`` calls and logs one line
per call. Its timestamps are ``time.perf_counter()`` values: they cannot be aligned across hosts,
so nothing here treats them as wall time. Straggler hints come from durations alone: in a
collective, the rank that arrives last waits least, so it shows the shortest duration. Its
``GROUP_<n>`` label is numbered per rank, so a group is known by its ranks (as a rank spec,
``0-63:8``); log sizes are MB rounded to 0.01 (bytes are exact in the CSV).
"""
from __future__ import annotations

import csv
import io
import re
from typing import Any

import numpy as np
import pandas as pd

from ...errors import TraceFormatError
from ...kineto.collectives import ITEMSIZE, canonical_op, group_spec
from ..schema import CT_COLUMNS

__all__ = ["looks_like_collective_trace", "parse_collective_trace"]

_CSV_HEADER = "function,timestamp,duration,tensor_shape,tensor_dtype,tensor_size"
_TAG = re.compile(r"\[(TRACE|BARRIER|BATCH|COALESCE)\] global rank \d+")
_MB = 1024 * 1024
_LINES = {
    "TRACE": re.compile(
        r"\[TRACE\] global rank (?P<rank>\d+) in GROUP_\S+ - (?P<op>\S+) - async:(?P<async>\d),\s*"
        r"Size: (?P<mb>[\d.]+) MB,\s*Shape: (?P<shape>.*?),\s*Dtype: (?P<dtype>\S+),\s*"
        r"Duration: (?P<ms>[\d.]+) ms,\s*GROUP size (?P<size>\d+)\s*=\s*(?P<ranks>\[[^\]]*\]),\s*"
        r"call count: (?P<count>\d+)"),
    "BARRIER": re.compile(
        r"\[BARRIER\] global rank (?P<rank>\d+) -\s*barrier - async:(?P<async>\d),\s*Duration: (?P<ms>[\d.]+) ms"),
    "BATCH": re.compile(
        r"\[BATCH\] global rank (?P<rank>\d+) - send: (?P<send>\d+) bytes \([\d.]+ MB\),\s*"
        r"shape: \[(?P<send_shapes>.*?)\]"
        r".*?recv: (?P<recv>\d+) bytes \([\d.]+ MB\),\s*shape: \[(?P<recv_shapes>.*?)\[.*?ops count: (?P<ops>\d+)"),
    "COALESCE": re.compile(
        r"\[COALESCE\] global rank (?P<rank>\d+) in GROUP_\S+ - coalesced_ops - async:(?P<async>\d),\s*"
        r"conuters: (?P<count>\d+),\s*name: (?P<op>\S+),\s*sizes: (?P<bytes>\d+),\s*Duration: (?P<ms>[\d.]+) ms,"
        r"\s*GROUP size (?P<size>\d+)\s*=\s*(?P<ranks>\[[^\]]*\])"),
}


def looks_like_collective_trace(head: bytes) -> bool:
    """True when the first bytes of a file are a collective_trace log or CSV export (never a JSON trace)."""
    text = head[:8192].decode("utf-8", "replace").lstrip("\ufeff")
    if text.lstrip().startswith(("{", "[{", "[\n", "[ ")):
        return False
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    return first == _CSV_HEADER or any(_TAG.search(line) for line in text.splitlines()[:200])


def parse_collective_trace(data: bytes, path: str, rank: int | None = None) -> pd.DataFrame:
    """One row per logged call, from a log (``[TRACE]``, ``[BARRIER]``, ``[BATCH]``, ``[COALESCE]``) or a CSV.

    Parameters
    ----------
    data
        The file's bytes.
    path
        The file, for messages and the ``path`` column.
    rank
        The rank of a CSV export (it holds none; take it from the file name). Log lines carry theirs.

    Raises
    ------
    TraceFormatError
        When no line is a collective_trace line, or a tagged line does not parse.
    """
    text = data.decode("utf-8", "replace")
    if text.lstrip("\ufeff").startswith(_CSV_HEADER):
        rows = _csv_rows(text, path, rank)
    else:
        rows = _log_rows(text, path)
    if not rows:
        raise TraceFormatError(f"{path}: no collective_trace lines ([TRACE], [BARRIER], [BATCH], [COALESCE]) and no "
                               f"CSV header {_CSV_HEADER!r}; is this a collective_trace log or export?")
    df = pd.DataFrame(rows, columns=CT_COLUMNS)
    return df.astype({"rank": "Int64", "group_size": "Int64", "bytes": "Int64", "call_count": "Int64",
                      "duration_us": float, "timestamp": float})


def _log_rows(text: str, path: str) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        tag = _TAG.search(line)
        if tag is None:
            continue
        kind = tag.group(1)
        m = _LINES[kind].search(line)
        if m is None:
            raise TraceFormatError(f"{path}: line {n} is a collective_trace {kind} line that does not parse: "
                                   f"{line.strip()[:160]!r}; is the file cut or from another version?")
        g = m.groupdict()
        row = {"rank": int(g["rank"]), "kind": kind.lower(), "op": "barrier", "group": None, "group_size": None,
               "async_op": g.get("async") == "1", "bytes": None, "shape": None, "dtype": None,
               "duration_us": float(g["ms"]) * 1e3 if g.get("ms") else np.nan, "call_count": None,
               "timestamp": np.nan, "path": path}
        group = (group_spec(g["ranks"]) or g["ranks"]) if g.get("ranks") is not None else None  # as a rank spec
        if kind == "TRACE":
            row.update(op=canonical_op(g["op"]), group=group, group_size=int(g["size"]),
                       bytes=_exact_bytes(g["shape"], g["dtype"]) or round(float(g["mb"]) * _MB) or None,
                       shape=g["shape"].strip(), dtype=g["dtype"], call_count=int(g["count"]))
        elif kind == "COALESCE":
            row.update(op=f"coalesced {canonical_op(g['op'])}", group=group, group_size=int(g["size"]),
                       bytes=int(g["bytes"]), call_count=int(g["count"]))
        elif kind == "BATCH":
            row.update(op="batch_isend_irecv", bytes=int(g["send"]) + int(g["recv"]), call_count=int(g["ops"]),
                       shape=f"send [{g['send_shapes']}] recv [{g['recv_shapes']}]")
        rows.append(row)
    return rows


def _exact_bytes(shape: str, dtype: str) -> int | None:
    """A tensor's bytes from its shape and dtype (the log's size is MB rounded to 0.01), or None if unknown."""
    size = ITEMSIZE.get(dtype.removeprefix("torch."))
    dims = re.fullmatch(r"\s*\(\s*((?:\d+\s*,\s*)*\d*)\s*\)\s*", shape)
    if size is None or dims is None:
        return None
    for d in filter(None, (x.strip() for x in dims.group(1).split(","))):
        size *= int(d)
    return size


def _csv_rows(text: str, path: str, rank: int | None) -> list[dict[str, Any]]:
    rows = []
    for n, rec in enumerate(csv.DictReader(io.StringIO(text.lstrip("\ufeff"))), 2):
        try:
            duration = float(rec["duration"]) * 1e6
            timestamp = float(rec["timestamp"])
            size = int(float(rec["tensor_size"] or 0))
        except (TypeError, ValueError):
            raise TraceFormatError(f"{path}: CSV line {n} has a bad duration, timestamp or tensor_size: {rec}; "
                                   "is the file cut?") from None
        rows.append({"rank": rank, "kind": "csv", "op": canonical_op(rec["function"] or "?"), "group": None,
                     "group_size": None, "async_op": None, "bytes": size,
                     "shape": rec["tensor_shape"], "dtype": rec["tensor_dtype"], "duration_us": duration,
                     "call_count": None, "timestamp": timestamp, "path": path})
    return rows


