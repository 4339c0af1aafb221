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
    TraceFileNotFoundError,
    TraceFormatError,
    TraceFuseError,
)
from .merge import merge_traces
from .model import MergeSummary
from .tracefuse import TraceFuse

__all__ = [
    "Analysis",
    "MergeError",
    "MergeSummary",
    "OutputExistsError",
    "OutputWriteError",
    "RankError",
    "SchedulerConnectionError",
    "StorageAccessError",
    "StorageConnectionError",
    "TraceFileNotFoundError",
    "TraceFormatError",
    "TraceFuse",
    "TraceFuseError",
    "__version__",
    "analyze",
    "merge_traces",
]


def __getattr__(name: str) -> object:
    """``analyze`` and ``Analysis`` load pandas; import them only when asked, so merges stay lean."""
    if name in ("analyze", "Analysis"):
        from . import analysis

        return getattr(analysis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
