"""Merge and analyse per-rank PyTorch profiler traces on a Dask cluster."""
from __future__ import annotations

from ._version import __version__
from .errors import (
    MergeError,
    OutputExistsError,
    OutputWriteError,
    RankError,
    SchedulerConnectionError,
    StorageAccessError,
    StorageConnectionError,
    StorageStallError,
    StoreError,
    TraceFileNotFoundError,
    TraceFormatError,
    TraceFuseError,
)

__all__ = [
    "Analysis",
    "Cutoffs",
    "Diff",
    "MergeError",
    "MergeSummary",
    "OutputExistsError",
    "OutputWriteError",
    "RankError",
    "SchedulerConnectionError",
    "StorageAccessError",
    "StorageConnectionError",
    "StorageStallError",
    "StoreError",
    "TraceFileNotFoundError",
    "TraceFormatError",
    "TraceFuse",
    "TraceFuseError",
    "__version__",
    "analyze",
    "diff",
    "index_traces",
    "merge_traces",
    "open_store",
    "query",
]


_LAZY = {"merge_traces": "api", "TraceFuse": "api", "analyze": "api", "diff": "api", "index_traces": "api",
         "query": "api", "open_store": "store.query", "Analysis": "api", "Diff": "api", "MergeSummary": "model",
         "Cutoffs": "analysis.schema"}


def __getattr__(name: str) -> object:
    """The API loads Dask and pandas: import it when first asked, so that ``tracefuse --version`` and ``--help``
    are quick."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
