"""``connect()``: the one place that starts or joins a Dask cluster.

The embedded cluster's workers are programs of their own (``programs._PROGRAM``: what ``dask spec`` runs,
as ``distributed.deploy.subprocess`` starts it), not ``multiprocessing`` children of the
caller. Dask's ``LocalCluster`` starts its workers through nannies with the ``spawn``
method, which re-imports the caller's ``__main__`` in every worker: a script without an
``if __name__ == "__main__":`` guard starts its merge again inside each worker and dies
("bootstrapping phase"), and code read from ``python -`` cannot be re-imported at all
("'<stdin>'"). ``fork`` and ``forkserver`` do not help: forkserver children re-import
``__main__`` too, and fork copies a process whose Dask event loop runs in a thread.
A worker started as its own program has its own main module (``python -c``), so it never
sees the caller's, from a script, stdin, ``-c``, IPython, a notebook or a
``multiprocessing`` child alike.

They are plain ``distributed.Worker`` programs, without a nanny: a nanny would be one
more interpreter to start per worker, before its worker's (~0.8 s more on 2 cores). What
a nanny would add, a restart after a worker dies, the embedded cluster does without: the
scheduler gives a lost worker's tasks to the others (``distributed.scheduler.allowed-failures``).
They keep freed heap for their next task in one malloc arena (``programs._WORKER_MALLOC``) and run no statistical
profiler (``_NO_PROFILER``).
The scheduler runs in this process, as ``LocalCluster``'s does.

Nobody else gets in: the scheduler and its worker programs speak TLS with a key and certificate made for the job
(``Security.temporary()``, as ``LocalCluster(security=True)`` makes them), held in memory here and handed to the
workers in their job, through a pipe to each. A client without them is refused at every port: on
a shared machine, 127.0.0.1 keeps out other machines but not other users, and a client that connects can run any
code as this user, with its credentials. The scheduler's and workers' HTTP servers serve nothing (no routes).

Small inputs (``programs.small_input``) have no worker programs: when neither a cluster nor a number of workers is
given, their tasks run in threads of this process (``LocalCluster(processes=False)``, which re-imports
nothing either), where they finish before worker programs would have started.

Beside it, what every graph of the package shares: how files are cut into tasks (``batches``, ``biggest_first``)
and how the tasks' results and failures come back (``outcomes``, ``flat``, ``gathered``, ``progress_bar``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import dask
from distributed import (
    CancelledError,
    Client,
    LocalCluster,
    Scheduler,
    Security,
    SpecCluster,
    as_completed,
    progress,
)
from distributed.deploy.subprocess import Subprocess
from distributed.utils import silence_logging_cmgr
from distributed.worker_memory import parse_memory_limit

from .errors import SchedulerConnectionError, StorageConnectionError
from .programs import (
    QUIET,
    Process,
    hand,
    import_path,
    program,
    stop_ahead,
    worker_programs,
)

if TYPE_CHECKING:
    from .model import InputFile

__all__ = ["BATCH_BYTES", "BATCH_RANKS", "batches", "biggest_first", "connect", "flat", "outcomes"]

log = logging.getLogger("tracefuse_dask")

_WORKER_START_TIMEOUT = 60.0  # seconds for the embedded cluster's workers to start and join the scheduler
_WORKER_STOP_TIMEOUT = 10.0  # seconds for one to close before it is killed
_WORKER_ABANDON_TIMEOUT = 1.0  # the same when the job failed: a worker closes only once its running task ends
_BAR_STOP_TIMEOUT = 5.0  # seconds for the progress bar to draw its last line once the tasks are done or one failed
# Without a dashboard nobody sees what Dask's statistical profiler gathers, and it interrupts each task every 10 ms
# (an A100 rank's analysis took 3-4% longer with it; docs/performance.md, "Dask's statistical profiler").
_NO_PROFILER = {"distributed.worker.profile.enabled": False}
# Nobody is told about the embedded cluster's HTTP servers, which Dask starts anyway: they serve nothing.
_NO_HTTP = {"distributed.scheduler.http.routes": [], "distributed.worker.http.routes": []}


class _WorkerProgram(Subprocess):
    """One ``distributed.Worker`` run as ``python -c _PROGRAM``, with this process's Dask config and import path.

    The config and the import path travel in its job (``programs._PROGRAM``), the config
    serialized as Dask hands it to a child (``DASK_INTERNAL_INHERIT_CONFIG``, where the
    program is started here), so that a ``dask.config.set`` around ``connect`` reaches the
    workers, with their logs silenced (``programs.QUIET``). It is one started ahead
    (``programs.start_ahead``) where there is one.
    """

    def __init__(self, scheduler: str, name: str, worker_kwargs: dict, security: Security) -> None:
        self.scheduler = scheduler
        self.stop_timeout = _WORKER_STOP_TIMEOUT
        self.asked_to_stop = False
        self.spec = {"cls": "distributed.Worker", "opts": {**worker_kwargs, "name": name}}
        # the job's TLS credentials, as Dask's config names them: the worker's Security() reads them there
        self.tls = {"distributed.comm.require-encryption": True, "distributed.comm.tls.ca-file": security.tls_ca_file,
                    "distributed.comm.tls.worker.cert": security.tls_worker_cert,
                    "distributed.comm.tls.worker.key": security.tls_worker_key}
        super().__init__()

    async def _start(self) -> None:
        with dask.config.set({**QUIET, **_NO_PROFILER, **_NO_HTTP, **self.tls}):
            config = dask.config.serialize(dask.config.global_config)
        popen = program(config)
        self.process = Process(popen)  # type: ignore[assignment]
        job = {"config": config, "path": import_path(), "argv": [self.scheduler, "--spec", json.dumps(self.spec)]}
        await asyncio.to_thread(hand, popen, json.dumps(job).encode() + b"\n")

    def let_go(self) -> None:
        """Ask the program to stop (SIGTERM: 'dask spec' then closes its worker, which says goodbye to the
        scheduler), once, without waiting for it; on the cluster's event loop."""
        if self.process and self.process.returncode is None and not self.asked_to_stop:
            self.asked_to_stop = True
            self.process.terminate()

    async def close(self) -> None:
        # SIGTERM first: the base class kills at once, and the scheduler would log each broken connection,
        # traceback included.
        if self.process and self.process.returncode is None:
            self.let_go()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.process.wait(), self.stop_timeout)
        await super().close()


def _embedded(n: int, in_process: bool) -> SpecCluster:
    # No dashboard: on a port nobody is told about, Bokeh's would cost 0.6-0.8 s of start-up and 18 MiB here.
    # The scheduler's plain HTTP server (health, metrics) stays on a free port of the loopback, not :8787.
    if in_process:
        with dask.config.set(_NO_PROFILER):
            return LocalCluster(n_workers=n, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0",
                                scheduler_kwargs={"dashboard": False}, silence_logs=False)
    security = Security.temporary()
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "protocol": "tls", "security": security,
                                               "dashboard": False, "dashboard_address": "127.0.0.1:0"}}
    kwargs = {"host": "127.0.0.1", "nthreads": 1, "memory_limit": parse_memory_limit("auto", 1, n, logger=log)}
    worker = {"cls": _WorkerProgram, "options": {"worker_kwargs": kwargs, "security": security}}
    with dask.config.set(_NO_HTTP):  # the scheduler reads it as it starts, here
        return SpecCluster(workers=dict.fromkeys(range(n), worker), scheduler=scheduler, worker=worker,
                           name="tracefuse", security=security)


@contextlib.contextmanager
def connect(
    client: Client | None = None,
    *,
    scheduler: str | None = None,
    scheduler_file: str | None = None,
    workers: int | None = None,
    timeout: float = 10.0,
    in_process: bool = False,
    inputs: Sequence[InputFile] | None = None,
    per_file: int = 0,
) -> Iterator[Client]:
    """Yield a Dask client: the one given, an existing cluster's, or an embedded cluster's.

    An existing cluster comes from ``scheduler``, ``scheduler_file`` or the
    ``scheduler-address`` Dask config (``DASK_SCHEDULER_ADDRESS``). Otherwise a cluster of
    ``workers`` single-threaded worker processes (default: one per core) on 127.0.0.1, without
    a dashboard, is started, its workers awaited, and closed on exit. Its workers are threads of
    this process with ``in_process`` (what ``memory://`` paths need), and when ``workers`` is not
    given and the job's ``inputs`` are small (``small_input``, each file counted ``per_file`` bytes more).

    Raises
    ------
    SchedulerConnectionError
        When the scheduler does not answer within ``timeout`` seconds, or the embedded
        cluster's workers do not start.
    """
    if client is not None:
        stop_ahead()
        yield client
        return
    address = scheduler or dask.config.get("scheduler-address", None)
    where = scheduler_file or address
    try:
        if scheduler_file or address:
            _check_tls_files(None if scheduler_file else address)
        if scheduler_file:
            c = Client(scheduler_file=scheduler_file, timeout=timeout)
        elif address:
            c = Client(address, timeout=timeout)
        else:
            c = None
    except SchedulerConnectionError:
        raise
    except (OSError, TimeoutError, ValueError, TypeError) as e:
        raise SchedulerConnectionError(_tls_problem(where, e) or (
            f"could not connect to the Dask scheduler at {where} within {timeout:g} s ({e}); check "
            "--scheduler/--scheduler-file/DASK_SCHEDULER_ADDRESS, or omit them to use a local cluster")
        ) from None
    if c is not None:
        stop_ahead()
        with c:
            yield c
        return
    programs = worker_programs(workers=workers, in_process=in_process, inputs=inputs, per_file=per_file)
    n = programs or workers or os.cpu_count() or 1
    # Its logs silenced here rather than by the cluster (silence_logs), which gives distributed's handlers their
    # level back before its close is over: an in-process worker whose stream to the scheduler is closed under it
    # then logged a traceback.
    with silence_logging_cmgr(logging.CRITICAL), _quiet("asyncio"), _embedded(n, not programs) as cluster, \
            Client(cluster) as c:
        stop_ahead()  # those the cluster did not take
        try:
            c.wait_for_workers(n, timeout=_WORKER_START_TIMEOUT)
        except TimeoutError:
            raise SchedulerConnectionError(
                f"the embedded Dask cluster's {n} worker(s) did not start within {_WORKER_START_TIMEOUT:g} s "
                f"(each runs Dask's 'dask spec' with '{sys.executable} -c'); check that this Python can run it, or "
                "pass --scheduler to use a running cluster"
            ) from None
        try:
            yield c
        except BaseException:
            # The job failed: what its workers still run is of no use, and may wait on a storage that is gone.
            for w in getattr(cluster, "workers", {}).values():
                if isinstance(w, _WorkerProgram):
                    w.stop_timeout = _WORKER_ABANDON_TIMEOUT
            raise


def let_go(c: Client) -> None:
    """The caller of ``connect`` runs no more tasks: an embedded cluster's worker programs are asked to stop now,
    without waiting, so that they exit on the other cores while the caller goes on (an analysis's reduce),
    and the close at the end of ``connect`` finds them gone. Nothing happens to any other cluster."""
    cluster = getattr(c, "cluster", None)
    programs = [w for w in getattr(cluster, "workers", {}).values() if isinstance(w, _WorkerProgram)]
    if programs:
        cluster.loop.add_callback(lambda: [w.let_go() for w in programs])


_TLS_FILES = (("tls_ca_file", "--tls-ca-file", "ca-file"), ("tls_client_cert", "--tls-cert", "client.cert"),
              ("tls_client_key", "--tls-key", "client.key"))


def _check_tls_files(address: str | None) -> None:
    """The client's TLS files, as Dask's config gives them: each one set exists (Dask would say only "No such file
    or directory"), and a tls:// ``address`` has a CA to trust it by."""
    security = Security()
    for field, flag, key in _TLS_FILES:
        value = getattr(security, field)
        if value and "-----BEGIN" not in value and not os.path.isfile(value):
            raise SchedulerConnectionError(f"the TLS file {value} ({flag}, distributed.comm.tls.{key}) does not "
                                           "exist; give the path of the file the cluster's administrator handed out")
    if address and address.startswith("tls://") and not security.tls_ca_file:
        raise SchedulerConnectionError(_tls_problem(address, TypeError("ssl_context")))


def _tls_problem(where: str | None, e: BaseException) -> str | None:
    """One line for a TLS failure between this client and the scheduler at ``where``, or None if it is not one."""
    text = str(e)
    if isinstance(e, TypeError) and "ssl_context" in text:
        return (f"the Dask scheduler at {where} speaks TLS, and this client has no TLS files: give --tls-ca-file, "
                "--tls-cert and --tls-key (or Dask's distributed.comm.tls.ca-file and client.cert/client.key)")
    if "KEY_VALUES_MISMATCH" in text:
        return "--tls-key is not the key of --tls-cert (distributed.comm.tls.client.key and client.cert)"
    refused = ("refused this client's certificate: give one signed by the cluster's CA with --tls-cert and "
               "--tls-key (distributed.comm.tls.client.cert and client.key)")
    if "UNKNOWN_CA" in text or "CERTIFICATE_REQUIRED" in text or "BAD_CERTIFICATE" in text:
        return f"the Dask scheduler at {where} {refused}"
    if "UNEXPECTED_EOF" in text or "EOF occurred in violation of protocol" in text:  # TLS 1.3 refuses after
        return f"the Dask scheduler at {where} ended the TLS handshake; most likely it {refused}"
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate does not match" in text:
        return (f"this client does not trust the certificate of the Dask scheduler at {where}: give the CA that "
                "signed it with --tls-ca-file (distributed.comm.tls.ca-file)")
    if "WRONG_VERSION_NUMBER" in text or ("SSL" in text and where and not where.startswith("tls://")):
        return f"the Dask scheduler at {where} and this client disagree on TLS: use tls:// if it speaks TLS, tcp:// if not"
    return None


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The logger ``name`` says nothing below ERROR meanwhile: asyncio's child watcher warns ("Unknown child
    process pid ...") when a worker program that a failed job abandons is killed while it exits."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


BATCH_BYTES = 4 * 2**20  # small ranks share tasks of about this many input bytes; bigger ones have their own
BATCH_RANKS = 1024


def outcomes(c: Client, futures: list[Any], show_progress: bool = False) -> list[tuple[Any, BaseException | None]]:
    """Each task's result or exception, in order; one gather, which waits for them all, for the successes.

    A task that finds the storage unreachable (``StorageConnectionError``) ends the wait at once, and its error is
    raised: the other tasks would only wait for the storage too, each through its own retries.

    Everything goes through ``c``: the client need not be the process's default one.
    """
    if show_progress:
        progress_bar(c, futures)
    for f in as_completed(futures, loop=c.loop):
        if f.status == "error" and isinstance(exc := f.exception(), StorageConnectionError):
            raise exc
    ok = iter(c.gather(futures, errors="skip"))
    return [(next(ok), None) if f.status == "finished"
            else (None, f.exception() if f.status == "error" else CancelledError(f"task {f.key} was cancelled"))
            for f in futures]


def gathered(c: Client, futures: list[Any], show_progress: bool = False) -> list[Any]:
    """``c.gather(futures)``, each result fetched as soon as its task finishes: results of megabytes (a rank's
    analysis tables) then cross while the other tasks run, not all after the last one (0.6 s of a 10 s analysis of
    8 ranks). As ``gather``, the first task that fails ends the wait and its error is raised. The progress bar, if
    any, is drawn from a thread of its own meanwhile."""
    bar = None
    if show_progress:
        bar = threading.Thread(target=progress_bar, args=(c, futures), daemon=True)
        bar.start()
    at = {f.key: i for i, f in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    try:
        for f in as_completed(futures, loop=c.loop):
            results[at[f.key]] = f.result()  # raises a failed task's error
    finally:
        if bar is not None:  # it stops at the first error too; its last line before the run's error message
            bar.join(_BAR_STOP_TIMEOUT)
    return results


def progress_bar(c: Client, futures: list[Any]) -> None:
    """Dask's text progress bar of ``futures``, on stderr, until they have all finished."""
    with contextlib.redirect_stdout(sys.stderr):
        progress(futures, scheduler=c.scheduler.address)


def flat(batched: list[tuple[Any, BaseException | None]]) -> list[tuple[Any, BaseException | None]]:
    """Per-item outcomes from those of batch tasks; a batch task that failed as a whole raises its error."""
    items: list[tuple[Any, BaseException | None]] = []
    for result, exc in batched:
        if exc is not None:
            raise exc
        items.extend(result)
    return items


def batches(sizes: list[int | None], limit: int = BATCH_BYTES) -> list[range]:
    """Consecutive items grouped into tasks of about ``limit`` input bytes (at most ``BATCH_RANKS`` items).

    A big rank gets a task of its own; small ones share, so that 10,000 tiny ranks do not
    cost 10,000 tasks. An unknown size counts as big. The grouping depends on the inputs
    alone, and does not change the output.
    """
    out: list[range] = []
    start = total = 0
    for i, size in enumerate(sizes):
        total += limit if size is None else size
        if total >= limit or i + 1 - start >= BATCH_RANKS:
            out.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def biggest_first(sizes: list[int | None]) -> list[int]:
    """The order to submit tasks of these input sizes in: biggest first (an unknown size counts as big, as in
    ``batches``), ties in their given order.

    Dask runs the tasks of one ``map`` in the order given; a big rank that started last would keep the
    other workers waiting for it at the end (longest-processing-time-first scheduling).
    """
    return sorted(range(len(sizes)), key=lambda k: (sizes[k] is not None, -(sizes[k] or 0)))
