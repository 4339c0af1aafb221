"""``TraceFuse``: the TraceLens-compatible face of ``merge_traces``."""
from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import orjson

from .storage.files import read_bytes
from .merge import merge_traces

__all__ = ["TraceFuse"]


class TraceFuse:
    """Merge per-rank traces the way TraceLens's ``TraceFuse`` is called, on Dask.

    Parameters
    ----------
    trace_files
        A list of paths (a file without a rank in ``distributedInfo`` or its
        name takes its list position) or a ``{rank: path}`` dict.
    use_multiprocessing
        Accepted for compatibility; the work always runs on Dask.
    max_workers
        Size of the embedded LocalCluster.
    **merge_options
        Passed to :func:`merge_traces`: ``client``, ``storage_options``,
        ``rewrite_ids`` (TraceLens-style offsets of ``External id``/``correlation``), ...

    Examples
    --------
    >>> TraceFuse({0: "r0.json", 8: "r8.json"}).merge_and_save("merged.json.gz")  # doctest: +SKIP
    """

    def __init__(self, trace_files: Sequence[str] | Mapping[int, str], use_multiprocessing: bool = False,
                 max_workers: int | None = None, **merge_options: Any) -> None:
        self.trace_files = dict(trace_files) if isinstance(trace_files, Mapping) else list(trace_files)
        self.use_multiprocessing = use_multiprocessing
        self.max_workers = max_workers
        self.merge_options = merge_options

    def merge_and_save(self, output_file: str, filter_fn: Callable[[dict[str, Any]], bool] | None = None,
                       include_pyfunc: bool = False) -> str:
        """Write the merged trace to exactly ``output_file`` (gzip if it ends in ``.gz``); return its path."""
        options = {"force": True, "workers": self.max_workers, **self.merge_options}
        merge_traces(self.trace_files, output_file, filter_fn=filter_fn, include_pyfunc=include_pyfunc, **options)
        return output_file

    def merge(self, filter_fn: Callable[[dict[str, Any]], bool] | None = None,
              include_pyfunc: bool = False) -> list[dict[str, Any]]:
        """Return the merged event list. It is held in memory: use this for small inputs only."""
        with tempfile.TemporaryDirectory(prefix="tracefuse-") as tmp:
            out = self.merge_and_save(f"{tmp}/merged.json", filter_fn, include_pyfunc)
            return orjson.loads(read_bytes(out)[0])["traceEvents"]
