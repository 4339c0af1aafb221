"""The ``tracefuse`` command line's options: the parser, with a sub-parser per command and the option groups
they share. ``cli`` runs what it parses."""
from __future__ import annotations

import argparse
import re
from typing import Any

from ._version import __version__
from .errors import TraceFuseError
from .model import DEFAULT_RANK_REGEX, parse_steps, parse_window, rank_subset

__all__ = ["build_parser"]


def _checked(parse: Any) -> Any:
    """An argparse type that checks an option's text with the API's own parser and passes the text on: a bad value
    is a usage error (exit 2, with the command's usage), as argparse's own are."""
    def check(text: str) -> str:
        try:
            parse(text)
        except (ValueError, TraceFuseError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    return check


def _regex(text: str) -> str:
    """An argparse type for ``--rank-regex``: a regular expression (a bad one is a usage error, exit 2)."""
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression ({e}); give one with a named group "
                                         "'rank', such as 'rank(?P<rank>\\d+)'") from None
    return text


def _keep(text: str) -> None:
    from .merge.plan import build_options

    build_options(keep=text)


def _positive(kind: type) -> Any:
    """An argparse type for a number above 0 (HTA's cutoffs)."""
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0; give a positive number")
        return value
    return check


def _add_cluster_args(p: argparse.ArgumentParser, small: str = "") -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--workers", type=int, metavar="N",
                   help=f"worker processes of the embedded cluster (default: one per core{small})")
    g.add_argument("--scheduler", metavar="ADDRESS",
                   help="connect to an existing Dask scheduler (also DASK_SCHEDULER_ADDRESS)")
    g.add_argument("--scheduler-file", metavar="PATH", help="connect through a Dask scheduler file")
    g.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the scheduler (default: 10)")
    g.add_argument("--tls-ca-file", metavar="PATH",
                   help="with a tls:// scheduler: the CA certificate to trust it by (also Dask's config: "
                        "distributed.comm.tls.ca-file)")
    g.add_argument("--tls-cert", metavar="PATH",
                   help="with a tls:// scheduler: this client's certificate (distributed.comm.tls.client.cert)")
    g.add_argument("--tls-key", metavar="PATH",
                   help="with a tls:// scheduler: this client's private key, if not in --tls-cert "
                        "(distributed.comm.tls.client.key)")


def _add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as a JSON object")
    p.add_argument("--storage-timeout", type=_positive(float), metavar="S",
                   help="fail when the storage stops answering (no connection, or no byte) for this long, retries "
                        "included (default: 60; a slow transfer that keeps arriving is never cut off)")


def _add_input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="trace files, folders or globs; local paths or fsspec URLs (s3://, gs://, ...)")
    p.add_argument("--rank-regex", default=DEFAULT_RANK_REGEX, metavar="REGEX", type=_regex,
                   help="regex with a named group 'rank', applied to file names when a file has no "
                        f"distributedInfo.rank (default: {DEFAULT_RANK_REGEX})")
    _add_storage_args(p)
    p.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")


def _add_bad_input_args(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("bad input")
    b.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="stop at the first bad rank (default), or go on without bad ranks and list them")
    b.add_argument("--repair", action="store_true",
                   help="recover the complete events of truncated files, and report what was recovered")


def _add_filter_args(p: argparse.ArgumentParser, verb: str) -> None:
    """The merge's selection and filters, which ``index`` applies too."""
    f = p.add_argument_group("selection and filters")
    f.add_argument("--ranks", metavar="SPEC", type=_checked(rank_subset),
                   help=f"{verb} a subset of ranks: A-B, :S stride, commas, e.g. 0-63:8,100")
    f.add_argument("--include-pyfunc", action="store_true", help="keep python_function events (dropped by default)")
    f.add_argument("--keep", metavar="PRESETS", type=_checked(_keep),
                   help="keep only a union of presets: gpu,comm,cpu (M events always stay)")
    f.add_argument("--steps", metavar="A-B", type=_checked(parse_steps),
                   help="keep ProfilerStep#A to #B inclusive; GPU events follow their launch")
    f.add_argument("--window", metavar="START_MS:END_MS", type=_checked(parse_window),
                   help="keep events starting in this window, in ms from the earliest kept event of all ranks")


def _add_align_args(g: Any) -> None:
    """How ranks are aligned and their ids made unique, for ``merge`` and ``index``."""
    g.add_argument("--align", choices=("auto", "base", "clock-sync", "collectives"), default="auto",
                   help="base: align ranks by baseTimeNanoseconds. clock-sync: also shift each rank by Composer's "
                        "clock_sync_timestamp_us, as its merger does. auto (default): clock-sync when every rank "
                        "has that stamp, else base. collectives: also correct each rank's clock offset estimated "
                        "from matched NCCL/RCCL collectives")
    g.add_argument("--rewrite-ids", action="store_true",
                   help="also make External id and correlation unique across ranks (originals kept as <field>_raw)")


def _add_reporting_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--summary-json``, ``--quiet`` and ``--verbose``, for ``merge`` and ``index``."""
    r = p.add_argument_group("reporting")
    r.add_argument("--summary-json", action="store_true", help="print one JSON summary line on stdout")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary on stderr")
    r.add_argument("-v", "--verbose", action="store_true", help="log what happens on stderr")
    return r


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tracefuse",
        description="Merge per-rank PyTorch profiler (Kineto) traces into one Perfetto trace, on Dask.",
    )
    parser.add_argument("--version", action="version", version=f"tracefuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _merge_command(sub)
    _analyze_command(sub)
    _diff_command(sub)
    _info_command(sub)
    _index_command(sub)
    _sql_command(sub)
    _example_command(sub)
    return parser


def _merge_command(sub: Any) -> None:
    """``tracefuse merge``'s options."""
    m = sub.add_parser("merge", help="merge per-rank traces into one trace",
                       description="Merge per-rank traces into one trace that Perfetto opens with every "
                                   "rank on one aligned timeline.")
    _add_input_args(m)
    m.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="merged trace; gzip (one member per rank) when it ends in .gz")
    _add_filter_args(m, "merge")
    o = m.add_argument_group("output")
    o.add_argument("--format", choices=("json", "perfetto-archive"), default="json",
                   help="json: one merged trace (default). perfetto-archive: a TAR (OUT.tar, or OUT.tar.gz gzipped) "
                        "of one trace per rank plus the perfetto_manifest.json with which Perfetto v58+ merges "
                        "them natively, each rank a machine; not with --split")
    o.add_argument("--split", type=int, metavar="N",
                   help="write N files, each a complete merged trace of a contiguous range of ranks "
                        "(OUT.ranks-A-B.json.gz), for viewers that cannot open the whole merge")
    _add_align_args(o)
    o.add_argument("--keep-empty-processes", action="store_true", help="keep processes that have no events")
    o.add_argument("--annotate-rank", action="store_true",
                   help="also write \"rank\" into every event's args, as TraceLens's TraceFuse does (process names "
                        "and pids say the rank already; this costs 32-48%% of a rank's rewrite)")
    o.add_argument("--counters", action="store_true",
                   help="add counter tracks of each stream's queue length and each copy kind's memory bandwidth "
                        "(HTA's generate_trace_with_counters)")
    o.add_argument("--keep-overlaps", action="store_true",
                   help="leave each slice on its own thread even where it cannot nest there (by default such a "
                        "slice, which Perfetto would cut or drop, goes to a lane of its own: a thread named "
                        "'stream 7 · overlap', sorted after its thread)")
    o.add_argument("--gzip-members", choices=("rank", "single"), default="rank",
                   help="one gzip member per rank (default; Perfetto >= v48) or a single member for old viewers")
    o.add_argument("-f", "--force", action="store_true", help="replace an existing output")
    o.add_argument("--skip-if-unchanged", action="store_true",
                   help="do nothing when OUT.manifest.json shows the same inputs, options and version; "
                        "otherwise rebuild (implies --force) and write the manifest")
    _add_bad_input_args(m)
    r = _add_reporting_args(m)
    r.add_argument("--performance-report", metavar="FILE", help="write Dask's HTML performance report (needs bokeh)")
    _add_cluster_args(m, "; without it, inputs of up to 64 MiB of trace run in this process")


def _analyze_command(sub: Any) -> None:
    """``tracefuse analyze``'s options."""
    a = sub.add_parser("analyze", help="per-rank breakdowns, kernel and op summaries, outlier ranks, HTML report",
                       description="Analyse per-rank traces, or the event store tracefuse index wrote (its one "
                                   "INPUT), into cross-rank tables, summary.json and a self-contained report.html.")
    _add_input_args(a)
    a.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="report folder: one file per table, summary.json, report.html")
    a.add_argument("--ranks", metavar="SPEC", type=_checked(rank_subset),
                   help="analyse a subset of ranks: A-B, :S stride, commas")
    a.add_argument("--steps", metavar="A-B", type=_checked(parse_steps),
                   help="only ProfilerStep#A to #B inclusive; GPU work follows its launch")
    a.add_argument("--format", choices=("parquet", "csv"), default="parquet", help="table files (default: parquet)")
    a.add_argument("--critical-path-trace", metavar="OUT",
                   help="also write the merged trace (as tracefuse merge) with the critical path marked for "
                        "Perfetto: arrows along the path's events and a 'critical path' track")
    a.add_argument("--store", metavar="STORE",
                   help="also write the job's event store (as tracefuse index --align base writes it) from the "
                        "traces the analysis reads, in the same tasks")
    a.add_argument("--counters", action="store_true",
                   help="with --critical-path-trace: add counter tracks of each stream's queue length and each copy "
                        "kind's memory bandwidth (HTA's generate_trace_with_counters) to that trace")
    a.add_argument("--keep-unlaunched-gpu", action="store_true",
                   help="keep device work whose launch is not in the trace (queued before the profiler started), "
                        "which HTA, and by default this analysis, leave out when a rank has 2+ ProfilerStep#N")
    a.add_argument("--gpu-spec", metavar="FILE.json",
                   help="devices to add to or override the device table of op_perf's roofline, a JSON file shaped "
                        "as tracefuse_dask/perf/devices.json")
    h = a.add_argument_group("launches and queues (HTA's thresholds by default)")
    h.add_argument("--runtime-cutoff", type=_positive(float), default=50.0, metavar="US",
                   help="a launch call longer than this is a runtime outlier (default: 50 µs)")
    h.add_argument("--launch-delay-cutoff", type=_positive(float), default=100.0, metavar="US",
                   help="a kernel that starts this long after its launch call ends is a launch-delay outlier "
                        "(default: 100 µs)")
    h.add_argument("--max-queue-length", type=_positive(int), default=1024, metavar="N",
                   help="a stream with this many operations outstanding is full (default: CUDA's 1024)")
    h.add_argument("--kernel-sequences", metavar="OP",
                   help="find the frequent kernel sequences of the ops whose names contain OP (e.g. aten::linear) "
                        "on every rank, as HTA's get_frequent_cuda_kernel_sequences does on one")
    _add_bad_input_args(a)
    a.add_argument("-f", "--force", action="store_true", help="replace an existing report folder")
    a.add_argument("--skip-if-unchanged", action="store_true",
                   help="do nothing when the report folder's commit.json shows the same inputs, options and "
                        "version; otherwise analyse again (implies --force)")
    a.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary on stderr")
    a.add_argument("-v", "--verbose", action="store_true", help="log what happens on stderr")
    _add_cluster_args(a, "; without it, inputs of up to 64 MiB of trace, each file counted 1 MiB more, run in "
                         "this process, unless --critical-path-trace is given")


def _diff_command(sub: Any) -> None:
    """``tracefuse diff``'s options."""
    d = sub.add_parser("diff", help="compare two runs: step time, breakdown, kernels, ops, collectives, straggler",
                       description="Compare two runs, each given as traces or an event store (analysed here) or as "
                                   "a folder that tracefuse analyze wrote; writes diff.json, diff.html and the tables. Exit "
                                   "codes: 0 no regression above --fail-above (or none asked), 3 a regression "
                                   "above it, 1 an error, 2 a usage error.")
    d.add_argument("base", metavar="BASE", help="the run to compare against: traces, a store or a report folder")
    d.add_argument("new", metavar="NEW", help="the run to check: traces, a store or an analyze report folder")
    d.add_argument("-o", "--output", required=True, metavar="DIR", help="folder for diff.json, diff.html, tables")
    d.add_argument("--fail-above", metavar="PCT",
                   help="exit 3 when the step time, or a figure worth 1%% or more of it, regressed significantly "
                        "by more than PCT (such as 5%%)")
    d.add_argument("--ranks", metavar="SPEC", type=_checked(rank_subset),
                   help="analyse a subset of ranks: A-B, :S stride, commas")
    d.add_argument("--steps", metavar="A-B", type=_checked(parse_steps), help="only ProfilerStep#A to #B inclusive")
    d.add_argument("--rank-regex", default=DEFAULT_RANK_REGEX, metavar="REGEX", type=_regex,
                   help="regex with a named group 'rank' for file names, as in analyze")
    d.add_argument("--format", choices=("parquet", "csv"), default="parquet", help="table files (default: parquet)")
    _add_storage_args(d)
    _add_bad_input_args(d)
    d.add_argument("-f", "--force", action="store_true", help="replace an existing output folder")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no verdict on stderr")
    d.add_argument("-v", "--verbose", action="store_true", help="log what happens on stderr")
    d.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    _add_cluster_args(d)


def _info_command(sub: Any) -> None:
    """``tracefuse info``'s options."""
    i = sub.add_parser("info", help="describe traces without merging them",
                       description="Describe per-rank traces (or, from its manifest, those of the store tracefuse "
                                   "index wrote): ranks, sizes, events per category, span, pids, flows.")
    _add_input_args(i)
    i.add_argument("--json", action="store_true", help="print JSON for machines instead of a table")
    _add_bad_input_args(i)
    _add_cluster_args(i, "; without it, inputs of up to 64 MiB of trace run in this process")


def _index_command(sub: Any) -> None:
    """``tracefuse index``'s options."""
    x = sub.add_parser("index", help="write the job's events to an event store that tracefuse sql queries",
                       description="Write every rank's kept events, as the merge writes them, to an event store "
                                   "(docs/store.md): Parquet parts, one per rank, and a manifest.")
    _add_input_args(x)
    x.add_argument("-o", "--output", required=True, metavar="STORE", help="the store's folder; local or fsspec URL")
    _add_filter_args(x, "index")
    o = x.add_argument_group("output")
    _add_align_args(o)
    o.add_argument("-f", "--force", action="store_true", help="replace an existing store")
    o.add_argument("--skip-if-unchanged", action="store_true", help="index only the ranks whose inputs changed since "
                   "the store's manifest (nothing, when no input, option or version did)")
    _add_bad_input_args(x)
    _add_reporting_args(x)
    _add_cluster_args(x, "; without it, inputs of up to 64 MiB of trace run in this process")


def _sql_command(sub: Any) -> None:
    """``tracefuse sql``'s options."""
    q = sub.add_parser("sql", help="answer a SQL query over an event store",
                       description="Run a SQL query (DuckDB's dialect, in this process) over a store that tracefuse "
                                   "index wrote. Tables: events, flows, kernels, steps, ranks (docs/store.md).")
    q.add_argument("store", metavar="STORE", help="the store's folder; local or fsspec URL")
    q.add_argument("sql", metavar="QUERY", help='the query, such as "SELECT rank, count(*) FROM kernels GROUP BY rank"')
    q.add_argument("--format", choices=("table", "csv", "json", "parquet"), default="table",
                   help="table: aligned text (default). csv. json: an array of objects. parquet: needs -o")
    q.add_argument("-o", "--output", metavar="FILE", help="write the result here instead of stdout")
    _add_storage_args(q)
    q.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")


def _example_command(sub: Any) -> None:
    """``tracefuse example``'s options."""
    e = sub.add_parser("example", help="write a small realistic multi-rank example to merge",
                       description="Write synthetic but Kineto-shaped per-rank traces (NCCL collectives, "
                                   "kernels, flows) to OUT_DIR.")
    e.add_argument("out_dir", metavar="OUT_DIR", help="folder to write rank*.pt.trace.json.gz into")
    e.add_argument("--ranks", type=int, default=8, help="number of ranks (default: 8)")
    e.add_argument("--rank-mb", type=float, default=1.0, help="uncompressed MB per rank (default: 1)")
    e.add_argument("--straggler", type=int, default=None, metavar="RANK", help="make this rank arrive late")
