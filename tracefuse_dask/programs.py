"""The embedded cluster's worker programs (``cluster.connect``): how many it starts, how one starts and gets its job,
and those started ahead of the cluster.

A worker program is ``python -c _PROGRAM``: the code of ``dask spec``. It takes its job (the scheduler, the worker's
spec and the Dask config) on stdin, so it can start before the scheduler exists. ``tracefuse merge``, ``analyze``
and ``index`` start theirs that way (``start_ahead``) as soon as they know the job will need them: the programs import
Dask and the tasks' modules on the other cores while the command imports the rest, and the cluster takes them as it
starts.

This module imports no Dask, so that the command line can start programs before it imports Dask (0.13-0.26 s of a
command's start on 2 cores, when one core would otherwise idle): it reads Dask's config only where the config may
not be Dask's defaults (``worker_programs``).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import site
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import InputFile

__all__ = ["QUIET", "SMALL_INPUT_BYTES", "Process", "hand", "import_path", "program", "small_input", "start_ahead",
           "stop_ahead", "worker_programs"]

# glibc keeps this much freed memory at the top of a worker's heap instead of handing it back to the system: a
# rank's task then reuses the pages of the one before it instead of faulting them in again (a 50 MB A100 rank's
# analysis in a process: ~35,000 fewer page faults, 0.73-0.79 -> 0.65-0.69 s; docs/performance.md, "A worker's
# freed memory"). Their one task thread allocates from glibc's main arena, as the main thread does, not from an
# arena of its own: a thread's arena hands freed pages back (madvise) despite the pad, and faults them in again
# (an A100 rank in a thread: 38,700 page faults with its own arena, 22,400 with one; 8 such ranks on 2 workers:
# 0.62-0.67 s per task against 0.61-0.62 s; docs/performance.md, "One malloc arena"). A variable the caller set wins.
_WORKER_MALLOC = {"MALLOC_TOP_PAD_": str(256 * 2**20), "MALLOC_ARENA_MAX": "1"}
# A worker program: what 'dask spec' runs (distributed.cli.dask_spec), without the dask command's look for plugins
# among every installed package (0.1 s), and with its objects out of the cyclic collector's sight as it exits, whose
# passes over them took 0.2-0.3 s of its stop (cli.run does the same). It imports the modules its arguments name (a
# warm-up: the tasks it will run import them again, and say what fails), then reads its job on stdin, one JSON line:
# the Dask config it is to run with (this process's, with the job's TLS credentials), its import path (this
# process's, as ``multiprocessing`` hands ``sys.path`` to its children: a ``filter_fn`` from a module beside the
# caller's script is pickled by reference and must import in the worker) and 'dask spec''s arguments (the scheduler,
# --spec). So it can start before the scheduler exists (``start_ahead``); without a job it exits. Until 'dask spec'
# takes over, a Ctrl-C at the terminal is left to this process, which stops it.
_PROGRAM = """\
import atexit, gc, importlib, json, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
atexit.register(gc.freeze)
import dask
from distributed.cli.dask_spec import main
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
line = sys.stdin.readline()
if not line:
    sys.exit()
job = json.loads(line)
dask.config.update(dask.config.config, dask.config.deserialize(job["config"]))
sys.path[:] = job["path"]
sys.argv[1:] = job["argv"]
main()
"""
# What a worker program logs: gcsfs and fsspec log the traceback of a storage request out of retries, and asyncio a
# request that the storage's client library abandoned when the storage went away ("Task exception was never
# retrieved"): the run's error says it, as the command line's own process does (cli.main)
QUIET = {f"logging.{name}": "critical" for name in ("distributed", "gcsfs", "fsspec", "asyncio")}
_ahead: list[tuple[subprocess.Popen, dict[str, str]]] = []  # worker programs started ahead, each with its environment


def import_path() -> list[str]:
    """This process's import path, as a worker program gets it (``_PROGRAM``)."""
    return [p or os.getcwd() for p in sys.path]


def _environment() -> dict[str, str]:
    """A worker program's environment: this process's, with its malloc settings (a variable set here wins)."""
    return {**_WORKER_MALLOC, **os.environ}


def _program(modules: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """A worker program (``_PROGRAM``) that imports ``modules`` (on this process's import path, with ``env``), then
    waits for its job on stdin; its output goes where this process's goes."""
    return subprocess.Popen([sys.executable, "-c", _PROGRAM, *modules], stdin=subprocess.PIPE,
                            env={**env, "PYTHONPATH": os.pathsep.join(import_path())})


def start_ahead(n: int, modules: Sequence[str] = ()) -> None:
    """Start ``n`` worker programs now, for the embedded cluster ``connect`` will start: they import Dask and
    ``modules`` (the tasks' own) on the other cores while this process imports what it needs, and the cluster
    takes them as it starts, if this process's environment is still what it was. Those it
    does not take are stopped when ``connect`` has its cluster, and as this process exits.

    They import Dask before they have their job's config: what Dask reads as it is imported (such as
    ``distributed.comm.offload``) comes from their environment and config files, which are this process's, and
    their logging is ``QUIET``'s from the start. For the command line, which sets nothing else in Dask's config
    before ``connect``, that is the config the job gives; a caller who sets it in its process (``dask.config.set``)
    gets programs started by ``connect``, which have the whole of it from their start."""
    if not _ahead:
        atexit.register(stop_ahead)
    env = _environment()
    quiet = {f"DASK_{key.upper().replace('.', '__')}": level for key, level in QUIET.items()}
    _ahead.extend((_program(modules, {**env, **quiet}), env) for _ in range(n))


def program(config: str) -> subprocess.Popen:
    """A worker program for the embedded cluster: one started ahead that is still running and was started as one
    would be now (in the same environment), else a new one, which has the Dask ``config`` (serialized) from its
    start, as Dask hands it to a child (``DASK_INTERNAL_INHERIT_CONFIG``)."""
    env = _environment()
    while _ahead:
        popen, its = _ahead.pop(0)
        if popen.poll() is None and its == env:
            return popen
        _stop(popen)
    return _program((), {**env, "DASK_INTERNAL_INHERIT_CONFIG": config})


def stop_ahead() -> None:
    """Stop the worker programs started ahead that no cluster took."""
    while _ahead:
        _stop(_ahead.pop()[0])


def _stop(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        popen.terminate()
    popen.wait()


def hand(popen: subprocess.Popen, job: bytes) -> None:
    """Give a worker program its job (``_PROGRAM``); a program that died meanwhile never joins, as one that fails
    to start."""
    with contextlib.suppress(BrokenPipeError):
        popen.stdin.write(job)
        popen.stdin.close()


class Process:
    """A ``subprocess.Popen`` as ``Subprocess`` uses an asyncio process (which cannot be made from a running one)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    async def wait(self) -> int:
        import asyncio  # on the cluster's event loop: imported there (here it would delay the head start)

        while self.popen.poll() is None:
            await asyncio.sleep(0.01)
        return self.popen.returncode

    async def communicate(self) -> tuple[None, None]:
        await self.wait()
        return None, None


SMALL_INPUT_BYTES = 64 * 2**20  # of trace: what the embedded cluster runs in this process (``small_input``)


def small_input(files: Sequence[InputFile], per_file: int = 0) -> bool:
    """True when ``files`` hold at most ``SMALL_INPUT_BYTES`` of trace (``InputFile.trace_bytes``), each counted
    ``per_file`` bytes more (what a task's work on a file costs whatever its size); a file of unknown size is never
    small.

    Small inputs are merged and analysed in threads of this process: two worker programs cost 0.5-1 s to
    start and 0.2 s to stop on 2 cores, the in-process cluster 0.05 s in all. Measured on 2 cores (8 ranks,
    synthetic and real A100 and B200 traces, json and gzip; cluster start, merge and stop), the merge in
    threads took 0.2-0.8 of the time on worker programs up to 64 MiB by this count; gzip inputs broke even
    between 70 MiB (A100, which compresses 14x) and 170 MiB, json ones not below 250 MiB.
    """
    sizes = [f.trace_bytes for f in files]
    if None in sizes:
        return False
    return sum(sizes) + per_file * len(sizes) <= SMALL_INPUT_BYTES


def worker_programs(*, workers: int | None = None, scheduler: str | None = None, scheduler_file: str | None = None,
                    in_process: bool = False, inputs: Sequence[InputFile] | None = None, per_file: int = 0,
                    ahead: bool = False) -> int:
    """How many worker programs ``connect`` starts when given these arguments: 0 when it joins a cluster or runs
    the tasks in threads of this process.

    ``ahead``: for the head start (``start_ahead``), which does not wait for Dask's import where Dask's config
    surely names no scheduler (``_no_scheduler_in_dask_config``); elsewhere it imports Dask and reads the config."""
    if scheduler or scheduler_file:
        return 0
    if not (ahead and _no_scheduler_in_dask_config()):
        import dask

        if dask.config.get("scheduler-address", None):
            return 0
    if in_process or (workers is None and inputs is not None and small_input(inputs, per_file)):
        return 0
    return workers or os.cpu_count() or 1


def _no_scheduler_in_dask_config() -> bool:
    """Whether Dask's config surely names no scheduler, told without importing Dask (0.13-0.26 s of a command's start
    on 2 cores): no Dask variable that could name one (``DASK_SCHEDULER_ADDRESS`` as Dask reads it, a parent's config
    in ``DASK_INTERNAL_INHERIT_CONFIG``) and no file in Dask's config folders (``dask.config.paths``)."""
    if any(k.startswith("DASK_") and k[5:].lower() in ("scheduler_address", "scheduler-address",
                                                       "internal_inherit_config") for k in os.environ):
        return False
    return not any(os.path.isdir(f) and os.listdir(f) for f in _dask_config_folders())


def _dask_config_folders() -> list[str]:
    """The folders where Dask looks for config files (``dask.config.paths``, computed as Dask does)."""
    return [os.getenv("DASK_ROOT_CONFIG", "/etc/dask"), os.path.join(sys.prefix, "etc", "dask"),
            *(os.path.join(prefix, "etc", "dask") for prefix in site.PREFIXES),
            os.path.join(os.path.expanduser("~"), ".config", "dask"),
            *([os.environ["DASK_CONFIG"]] if "DASK_CONFIG" in os.environ else [])]
