"""Nobody else gets in: the embedded cluster refuses clients without the job's credentials, and a remote cluster
is reached over TLS with the user's files (``--tls-ca-file``, ``--tls-cert``, ``--tls-key`` or Dask's config),
whose mistakes each get one line."""
from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import dask
import psutil
import pytest
from distributed import Client
from distributed.security import Security

from conftest import _free_port, shared
from tracefuse_dask.cli import main
from tracefuse_dask.cluster import connect

pytestmark = pytest.mark.integration
# what conftest's session cluster leaves in Dask's config, taken out: these tests bring their own files or none
NO_TLS_CONFIG = {f"distributed.comm.tls.{k}": None for k in ("ca-file", "client.cert", "client.key")}


def refused(*addresses: tuple[str, Security | None], wait: float = 10.0) -> list[str | None]:
    """For each (address, security), None if a client got in and ran code there; else how it was kept out. Each
    tries in a thread of its own (a Dask client at an HTTP port waits for an answer that never comes), all in a
    process of their own, with this one's Dask config: a client kept out is garbage, whose finalizer, when the
    collector runs it in a thread that is starting another client, closes it under distributed's loop lock, which
    that thread already holds, and every later client of the process waits for it (twice at the end of the suite)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_attempts, args=(addresses, wait, dask.config.get("distributed.comm"), there),
                          daemon=True)
    process.start()
    try:
        assert here.poll(wait + 60), "the attempts did not end"
        return here.recv()
    finally:
        process.kill()
        process.join()


def _attempts(addresses: tuple[tuple[str, Security | None], ...], wait: float, comm: dict, out) -> None:
    """``refused``'s attempts, in its child process; the outcomes go to ``out``."""
    dask.config.set({"distributed.comm": comm})
    outcome: list[str | None] = ["kept waiting"] * len(addresses)

    def attempt(i: int, address: str, security: Security | None) -> None:
        try:
            with Client(address, security=security, timeout=3) as c:
                c.submit(os.getpid).result(timeout=5)
                outcome[i] = None
        except Exception as e:  # noqa: BLE001 - any failure to connect or to run is a refusal
            outcome[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=attempt, args=(i, *a), daemon=True) for i, a in enumerate(addresses)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + wait
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out.send(outcome)


def test_the_embedded_cluster_refuses_a_client_without_the_jobs_credentials_at_every_port():
    with connect(workers=2) as c:
        assert c.scheduler.address.startswith("tls://127.0.0.1:")
        assert refused((c.scheduler.address, c.cluster.security)) == [None]  # the job's own credentials get in
        pids = set(c.run(os.getpid).values())
        ports = {int(c.scheduler.address.rsplit(":", 1)[1]), c.cluster.scheduler.http_server.port}
        ports |= {conn.laddr.port for pid in pids for conn in psutil.Process(pid).net_connections("inet")
                  if conn.status == psutil.CONN_LISTEN}
        assert len(ports) == 6  # the scheduler's and each worker's: its comm and its HTTP server
        strangers = [(f"{scheme}://127.0.0.1:{port}", security) for port in sorted(ports)
                     for scheme, security in (("tcp", None), ("tls", None), ("tls", Security.temporary()))]
        for (address, security), why in zip(strangers, refused(*strangers)):
            assert why is not None, (address, "got in with", "its own credentials" if security else "none")
        for port in sorted(ports):
            try:  # the HTTP servers serve nothing: no health, metrics or scheduler pages
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            except urllib.error.HTTPError as e:
                assert e.code == 404, port
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # a comm port: not HTTP
            else:
                raise AssertionError(f"port {port} answered HTTP")


def _ca_and_leaves(d: Path, *names: str) -> dict[str, Path]:
    """A CA (``ca.pem``) and, for each name, a certificate it signed and its key (``{name}.pem``,
    ``{name}-key.pem``), as a cluster's administrator hands them out (the ``cryptography`` package)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{d.name} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    d.mkdir(parents=True, exist_ok=True)
    files = {"ca": d / "ca.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        files[name], files[f"{name}-key"] = d / f"{name}.pem", d / f"{name}-key.pem"
        files[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{name}-key"].write_bytes(key_pem(key))
    return files


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    """A ``dask scheduler`` and a ``dask worker`` on 127.0.0.1 that speak TLS only, with certificates of a CA made
    here: (its address, the client's files, another CA's files)."""
    d = tmp_path_factory.mktemp("tls")
    files = _ca_and_leaves(d / "cluster", "scheduler", "worker", "client")
    other = _ca_and_leaves(d / "other", "client")
    dask_cli = shutil.which("dask", path=os.path.dirname(sys.executable)) or "dask"
    address = f"tls://127.0.0.1:{_free_port()}"
    tls = ["--tls-ca-file", str(files["ca"])]
    procs = [subprocess.Popen([dask_cli, "scheduler", "--protocol", "tls", "--host", "127.0.0.1", "--port",
                               address.rsplit(":", 1)[1], "--dashboard-address", f"127.0.0.1:{_free_port()}", *tls,
                               "--tls-cert", str(files["scheduler"]), "--tls-key", str(files["scheduler-key"])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        procs.append(subprocess.Popen([dask_cli, "worker", address, "--nthreads", "1", "--no-dashboard", "--host",
                                       "127.0.0.1", *tls, "--tls-cert", str(files["worker"]), "--tls-key",
                                       str(files["worker-key"])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        mine = Security(tls_ca_file=str(files["ca"]), tls_client_cert=str(files["client"]),
                        tls_client_key=str(files["client-key"]), require_encryption=True)
        deadline = time.monotonic() + 60
        while True:  # the scheduler takes a moment to listen, the worker to join it
            try:
                with Client(address, security=mine, timeout=5) as c:
                    c.wait_for_workers(1, timeout=30)
                break
            except OSError:
                assert time.monotonic() < deadline, "the TLS scheduler did not start"
                time.sleep(0.5)
        yield address, files, other
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(20)


def test_a_tls_cluster_merges_through_the_cli_flags_and_dask_config_as_a_local_merge(tls_cluster, tmp_path):
    address, files, _ = tls_cluster
    job = shared("gloo_4ranks")
    assert main(["merge", str(job), "-o", str(tmp_path / "local.json"), "-q"]) == 0
    flags = ["--tls-ca-file", str(files["ca"]), "--tls-cert", str(files["client"]), "--tls-key",
             str(files["client-key"])]
    assert main(["merge", str(job), "-o", str(tmp_path / "flags.json"), "-q", "--scheduler", address, *flags]) == 0
    config = {"distributed.comm.tls.ca-file": str(files["ca"]), "distributed.comm.tls.client.cert": str(files["client"]),
              "distributed.comm.tls.client.key": str(files["client-key"]), "distributed.comm.require-encryption": True}
    from tracefuse_dask import merge_traces

    with dask.config.set(config):  # the API, as a user's own Dask config (~/.config/dask/*.yaml) sets it
        merge_traces(str(job), str(tmp_path / "config.json"), scheduler=address)
    local = (tmp_path / "local.json").read_bytes()
    assert (tmp_path / "flags.json").read_bytes() == local == (tmp_path / "config.json").read_bytes()
    with dask.config.set(NO_TLS_CONFIG):
        assert all(refused((address, None), (address.replace("tls://", "tcp://"), None), (address, Security.temporary())))


def test_each_tls_mistake_gets_one_line_that_says_what_to_give(tls_cluster, tmp_path, capsys):
    address, files, other = tls_cluster
    trace = tmp_path / "in" / "rank0.json"
    trace.parent.mkdir()
    trace.write_text('{"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 1}]}')
    right = {"--tls-ca-file": files["ca"], "--tls-cert": files["client"], "--tls-key": files["client-key"]}
    cases = [
        ({**right, "--tls-ca-file": tmp_path / "nope.pem"}, 1,
         f"the TLS file {tmp_path / 'nope.pem'} (--tls-ca-file, distributed.comm.tls.ca-file) does not exist"),
        ({}, 1, f"the Dask scheduler at {address} speaks TLS, and this client has no TLS files: give --tls-ca-file"),
        ({**right, "--tls-ca-file": other["ca"]}, 1,
         f"this client does not trust the certificate of the Dask scheduler at {address}: give the CA"),
        ({**right, "--tls-cert": other["client"], "--tls-key": other["client-key"]}, 1,
         "refused this client's certificate: give one signed by the cluster's CA"),  # or ended the handshake
        ({**right, "--tls-key": files["ca"].with_name("worker-key.pem")}, 1,
         "--tls-key is not the key of --tls-cert"),
        ({"--tls-key": files["client-key"]}, 2, "--tls-key is the key of --tls-cert; give --tls-cert too"),
    ]
    for flags, code, line in cases:
        argv = ["info", str(trace.parent), "--scheduler", address, "--timeout", "5",
                *(str(x) for kv in flags.items() for x in kv)]
        with dask.config.set(NO_TLS_CONFIG):
            assert main(argv) == code, flags
        err = capsys.readouterr().err
        assert line in err and "Traceback" not in err, (flags, err)
        assert len([ln for ln in err.splitlines() if ln.startswith(("error:", "tracefuse info: error:"))]) == 1
    assert main(["info", str(trace.parent), "--tls-ca-file", str(files["ca"])]) == 2
    assert "give --scheduler or --scheduler-file too (the embedded cluster makes its own)" in capsys.readouterr().err
