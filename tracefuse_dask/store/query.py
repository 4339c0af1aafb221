"""Reading a store: its manifest checked (``open_store``), and SQL over its tables run by DuckDB in this process
(``query``), through the same fsspec filesystem as every other read; DuckDB never loads an extension, so nothing is
downloaded at run time."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import orjson
import pyarrow as pa

from ..errors import StoreError
from ..model import InputFile
from ..storage.files import options_for, storage_errors
from . import MANIFEST
from .schema import PART_TABLES, SCHEMA_VERSION, VIEWS

__all__ = ["TABLES", "Store", "connect", "offline_duckdb", "open_store", "query", "result", "to_pandas"]

TABLES = (*PART_TABLES, *VIEWS, "ranks")


@dataclass(frozen=True)
class Store:
    """A store as its manifest lists it."""

    url: str
    fs: Any
    root: str
    manifest: dict[str, Any]

    def files(self, table: str) -> list[str]:
        """The URLs of the parts of ``table`` (``events`` or ``flows``), in rank order."""
        return [self.fs.unstrip_protocol(f"{self.root}/{r['part']}/{table}.parquet") for r in self.manifest["ranks"]]

    def inputs(self) -> list[InputFile]:
        """The store's ranks as the files they were indexed from (their size and stamp as the index read them),
        each with its part: an analysis's inputs."""
        made = self.manifest.get("made_from")
        listed = made.get("inputs") if isinstance(made, dict) else None
        identity = {i.get("path"): i for i in (listed if isinstance(listed, list) else []) if isinstance(i, dict)}
        return [InputFile(r["file"], identity.get(r["file"], {}).get("size"), r["rank"], "key",
                          stamp=identity.get(r["file"], {}).get("stamp"),
                          part=self.fs.unstrip_protocol(f"{self.root}/{r['part']}")) for r in self.manifest["ranks"]]


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store at ``url``, its manifest read and checked.

    Raises
    ------
    StoreError
        When ``url`` holds no store, or one of another schema version (the message says how to rebuild it).
    """
    url = url.rstrip("/")
    with storage_errors(url, storage_options):
        fs, root = fsspec.core.url_to_fs(url, **options_for(url, storage_options))
        try:
            manifest = orjson.loads(fs.cat_file(f"{root}/{MANIFEST}"))
        except (FileNotFoundError, NotADirectoryError):
            raise StoreError(f"{url}: not a tracefuse store (no {MANIFEST}); make one with "
                             f"`tracefuse index INPUT... -o {url}`") from None
        except orjson.JSONDecodeError as e:
            raise StoreError(f"{url}/{MANIFEST} is not JSON ({e}); rebuild the store with "
                             f"`tracefuse index INPUT... -o {url} --force`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "tracefuse-store":
        raise StoreError(f"{url}/{MANIFEST} is not a tracefuse store's manifest; rebuild the store with "
                         f"`tracefuse index INPUT... -o {url} --force`")
    rows = manifest.get("ranks")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and type(r.get("rank")) is int
                                             and isinstance(r.get("part"), str) and isinstance(r.get("file"), str)
                                             for r in rows):
        raise StoreError(f"{url}/{MANIFEST} does not list its ranks' parts as a store's manifest does; rebuild the "
                         f"store with `tracefuse index INPUT... -o {url} --force`")
    if not rows:
        raise StoreError(f"{url}: the store holds no rank; index some with `tracefuse index INPUT... -o {url} "
                         "--force`")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        made = manifest.get("version", "an unknown version")
        raise StoreError(f"{url}: the store has schema version {version} (written by tracefuse {made}); this "
                         f"tracefuse reads version {SCHEMA_VERSION}. Rebuild it from its traces with "
                         f"`tracefuse index INPUT... -o {url} --force`")
    return Store(url, fs, root, manifest)


def _ranks(store: Store) -> pa.Table:
    """The ``ranks`` table: each rank's file, host, device, base time and clock offset, from the manifest."""
    rows = store.manifest["ranks"]
    return pa.table({
        "rank": pa.array([r["rank"] for r in rows], pa.int32()),
        "file": pa.array([r["file"] for r in rows], pa.string()),
        "host": pa.array([r.get("host") for r in rows], pa.string()),
        "device": pa.array([r.get("device") for r in rows], pa.string()),
        "base_ns": pa.array([r["base_ns"] for r in rows], pa.int64()),
        "offset_ns": pa.array([r.get("offset_ns", 0) for r in rows], pa.int64()),
        "events_in": pa.array([r["events_in"] for r in rows], pa.int64()),
    })


def offline_duckdb(**config: Any) -> Any:
    """An in-memory DuckDB connection that never loads or installs an extension (nothing is downloaded)."""
    import duckdb

    return duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False,
                                  **config})


def connect(store: Store) -> Any:
    """A DuckDB connection (in memory, in this process) whose tables are the store's: ``events`` and ``flows``
    over the parts, the views ``kernels`` and ``steps``, and ``ranks``."""
    con = offline_duckdb()
    if not isinstance(store.fs, fsspec.implementations.local.LocalFileSystem):
        con.register_filesystem(store.fs)
    for table in PART_TABLES:
        files = ", ".join("'" + f.replace("'", "''") + "'" for f in store.files(table))
        con.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet([{files}])")
    for name, sql in VIEWS.items():
        con.execute(f"CREATE VIEW {name} AS {sql}")
    con.register("ranks", _ranks(store))
    return con


def result(store: str | Store, sql: str, storage_options: Mapping[str, Any] | None = None) -> pa.Table:
    """The result of the SQL query ``sql`` over the store's tables (``TABLES``), as an Arrow table (empty for a
    statement that returns no rows).

    Raises
    ------
    StoreError
        When the store cannot be read, or the query fails (DuckDB's message, on one line, and the tables).
    """
    import duckdb

    store = store if isinstance(store, Store) else open_store(store, storage_options)
    try:
        con = connect(store)
        try:
            rel = con.sql(sql)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        finally:
            con.close()
    except duckdb.Error as e:
        if any(store.fs._strip_protocol(f) in str(e) for table in PART_TABLES for f in store.files(table)):
            raise StoreError(f"{store.url}: a part of the store could not be read ({_line(e)}); if another run "
                             "replaced it meanwhile, run the query again, else rebuild the store with `tracefuse "
                             f"index INPUT... -o {store.url} --force`") from None
        raise StoreError(f"the query failed: {_line(e)} (tables: {', '.join(TABLES)})") from None


def to_pandas(table: pa.Table) -> Any:
    """``table`` as a DataFrame whose integer columns stay exact integers where they hold nulls (nullable dtypes,
    not floats, which would round a time in ns)."""
    import pandas as pd

    ints = {pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(),
            pa.int64(): pd.Int64Dtype(), pa.uint8(): pd.UInt8Dtype(), pa.uint16(): pd.UInt16Dtype(),
            pa.uint32(): pd.UInt32Dtype(), pa.uint64(): pd.UInt64Dtype()}
    return table.to_pandas(types_mapper=ints.get)


def query(store: str | Store, sql: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The result of the SQL query ``sql`` over the store's tables, as a pandas DataFrame; see ``result``."""
    return to_pandas(result(store, sql, storage_options))


def _line(e: BaseException) -> str:
    """DuckDB's message on one line."""
    return " ".join(str(e).split("\n")[0].split())
