"""``tracefuse sql``'s result written out: an aligned table, CSV, JSON or Parquet, on stdout or to a file (local or
any fsspec URL) written whole or not at all."""
from __future__ import annotations

import decimal
import io
import sys
from collections.abc import Mapping
from typing import Any

import fsspec
import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ..storage.files import options_for, storage_errors
from ..storage.output import put_whole
from .query import to_pandas

__all__ = ["MAX_SHOWN", "write_result"]

MAX_SHOWN = 1000  # rows of an aligned table on a terminal; the rest is counted, and -o writes them all


def _text(table: pa.Table) -> bytes:
    """The rows as an aligned table (at most ``MAX_SHOWN``), and how many were left out."""
    shown = to_pandas(table.slice(0, MAX_SHOWN))
    shown = shown.astype(object).where(shown.notna(), "NULL")  # as SQL says it, not pandas's NaN
    text = shown.to_string(index=False) if table.num_columns else ""
    more = table.num_rows - len(shown)
    note = f"\n({more:,} more rows; write them all with -o FILE --format csv)" if more > 0 else ""
    rows = f"({table.num_rows:,} row{'' if table.num_rows == 1 else 's'})"
    return f"{text}{note}\n{rows}\n".encode() if table.num_rows else f"{rows}\n".encode()


def _json(value: Any) -> Any:
    """What orjson does not write itself: DuckDB's big sums (decimals) as numbers where they stay exact (a whole
    number within 64 bits), else as their exact text; anything else as text."""
    if isinstance(value, decimal.Decimal) and value == value.to_integral_value() and abs(value) < 2**63:
        return int(value)
    return str(value)


def _encoded(table: pa.Table, fmt: str) -> bytes:
    if fmt == "table":
        return _text(table)
    buf = io.BytesIO()
    if fmt == "csv":
        pacsv.write_csv(table, buf)
    elif fmt == "json":
        buf.write(orjson.dumps(table.to_pylist(), default=_json, option=orjson.OPT_APPEND_NEWLINE))
    else:
        pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def write_result(table: pa.Table, fmt: str, out: str | None, storage_options: Mapping[str, Any] | None) -> None:
    """Write ``table`` as ``fmt`` (``table``, ``csv``, ``json`` or ``parquet``) to the file ``out``, or to stdout."""
    data = _encoded(table, fmt)
    if out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    with storage_errors(out, storage_options):
        fs, path = fsspec.core.url_to_fs(out, **options_for(out, storage_options))
    put_whole(fs, path, data, storage_options)
