"""Exception hierarchy of tracefuse_dask.

Every error names the file and rank it concerns and says how to fix it. Where a
builtin exception fits, ours subclasses it as well, so ``except FileNotFoundError``
keeps working.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "TraceFuseError",
    "TraceFormatError",
    "TraceFileNotFoundError",
    "RankError",
    "MergeError",
    "OutputExistsError",
    "OutputWriteError",
    "SchedulerConnectionError",
    "StorageAccessError",
    "StorageConnectionError",
    "StorageStallError",
    "StoreError",
    "SKIPPABLE",
    "skipped_rank",
    "every_rank_failed",
]


class TraceFuseError(Exception):
    """Base class for tracefuse_dask errors."""

    def for_cli(self) -> str:
        """The message as the command line says it (where the API's spelling of a fix differs from the option's)."""
        return str(self)


class TraceFormatError(TraceFuseError, ValueError):
    """A trace file is not a readable Kineto Chrome trace (bad JSON, bad field types)."""


class TraceFileNotFoundError(TraceFuseError, FileNotFoundError):
    """An input file, folder or glob matched nothing."""


class RankError(TraceFuseError, ValueError):
    """A rank is missing, duplicated or inconsistent across the input set."""


class MergeError(TraceFuseError):
    """The merge cannot be done as asked (id overflow, negative time, bad option)."""


class OutputExistsError(TraceFuseError, FileExistsError):
    """The output exists and ``force`` was not given. The message names the fix as the API spells it
    (``force=True``); ``for_cli`` as the command line does (``--force``)."""

    def __init__(self, template: str) -> None:
        self.template = template  # "{force}" where the fix goes, replaced, not formatted: paths may hold braces
        super().__init__(template.replace("{force}", "force=True"))

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a worker, it keeps its template on the way back
        return type(self), (self.template,)

    def for_cli(self) -> str:
        return self.template.replace("{force}", "--force")


class OutputWriteError(TraceFuseError, OSError):
    """The output or a temporary part could not be written (disk full, permission denied)."""


class SchedulerConnectionError(TraceFuseError, ConnectionError):
    """The Dask scheduler could not be reached in time."""


class StorageAccessError(TraceFuseError, PermissionError):
    """Storage refused access: wrong, missing or expired credentials, or a bucket policy."""


class StorageConnectionError(TraceFuseError, ConnectionError):
    """The storage endpoint could not be reached."""


class StorageStallError(StorageConnectionError):
    """The storage endpoint stopped answering: no connection or no byte within ``--storage-timeout``."""


class StoreError(TraceFuseError, ValueError):
    """An event store cannot be read (not a store, another schema version, a part gone), or a query over it
    failed."""


# What ``on_error="skip"`` skips a rank for: its own file is bad, missing or unreadable. Everything else (storage
# unreachable, no credentials, a bad option) concerns every rank and still stops the run.
SKIPPABLE = (TraceFormatError, TraceFileNotFoundError, MergeError, PermissionError)


def skipped_rank(error: BaseException, rank: int | None, path: str, on_error: str) -> dict[str, Any]:
    """What a task reports for a rank it could not read under ``on_error="skip"``; ``error`` raised otherwise."""
    if on_error != "skip" or not isinstance(error, SKIPPABLE):
        raise error
    return {"rank": rank, "path": path, "reason": str(error)}


def every_rank_failed(skipped: list[dict[str, Any]]) -> RankError:
    """The error when ``on_error="skip"`` left no rank: the first reason, and how many more."""
    more = f" (and {len(skipped) - 1:,} more)" if len(skipped) > 1 else ""
    return RankError(f"every rank failed; the first: {skipped[0]['reason']}{more}")
