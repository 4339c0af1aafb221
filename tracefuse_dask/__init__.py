"""Merge and analyse per-rank PyTorch profiler traces on a Dask cluster."""
from __future__ import annotations

from ._version import __version__
from .analyze import Analysis, analyze
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
