"""Nothing waits forever: a storage that stops answering fails the run within ``--storage-timeout``, with one
line naming the endpoint and nothing left behind; a slow storage that keeps sending is never cut off.

The storages are real: SeaweedFS behind a proxy started here that either passes everything on at a set rate, or
stops sending a response's body halfway; and a server that accepts connections and never answers."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import shared
from tracefuse_dask.storage.files import stall_wait

pytestmark = pytest.mark.integration


class Proxy:
    """A TCP proxy on 127.0.0.1 to ``port``: server bytes pass at ``rate`` bytes/s (None: at once), and each
    connection's answer stops for good after ``stall_after`` bytes (None: never)."""

    def __init__(self, port: int | None, rate: float | None = None, stall_after: int | None = None) -> None:
        self.target, self.rate, self.stall_after = port, rate, stall_after
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(client)
            if self.target is None:
                continue  # accepts, and never answers
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.held.append(upstream)
            threading.Thread(target=self._pipe, args=(client, upstream, None, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.rate, self.stall_after),
                             daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, rate: float | None, stall_after: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(8192 if rate is None else 4096):
                if stall_after is not None and sent + len(data) > stall_after:
                    dst.sendall(data[: max(0, stall_after - sent)])
                    threading.Event().wait()  # holds the connection open, silent
                dst.sendall(data)
                sent += len(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for s in self.held:
            s.close()


def tracefuse(*args: str, timeout: float = 180) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tracefuse_dask", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)
    return done, time.monotonic() - start


def s3_options(s3, url: str) -> str:
    return json.dumps({**s3.options, "client_kwargs": {"endpoint_url": url}})


def gcs_options(url: str) -> str:
    return json.dumps({"endpoint_url": url, "token": "anon"})


GCS_BOUND = 45.0  # gcsfs waits 31-36 s between its six tries, whatever the bound: 45 s leaves each try 1.5 s


def _gloo_in(server, protocol: str) -> tuple[str, Path]:
    """The real gloo_4ranks job in a bucket of ``server``: (its URL, its local folder)."""
    folder = shared("gloo_4ranks")
    fs = server.fs()
    bucket = server.bucket("stalls")
    for f in sorted(folder.glob("rank*.json.gz")):
        fs.put(str(f), f"{bucket}/gloo/{f.name}")
    return f"{protocol}://{bucket}/gloo/", folder


@pytest.fixture(scope="module")
def gloo_on_s3(s3):
    """The job in SeaweedFS."""
    return _gloo_in(s3, "s3")


@pytest.fixture(scope="module")
def gloo_on_gcs(gcs):
    """The job in fake-gcs-server."""
    return _gloo_in(gcs, "gs")


def assert_failed_in_time(done: subprocess.CompletedProcess, took: float, bound: float, endpoint: str,
                          out: Path) -> None:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"the storage at {endpoint} stopped answering" in errors[0]
    assert f"within the {bound:g} s bound" in errors[0] and "--storage-timeout" in errors[0]
    assert took < bound + 10, took  # the bound, and the interpreter's start and the cluster's
    assert not list(out.parent.iterdir()), list(out.parent.iterdir())  # no output, no temporaries


def _at_once(runs: dict[str, tuple[Proxy, list[str], float]], tmp_path: Path) -> dict[str, tuple]:
    """Each run (its proxy, its ``tracefuse merge`` arguments after the input and its bound) at once, each in a
    thread: they wait on their storage, not on the machine. Each case: (the run, seconds, bound, endpoint, out)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(case: str) -> tuple:
        proxy, args, bound = runs[case]
        out = tmp_path / case / "out" / "m.json.gz"
        out.parent.mkdir(parents=True)
        args = [str(out) if a == "OUT" else a for a in args]
        return (*tracefuse("merge", *args, "--storage-timeout", f"{bound:g}"), bound, proxy.url, out)

    try:
        with ThreadPoolExecutor(len(runs)) as pool:
            return dict(zip(runs, pool.map(one, runs)))
    finally:
        for proxy, _, _ in runs.values():
            proxy.close()


@pytest.fixture(scope="module")
def runs(gloo_on_s3, gloo_on_gcs, s3, gcs, tmp_path_factory):
    """Every run of this module at once (they wait on their storage, not on the machine), each case: (the run,
    seconds, bound, endpoint, out).

    - S3: an endpoint that accepts and never answers, as the input and as the output; and an answer that stops
      halfway: the listing (a few kB) gets through, a rank's body (17 kB) stops after 10 kB.
    - GCS: the same silent endpoint and halfway answer, as the input.
    - ``slow``: an S3 that keeps sending, at 5 kB/s."""
    s3_url, folder = gloo_on_s3
    gcs_url, _ = gloo_on_gcs
    silent, mute, half = Proxy(None), Proxy(None), Proxy(s3.ports["s3.port"], stall_after=10_000)
    gcs_silent, gcs_half = Proxy(None), Proxy(gcs.port, stall_after=10_000)
    slow = Proxy(s3.ports["s3.port"], rate=5_000)
    return _at_once({"input": (silent, [s3_url, "-o", "OUT", "--storage-options", s3_options(s3, silent.url)], 20.0),
                     "output": (mute, [str(folder), "-o", "s3://stalls/out/m.json.gz", "--storage-options",
                                       s3_options(s3, mute.url)], 20.0),
                     "halfway": (half, [s3_url, "-o", "OUT", "--storage-options", s3_options(s3, half.url)], 20.0),
                     **{f"gcs-{stall}": (p, [gcs_url, "-o", "OUT", "--storage-options", gcs_options(p.url)], GCS_BOUND)
                        for stall, p in (("silent", gcs_silent), ("halfway", gcs_half))},
                     "slow": (slow, [s3_url, "-o", "OUT", "--storage-options", s3_options(s3, slow.url), "--workers",
                                     "1"], 3.0)},
                    tmp_path_factory.mktemp("stalls"))


@pytest.mark.parametrize("case", ["input", "output", "halfway"])
def test_an_s3_endpoint_that_stalls_fails_within_the_bound(case, runs):
    assert_failed_in_time(*runs[case])


def test_a_slow_s3_that_keeps_sending_is_never_cut_off(gloo_on_s3, runs, tmp_path):
    """At 5 kB/s each of the job's 17 kB ranks takes longer than the 3 s bound, and far longer than its wait for a
    byte (1 s): the run succeeds, with the bytes of a local merge."""
    _, folder = gloo_on_s3
    assert stall_wait("s3", 3) == 1.0
    done, took, _, _, out = runs["slow"]
    assert done.returncode == 0, done.stderr
    assert took > 4 * 17_000 / 5_000, took
    local, _ = tracefuse("merge", str(folder), "-o", str(tmp_path / "local.json.gz"))
    assert local.returncode == 0, local.stderr
    assert out.read_bytes() == (tmp_path / "local.json.gz").read_bytes()


@pytest.mark.parametrize("stall", ["silent", "halfway"])
def test_a_gcs_endpoint_that_stalls_fails_within_the_bound(stall, runs):
    """A server that accepts and never answers, and one whose listing gets through while a rank's body (17 kB)
    stops after 10 kB: one request series of gcsfs (six tries) fits the bound, and no second series follows it
    (fsspec's isdir would take the stall for "not a folder", the header pass for a damaged file, and ask again).
    As the input only: the output's requests are the ones the S3 test stalls, and a GCS test waits 45 s."""
    assert_failed_in_time(*runs[f"gcs-{stall}"])
