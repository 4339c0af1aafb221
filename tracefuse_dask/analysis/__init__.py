"""``tracefuse analyze``: per-rank analysis as Dask map tasks, reduced to small cross-rank tables and a report.

One folder per phase (``docs/architecture.md``): ``per_rank`` (a map task's analysis of one rank), ``cross_rank``
(the reduce's functions across ranks), ``diff`` (two runs compared) and ``report`` (the HTML pages and what is
shown of the critical path), over the types and names of ``schema``. ``run`` drives them: ``tasks`` on the
cluster, ``transport`` between the cluster and the client, ``reduce`` on the client, ``folder`` for report folders.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see; at run time ``__getattr__`` imports them
    from .folder import check_new, is_report, read_report, write_diff, write_report
    from .reduce import rank_stats
    from .run import analyze
    from .schema import Analysis

__all__ = ["FILE_COST", "Analysis", "analyze", "check_new", "is_report", "rank_stats", "read_report", "write_diff",
           "write_report"]

FILE_COST = 2**20  # what analysing a file costs beyond its bytes, counted as bytes of trace (``cluster.batches``,
# ``programs.small_input``): a rank of a few kB takes 15-60 ms on 2 cores, as long as 1-2 MB of a big rank's trace

_LAZY = {"check_new": "folder", "is_report": "folder", "read_report": "folder", "write_diff": "folder",
         "write_report": "folder", "rank_stats": "reduce", "analyze": "run", "Analysis": "schema"}


def __getattr__(name: str) -> object:
    """The client's modules (the run, its reduce and report folders) are imported when first asked: a worker
    program that unpickles its first task imports ``tasks`` and what it needs, not them (0.15 s of its start)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
