"""The ``tracefuse`` command line: parses arguments, calls the public API, maps errors in one place."""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from .cli_options import build_parser as _parser
from .errors import TraceFuseError

if TYPE_CHECKING:  # the analysis imports pandas: the CLI imports it when a command needs it
    from .analysis.schema import Summary
    from .model import MergeSummary

__all__ = ["main"]


class _UsageError(Exception):
    pass


def _count(n: int, noun: str) -> str:
    """``1 rank``, ``2,048 ranks``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _storage_options(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise _UsageError(f"--storage-options is not valid JSON ({e.msg} at char {e.pos}); "
                          "pass an object such as '{\"anon\": true}'") from None
    if not isinstance(value, dict):
        raise _UsageError("--storage-options must be a JSON object such as '{\"anon\": true}'")
    return value



def _tls_config(args: argparse.Namespace) -> dict[str, Any]:
    """Dask's config for the ``--tls-*`` files: a remote cluster's client reads them there, as from a user's own
    ``distributed.comm.tls.*`` config."""
    files = {"ca-file": getattr(args, "tls_ca_file", None), "client.cert": getattr(args, "tls_cert", None),
             "client.key": getattr(args, "tls_key", None)}
    if not any(files.values()):
        return {}
    import dask

    if not (args.scheduler or args.scheduler_file or dask.config.get("scheduler-address", None)):
        raise _UsageError("--tls-ca-file, --tls-cert and --tls-key are for a remote cluster's tls:// scheduler; "
                          "give --scheduler or --scheduler-file too (the embedded cluster makes its own)")
    if files["client.key"] and not files["client.cert"]:
        raise _UsageError("--tls-key is the key of --tls-cert; give --tls-cert too")
    return {"distributed.comm.require-encryption": True,
            **{f"distributed.comm.tls.{k}": v for k, v in files.items() if v}}


def _config(values: dict[str, Any]) -> contextlib.AbstractContextManager:
    if not values:
        return contextlib.nullcontext()  # dask is not imported for --help, --version or example
    import dask

    return dask.config.set(values)


@contextlib.contextmanager
def _handle_errors(debug: bool) -> Iterator[None]:
    try:
        yield
    except TraceFuseError as e:
        if debug:
            raise
        print(f"error: {e.for_cli()}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("interrupted: temporary files were removed", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # the reader of the output went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush cannot fail
        raise SystemExit(1) from None
    except Exception as e:
        if debug:
            raise
        print(f"error: {type(e).__name__}: {e}\nTIP: rerun with --debug for the traceback", file=sys.stderr)
        raise SystemExit(1) from None


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run() -> NoReturn:
    """The ``tracefuse`` program, and ``python -m tracefuse_dask``: ``main``, then the process exits with its code."""
    code = main()
    # Whatever is left goes with the process: its objects are moved out of the cyclic collector's sight, whose passes
    # over them as the interpreter exits took 0.2-0.3 s once pandas and distributed are imported (0.05 s frozen).
    gc.freeze()
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tracefuse`` command; return its exit code (0 ok, 1 error, 2 usage, 3 ``diff`` found a regression
    above ``--fail-above``, 130 interrupted)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "analyze" and args.counters and not args.critical_path_trace:
            raise _UsageError("--counters adds counter tracks to the --critical-path-trace trace; give "
                              "--critical-path-trace OUT too, or use tracefuse merge --counters")
        if args.command == "sql" and args.format == "parquet" and not args.output:
            raise _UsageError("--format parquet writes a file; give -o FILE")
        if args.command == "analyze" and args.skip_if_unchanged and args.critical_path_trace:
            raise _UsageError("--skip-if-unchanged compares with the report folder's commit.json, which does not "
                              "cover the --critical-path-trace trace; run the two apart, or without "
                              "--skip-if-unchanged")
        so = _storage_options(getattr(args, "storage_options", None))
        if getattr(args, "storage_timeout", None):  # the storage layer's own option (storage.files.options_for)
            so = {**(so or {}), "storage_timeout": args.storage_timeout}
        tls = _tls_config(args)
    except _UsageError as e:
        command = parser._subparsers._group_actions[0].choices.get(args.command, parser)
        command.print_usage(sys.stderr)
        print(f"{command.prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help, --version and argparse's usage errors
        return int(e.code or 0)
    debug = getattr(args, "debug", False)
    if args.command in _TASKS:
        _start_workers_ahead(args)
    if args.command != "example":
        # Imported before logging is configured, distributed gives its loggers a handler of their own, which the
        # embedded cluster silences; imported after, they would log every start and stop through ours.
        import distributed  # noqa: F401
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # fsspec's event loop logs a storage request its client library abandoned when the storage went away ("Task
    # exception was never retrieved"), also as the interpreter exits, and gcsfs and fsspec's prefetcher log the
    # traceback of a request out of retries; the run's one error line says what happened (--verbose shows them)
    if not getattr(args, "verbose", False) and not debug:
        for name in ("asyncio", "gcsfs", "fsspec"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        with _handle_errors(debug), _config(tls):
            if args.command == "merge":
                return _merge(args, so)
            if args.command == "analyze":
                return _analyze(args, so)
            if args.command == "info":
                return _info(args, so)
            if args.command == "diff":
                return _diff(args, so)
            if args.command == "index":
                return _index(args, so)
            if args.command == "sql":
                return _sql(args, so)
            return _example(args)
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if "tracefuse_dask.programs" in sys.modules:  # programs started ahead that no cluster took: a failed command's
            sys.modules["tracefuse_dask.programs"].stop_ahead()
    return 0


# The modules of each command's first tasks, which its worker programs import as they start (``_start_workers_ahead``)
_TASKS = {"merge": ("tracefuse_dask.merge.plan", "tracefuse_dask.merge.tasks"),
          "analyze": ("tracefuse_dask.analysis.tasks",), "index": ("tracefuse_dask.store.index",)}


def _start_workers_ahead(args: argparse.Namespace) -> None:
    """Start the embedded cluster's worker programs now when the command will start them (``programs.start_ahead``):
    they import Dask and the tasks' modules on the other cores while this process imports the rest (0.5-1 s).

    That is when ``--workers`` is given, or when the inputs are local files that ``connect`` would not run in this
    process: listed here as the command lists them (``*.json``, ``*.json.gz``, ``*.gz``; fewer than ``analyze``
    lists, so never too many), and listed again by the command; a local event store given to ``analyze`` counts as
    the files it was indexed from, as ``analyze`` counts it, and its programs import the store's reader too. Inputs
    on object storage, ``memory://`` paths (run in threads of this process), a cluster to join and
    ``--skip-if-unchanged`` (which mostly starts none) start none here. It is only a head start: what goes wrong
    here (a bad input, no process to start), the command, which has not started, says.
    """
    from .analysis import FILE_COST
    from .programs import start_ahead, worker_programs

    paths = [*args.inputs, args.output]
    # analyze with --critical-path-trace or --store starts its cluster whatever the inputs (api.analyze)
    listed = args.workers is None and not (getattr(args, "critical_path_trace", None) or getattr(args, "store", None))
    if args.skip_if_unchanged or any(p.startswith("memory://") for p in paths) or (
            listed and any("://" in p or "::" in p for p in args.inputs)):
        return
    try:
        files, modules = None, _TASKS[args.command]
        store = args.command == "analyze" and _local_store(args.inputs)  # its parts are read, not its traces
        if store:
            modules = (*modules, "tracefuse_dask.store.source", "duckdb")
        if listed:
            from .model import rank_subset

            subset = rank_subset(args.ranks)
        if listed and store:
            from .store.query import open_store

            files = [f for f in open_store(args.inputs[0]).inputs() if subset is None or f.rank_hint in subset]
        elif listed:
            from .storage.inputs import expand_inputs

            files, _ = expand_inputs(args.inputs, rank_regex=args.rank_regex, subset=subset)
        start_ahead(worker_programs(workers=args.workers, scheduler=args.scheduler,
                                    scheduler_file=args.scheduler_file, inputs=files,
                                    per_file=FILE_COST if args.command == "analyze" else 0, ahead=True), modules)
    except (TraceFuseError, ValueError, OSError):  # the command, run next, reports it
        return


def _local_store(inputs: list[str]) -> bool:
    """Whether ``inputs`` is one local event store, as ``analyze`` tells it (``store.store_url``); a store on object
    storage is not asked for here, as traces there are not listed."""
    from .store import store_url

    return not any("://" in p or "::" in p for p in inputs) and store_url(inputs, None) is not None


def _run_args(args: argparse.Namespace, so: dict[str, Any] | None) -> dict[str, Any]:
    """What ``merge`` and ``index`` pass alike: the inputs' options, the filters, bad input and the cluster."""
    return {"storage_options": so, "ranks": args.ranks, "rank_regex": args.rank_regex,
            "include_pyfunc": args.include_pyfunc, "keep": args.keep, "steps": args.steps, "window": args.window,
            "rewrite_ids": args.rewrite_ids, "on_error": args.on_error, "repair": args.repair, "align": args.align,
            "force": args.force, "skip_if_unchanged": args.skip_if_unchanged, "workers": args.workers,
            "scheduler": args.scheduler, "scheduler_file": args.scheduler_file, "timeout": args.timeout,
            "show_progress": not args.quiet and sys.stderr.isatty()}


def _merge(args: argparse.Namespace, so: dict[str, Any] | None) -> int:
    from .api import merge_traces

    summary = merge_traces(args.inputs, args.output, keep_empty_processes=args.keep_empty_processes,
                           annotate_rank=args.annotate_rank, counters=args.counters,
                           keep_overlaps=args.keep_overlaps, gzip_members=args.gzip_members,
                           split=args.split, format=args.format, performance_report=args.performance_report,
                           **_run_args(args, so))
    return _tell_run(summary, args, "merged", "out")


def _tell_run(summary: MergeSummary, args: argparse.Namespace, verb: str, rows: str) -> int:
    """What a merge or an index did, on stderr (unless ``--quiet``), and ``--summary-json`` on stdout."""
    if summary.status == "unchanged":
        if not args.quiet:
            print(f"unchanged: {summary.warnings[0]}", file=sys.stderr)
    elif not args.quiet:
        print(f"{verb} {summary.ranks} ranks: {summary.events_in:,} events in, {summary.events_out:,} {rows}; "
              f"{summary.bytes_in / 1e6:,.1f} MB in, {summary.bytes_out / 1e6:,.1f} MB out, "
              f"{summary.seconds:.2f} s ({summary.mb_per_s:,.1f} MB/s)", file=sys.stderr)
        for path in summary.ignored:
            print(f"ignored {path}", file=sys.stderr)
        for sk in summary.skipped:
            print(f"skipped rank {sk['rank']}: {sk['reason']}", file=sys.stderr)
        if summary.account:
            print(_account_lines(summary.account, args.verbose), file=sys.stderr)
        for n in summary.notes:
            print(f"note: {n}", file=sys.stderr)
        for w in summary.warnings:
            print(f"warning: {w}", file=sys.stderr)
        for path in summary.outputs or [summary.output]:
            print(f"wrote {path}", file=sys.stderr)
    if args.summary_json:
        keys = ("ranks", "skipped", "events_in", "events_out", "bytes_out", "seconds", "mb_per_s", "output",
                "outputs", "status", "warnings", "notes", "on_lanes", "account")
        data = summary.to_json()
        print(json.dumps({k: data[k] for k in keys}))
    return 0


_SHORT = {"python_function": "python_function", "negative_dur": "with a negative duration", "keep": "--keep",
          "steps": "--steps", "window": "--window", "filter_fn": "filter_fn", "flow_end_left_out": "flows with an end left out",
          "process_metadata": "process metadata", "thread_metadata": "thread metadata"}


def _account_lines(account: dict[str, Any], verbose: bool) -> str:
    """Where every event read went: one line, or with ``verbose`` a table of the reasons; then a line for each
    anomaly."""
    from .model import LEFT_OUT, anomaly_line, repair_line

    left = account["left_out"]
    line = (f"account: {account['read']:,} events read = {account['kept']:,} kept"
            + "".join(f" + {n:,} {_SHORT[k]}" for k, n in left.items())
            + (f"; {account['on_lanes']:,} kept slice{'s' if account['on_lanes'] > 1 else ''} on lanes"
               if account["on_lanes"] else "")
            + (f"; {account['ranks_not_read']:,} of the job's ranks not read (--ranks)"
               if account.get("ranks_not_read") else "")
            + (f"; {repair_line(account['repaired'])}" if account.get("repaired") else ""))
    odd = [anomaly_line(k, a) for k, a in account["anomalies"].items()]
    if not verbose:
        return "\n".join([line, *odd])
    rows = [("read", account["read"]), ("kept", account["kept"]), *((LEFT_OUT[k], n) for k, n in left.items()),
            ("of the kept: slices moved to lanes", account["on_lanes"]),
            ("added by the merge: its process names and sort indices, lanes' names, counters, marks",
             account["added"]), ("written", account["written"])]
    width = max(len(f"{n:,}") for _, n in rows)
    return "\n".join([line, *(f"  {n:>{width},}  {what}" for what, n in rows), *odd])


def _index(args: argparse.Namespace, so: dict[str, Any] | None) -> int:
    from .api import index_traces

    return _tell_run(index_traces(args.inputs, args.output, **_run_args(args, so)), args, "indexed", "rows out")


def _sql(args: argparse.Namespace, so: dict[str, Any] | None) -> int:
    from .store.output import write_result
    from .store.query import result

    write_result(result(args.store, args.sql, so), args.format, args.output, so)
    return 0


def _analyze(args: argparse.Namespace, so: dict[str, Any] | None) -> int:
    from .analysis.schema import Cutoffs
    from .api import analyze

    result = analyze(args.inputs, args.output, storage_options=so, ranks=args.ranks, steps=args.steps,
                     rank_regex=args.rank_regex, format=args.format, force=args.force, workers=args.workers,
                     scheduler=args.scheduler, scheduler_file=args.scheduler_file, timeout=args.timeout,
                     show_progress=not args.quiet and sys.stderr.isatty(),
                     keep_unlaunched_gpu=args.keep_unlaunched_gpu, critical_path_trace=args.critical_path_trace,
                     counters=args.counters, store=args.store,
                     gpu_spec=args.gpu_spec, cutoffs=Cutoffs(args.runtime_cutoff, args.launch_delay_cutoff,
                                                             args.max_queue_length),
                     kernel_sequences=args.kernel_sequences, on_error=args.on_error, repair=args.repair,
                     skip_if_unchanged=args.skip_if_unchanged)
    if result.summary.get("status") == "unchanged":
        if not args.quiet:
            print(f"unchanged: {args.output} is up to date: inputs, options and version as in its commit.json; "
                  "nothing to do", file=sys.stderr)
        return 0
    if not args.quiet:
        _tell_analysis(result.summary, args)
    return 0


def _tell_analysis(s: Summary, args: argparse.Namespace) -> None:
    """What ``tracefuse analyze`` found, a line each on stderr, from its summary."""
    from .analysis.report.text import answers, notes

    print(f"analysed {_count(len(s['ranks']), 'rank')}, {_count(len(s['steps']), 'step')} in {s['seconds']:.2f} s",
          file=sys.stderr)
    if not s["gpu"]:
        print(f"note: {s['why_no_gpu']}", file=sys.stderr)
    for note in notes(s):
        print(f"note: {note}", file=sys.stderr)
    for line in s["outliers"]:
        print(f"outlier: {line}", file=sys.stderr)
    if s["collective_trace"]:
        ct = s["collective_trace"]
        print(f"collective_trace: {ct['calls']} calls in {ct['files']} files; {ct['straggler_hint']['evidence']}",
              file=sys.stderr)
    for answer in answers(s):
        if answer.what == "straggler":  # with the collectives it was found from
            if s["collectives"]["matched"]:
                print(f"collectives: {s['collectives']['matched']} matched, {s['collectives']['problems']} unmatched "
                      f"or inconsistent; {answer.text}", file=sys.stderr)
        else:
            print(f"{answer.label.lower()}: {answer.text}" if answer.label else answer.text, file=sys.stderr)
    if s["kernel_sequences"]:
        ks = s["kernel_sequences"]
        top = ks["top"][0] if ks["top"] else None
        print(f"kernel sequences of {ks['operator']}: {ks['distinct']:,} distinct"
              + (f"; the most frequent ran {top['count']:,} times on {top['ranks']} rank(s): {top['pattern']}"
                 if top else f"; {ks['note']}"), file=sys.stderr)
    for path in s["ignored"]:
        print(f"ignored {path}", file=sys.stderr)
    for sk in s["skipped"]:
        print(f"skipped rank {sk['rank']}: {sk['reason']}", file=sys.stderr)
    for w in (*s["repaired"], *s["warnings"]):
        print(f"warning: {w}", file=sys.stderr)
    print(f"wrote {args.output.rstrip('/')}/report.html", file=sys.stderr)
    if args.critical_path_trace:
        cpt = s["critical_path_trace"]
        print(f"wrote {cpt['output']}: the merged trace with the critical path marked ({cpt['slices']:,} slices "
              f"on the 'critical path' track, "
              + (f"{cpt['what_if_slices']:,} on its 'straggler what-if' thread, " if cpt["what_if_slices"] else "")
              + f"{cpt['arrows']:,} arrows)", file=sys.stderr)
    if args.store:
        st = s["store"]
        print(f"wrote {st['output']}: the event store of {_count(st['ranks'], 'rank')}, {st['rows']:,} rows, "
              f"{st['bytes'] / 1e6:,.1f} MB", file=sys.stderr)


def _diff(args: argparse.Namespace, so: dict[str, Any] | None) -> int:
    from .api import diff

    result = diff(args.base, args.new, args.output, fail_above=args.fail_above, storage_options=so, ranks=args.ranks,
                  steps=args.steps, rank_regex=args.rank_regex, format=args.format, force=args.force,
                  workers=args.workers, scheduler=args.scheduler, scheduler_file=args.scheduler_file,
                  timeout=args.timeout, show_progress=not args.quiet and sys.stderr.isatty(),
                  on_error=args.on_error, repair=args.repair)
    s = result.summary
    if not args.quiet:
        for line in (*s["notes"], *(f"warning: {w}" for w in s["warnings"])):
            print(line, file=sys.stderr)
        print(f"verdict: {s['verdict']}", file=sys.stderr)
        for r in s["failing"][:10]:
            on = "the job" if r["rank"] == -1 else f"rank {r['rank']}"
            change = "new" if r["delta_pct"] is None else f"{r['delta_pct']:+.1f}%"
            # the step time is what it is ("step time on rank 1", not "rank step time `step time` on rank 1")
            what = "step time" if r["what"] in ("step time", "rank step time") else f"{r['what']} `{r['label']}`"
            print(f"regression above {s['fail_above_pct']:g}%: {what} on {on}: {change}", file=sys.stderr)
        print(f"wrote {args.output.rstrip('/')}/diff.html", file=sys.stderr)
    return 3 if result.failed else 0


def _info(args: argparse.Namespace, so: dict[str, Any] | None) -> int:
    from .api import describe_traces
    from .info import format_table

    report = describe_traces(args.inputs, storage_options=so, rank_regex=args.rank_regex, workers=args.workers,
                             scheduler=args.scheduler, scheduler_file=args.scheduler_file, timeout=args.timeout,
                             on_error=args.on_error, repair=args.repair)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


def _example(args: argparse.Namespace) -> int:
    from .synth import write_example

    paths = write_example(args.out_dir, ranks=args.ranks, rank_bytes=int(args.rank_mb * 1e6),
                          straggler=args.straggler)
    print(f"wrote {len(paths)} rank traces to {args.out_dir}", file=sys.stderr)
    return 0
