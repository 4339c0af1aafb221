"""The event store: a job's events as Parquet parts, one per rank, that SQL answers over (``tracefuse index``,
``tracefuse sql``).

``schema.py`` holds the tables' columns and the views, with the schema's version (the manifest's name, and
``store_url``, which tells a store by it, are here: the command line asks before it imports Arrow);
``columns.py`` turns one rank's merged events into its tables; ``index.py`` runs the merge's plan and rank tasks to
write the parts and then the manifest; ``query.py`` reads a store and runs SQL over it with DuckDB; ``output.py``
writes a query's result.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec

from ..storage.files import options_for, storage_errors

__all__ = ["MANIFEST", "store_url"]

MANIFEST = "tracefuse-store.json"  # a folder that holds it is a store (``schema`` says what it lists)


def store_url(urlpath: Any, storage_options: Mapping[str, Any] | None) -> str | None:
    """The store that ``urlpath`` names (a folder that holds a store's manifest, alone or as a one-item list), or
    None: the inputs are traces."""
    one = urlpath[0] if isinstance(urlpath, (list, tuple)) and len(urlpath) == 1 else urlpath
    one = os.fspath(one) if isinstance(one, os.PathLike) else one
    if not isinstance(one, str) or any(c in one for c in "*?["):
        return None
    url = one.rstrip("/")
    with storage_errors(url, storage_options):
        fs, root = fsspec.core.url_to_fs(url, **options_for(url, storage_options))
        return url if fs.isfile(f"{root}/{MANIFEST}") else None
