"""``tracefuse analyze``: per-rank analysis as Dask map tasks, reduced to small cross-rank tables and a report.

One folder per phase (``docs/architecture.md``): ``per_rank`` (a map task's analysis of one rank), ``cross_rank``
(the reduce's functions across ranks), ``diff`` (two runs compared) and ``report`` (the HTML pages and what is
shown of the critical path), over the types and names of ``schema``. ``run`` drives them: ``tasks`` on the
cluster, ``transport`` between the cluster and the client, ``reduce`` on the client, ``folder`` for report folders.
"""
from .folder import check_new, is_report, read_report, write_diff, write_report
from .reduce import rank_stats
from .run import analyze
from .schema import Analysis

__all__ = ["Analysis", "analyze", "check_new", "is_report", "rank_stats", "read_report", "write_diff", "write_report"]
