from __future__ import annotations

import gzip
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
REAL_SETS = sorted(p.name for p in (SHARED / "real").iterdir() if p.is_dir()) if (SHARED / "real").is_dir() else []
BASE = 1790857026000000000


def shared(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is missing: ../shared/traces must sit beside the repository")
    return path


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


@pytest.fixture(scope="session")
def client():
    """A real process-based LocalCluster with two single-threaded workers."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        yield c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def scheduler_file(tmp_path_factory):
    """A `dask scheduler` and two `dask worker` processes on 127.0.0.1, as an sbatch script starts them."""
    d = tmp_path_factory.mktemp("dask-cli")
    sfile = d / "scheduler.json"
    dask_cli = shutil.which("dask", path=os.path.dirname(sys.executable)) or "dask"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
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
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
