"""Scheduled jobs that overlap, and storage that goes away: what a batch job meets in production.

Every run here is the command line in a process of its own, as a CronJob or a Slurm job starts it, on a 16-rank job
built from a real A100 NCCL trace (``../shared/tools/make_dataset.py``), on local disk and on a real S3 server
(SeaweedFS on 127.0.0.1).

- Runs that write the same output at once all succeed, and leave one complete output, the same bytes as one run's;
  a reader polling the output never sees it half-written. A run without ``--force`` whose output already exists
  when it starts stops at once (exit 1), as documented; that can only be a run that starts after another ended.
- Each run keeps a lease beside its own temporary folder (``storage/runs.py``): a crashed run's leftovers (the run
  SIGKILLed) are removed by the next run, a live run's never.
- A storage server killed mid-merge ends the run in seconds with one clear error, leaves the previous output as it
  was, and the next run cleans up; a server restarted mid-merge is not noticed.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from conftest import SHARED, S3Server, shared
from perfetto_rules import assert_perfetto_rules

pytestmark = pytest.mark.integration

A100 = ("real", "hta_trace_filter")  # two ranks of one job, NCCL
GAPS = [0.0, 0.5, 1.0, 2.0]  # seconds between the starts of overlapping runs
EXISTS = "exists; pass --force"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """16 ranks of about 2 MB each (gzip), from the real two-step A100 trace of a 128-rank NCCL job."""
    source = shared("real", "hta_trace_filter", "sampled_rank-0.json.gz")
    out = tmp_path_factory.mktemp("job") / "traces"
    subprocess.run([sys.executable, str(SHARED.parent / "tools" / "make_dataset.py"), "--source", str(source),
                    "--ranks", "16", "--mb-per-rank", "2", "--gzip", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def tracefuse(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tracefuse_dask", *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, **kwargs)


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory) -> bytes:
    """One run's merged output, alone."""
    out = tmp_path_factory.mktemp("ref") / "merged.json.gz"
    done = tracefuse("merge", str(job), "-o", str(out), "-q", "--workers", "1")
    assert done.wait(300) == 0, done.stderr.read()
    return out.read_bytes()


def sha(data: bytes) -> str:
    """What outputs are compared by: a failed comparison of megabytes would have pytest diff them for minutes."""
    return hashlib.sha256(data).hexdigest()


def assert_same(got: bytes, want: bytes) -> None:
    """Outputs compared as bytes; a mismatch says where they first differ (after gzip's decompression), not what
    pytest's diff of megabytes would take minutes to say."""
    if got == want:
        return
    text = [gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b for b in (got, want)]
    at = next((i for i, (a, b) in enumerate(zip(*text)) if a != b), min(map(len, text)))
    raise AssertionError(f"{len(got):,} bytes ({len(text[0]):,} as JSON), not {len(want):,} ({len(text[1]):,}); "
                         f"first difference at {at:,}: {text[0][max(0, at - 150):at + 150]!r} "
                         f"where {text[1][max(0, at - 150):at + 150]!r} was expected")


def overlapping(commands: list[list[str]], gaps: list[float]) -> list[dict]:
    """Start each command ``gaps[k]`` seconds after the first; each run's exit code, stderr, start and end."""
    runs, t0 = [], time.monotonic()
    for cmd, gap in zip(commands, gaps):
        time.sleep(max(0.0, t0 + gap - time.monotonic()))
        runs.append({"proc": tracefuse(*cmd), "start": time.monotonic() - t0})
    for run in runs:
        _, run["err"] = run["proc"].communicate(timeout=600)
        run["end"] = time.monotonic() - t0
        run["code"] = run["proc"].returncode
    return runs


def assert_as_documented(runs: list[dict], force: bool) -> None:
    """Exit 0; or, without --force, exit 1 at once (before any work: sooner than any run that worked) because the
    output existed when the run started, which only a run that ended after another can meet."""
    done = [r for r in runs if r["code"] == 0]
    assert done, [r["err"] for r in runs]
    first_end, shortest = min(r["end"] for r in done), min(r["end"] - r["start"] for r in done)
    for r in runs:
        if r["code"] == 0:
            continue
        assert not force and r["code"] == 1 and EXISTS in r["err"] and "Traceback" not in r["err"], r
        assert r["end"] > first_end and r["end"] - r["start"] < shortest, r


class Poller(threading.Thread):
    """Reads ``read()`` every ``every`` seconds while the runs go on: each read must be absent (None) or the whole
    output."""

    def __init__(self, read, want: bytes, every: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.read, self.want, self.every, self.seen, self.bad = read, want, every, 0, []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            got = self.read()
            if got is not None:
                self.seen += 1
                if got != self.want:
                    self.bad.append(len(got))


def _local_read(path: Path):
    def read():
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
    return read


def _s3_read(fs, key: str):
    def read():
        try:
            return fs.cat(key)
        except FileNotFoundError:
            return None
    return read


def _leftovers_local(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tracefuse-tmp" in p.name)


def _leftovers_s3(fs, bucket: str) -> list:
    fs.invalidate_cache()
    return [p for p in fs.find(bucket, withdirs=True) if "tracefuse-tmp" in p] + \
        (fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads") or [])


# --- overlapping merges --------------------------------------------------------------------------------------------

SCENARIOS = [
    *(pytest.param(2, [0.0, gap], False, id=f"2-runs-{gap:g}s-apart-fresh") for gap in GAPS),
    pytest.param(2, [0.0, 0.5], True, id="2-runs-0.5s-apart-force-over-an-existing-output"),
    pytest.param(4, GAPS, False, id="4-runs-fresh"),
    pytest.param(4, GAPS, True, id="4-runs-force-over-an-existing-output"),
]


@pytest.mark.parametrize("n, gaps, force", SCENARIOS)
def test_overlapping_merges_on_local_disk(n, gaps, force, job, reference, tmp_path):
    out = tmp_path / "out" / "merged.json.gz"
    out.parent.mkdir()
    if force:
        out.write_bytes(b"an older output")
    poll = Poller(_local_read(out), reference)
    if not force:
        poll.start()
    cmd = ["merge", str(job), "-o", str(out), "-q", "--workers", "1", *(["--force"] if force else [])]
    runs = overlapping([cmd] * n, gaps)
    poll.stop.set()
    assert_as_documented(runs, force)
    assert_same(out.read_bytes(), reference)
    assert not poll.bad, f"a reader saw a partial output: {poll.bad}"
    assert _leftovers_local(out.parent) == []


@pytest.mark.parametrize("n, gaps, force", [
    pytest.param(2, [0.0, 1.0], False, id="2-runs-1s-apart-fresh"),
    pytest.param(2, [0.0, 0.0], True, id="2-runs-at-once-force-over-an-existing-output"),
    pytest.param(4, GAPS, False, id="4-runs-fresh"),
    pytest.param(4, GAPS, True, id="4-runs-force-over-an-existing-output"),
])
def test_overlapping_merges_on_s3(n, gaps, force, job, reference, s3, bucket_name):
    s3.bucket(bucket_name)
    fs = s3.fs()
    for p in sorted(job.iterdir()):
        fs.put(str(p), f"{bucket_name}/in/{p.name}")
    out = f"s3://{bucket_name}/out/merged.json.gz"
    if force:
        fs.pipe(f"{bucket_name}/out/merged.json.gz", b"an older output")
    poll = Poller(_s3_read(s3.fs(), f"{bucket_name}/out/merged.json.gz"), reference, every=0.1)
    if not force:
        poll.start()
    cmd = ["merge", f"s3://{bucket_name}/in/", "-o", out, "-q", "--workers", "1",
           "--storage-options", json.dumps(s3.options), *(["--force"] if force else [])]
    runs = overlapping([cmd] * n, gaps)
    poll.stop.set()
    assert_as_documented(runs, force)
    fs.invalidate_cache()
    assert_same(fs.cat(f"{bucket_name}/out/merged.json.gz"), reference)
    assert not poll.bad, f"a reader saw a partial output: {poll.bad}"
    left = _leftovers_s3(fs, bucket_name)
    assert not left, (left[:20], [r["err"] for r in runs])


def test_overlapping_runs_of_other_inputs_leave_the_last_to_finish(job, tmp_path):
    """Two runs over one output, of all ranks and of ranks 0-7: the output is one of the two whole outputs, the one
    of the run that ended last."""
    out = tmp_path / "merged.json"
    alone = {}
    for label, extra in (("all", []), ("half", ["--ranks", "0-7"])):
        p = tracefuse("merge", str(job), "-o", str(tmp_path / f"{label}.json"), "-q", "--workers", "1", *extra)
        assert p.wait(300) == 0
        alone[label] = (tmp_path / f"{label}.json").read_bytes()
    base = ["merge", str(job), "-o", str(out), "-q", "--workers", "1", "--force"]
    runs = overlapping([base, [*base, "--ranks", "0-7"]], [0.0, 0.5])
    assert [r["code"] for r in runs] == [0, 0], [r["err"] for r in runs]
    last = "all" if runs[0]["end"] > runs[1]["end"] else "half"
    assert sha(out.read_bytes()) in {sha(v) for v in alone.values()}
    if abs(runs[0]["end"] - runs[1]["end"]) > 0.5:  # closer ends may swap between the rename and the exit
        assert_same(out.read_bytes(), alone[last])


def test_overlapping_scheduled_runs_with_skip_if_unchanged(job, reference, tmp_path):
    """The CronJob path: overlapping runs with --skip-if-unchanged all succeed, leave the output and its manifest,
    and the next run has nothing to do."""
    out = tmp_path / "merged.json.gz"
    cmd = ["merge", str(job), "-o", str(out), "-q", "--workers", "1", "--skip-if-unchanged"]
    runs = overlapping([cmd] * 4, GAPS)
    assert [r["code"] for r in runs] == [0] * 4, [r["err"] for r in runs]
    assert_same(out.read_bytes(), reference)
    manifest = orjson.loads((tmp_path / "merged.json.gz.manifest.json").read_bytes())
    assert manifest["output_bytes"] == len(reference) and len(manifest["inputs"]) == 16
    again = tracefuse("merge", str(job), "-o", str(out), "--workers", "1", "--skip-if-unchanged")
    assert again.wait(120) == 0 and "up to date" in again.stderr.read()
    assert _leftovers_local(tmp_path) == []


def test_a_manifest_of_other_inputs_than_the_output_s_is_not_trusted(job, tmp_path):
    """Overlapping runs of other inputs could leave one's output and the other's manifest: the manifest records its
    output's size, so a size that differs means a rebuild, not a skip."""
    out = tmp_path / "merged.json"
    cmd = ["merge", str(job), "-o", str(out), "-q", "--workers", "1", "--skip-if-unchanged"]
    assert tracefuse(*cmd).wait(300) == 0
    assert tracefuse(*cmd[:3], str(tmp_path / "half.json"), "-q", "--workers", "1", "--ranks", "0-7").wait(300) == 0
    (tmp_path / "half.json").replace(out)  # another run's output, beside this run's manifest
    again = tracefuse(*cmd[:-1], "--skip-if-unchanged", "--summary-json", stdout=subprocess.PIPE)
    summary = json.loads(again.communicate(timeout=300)[0])
    assert again.returncode == 0 and summary["status"] == "ok" and summary["ranks"] == 16


# --- overlapping analyses and diffs ------------------------------------------------------------------------------

def _folder(path: Path) -> dict[str, str]:
    """A report folder's files by their sha256, once its commit.json is checked to list them all as they are;
    summary.json without the run's own seconds, and commit.json without summary.json's hash."""
    files = {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    commit = orjson.loads(files["commit.json"])
    assert {n: {"bytes": len(b), "sha256": sha(b)} for n, b in files.items() if n != "commit.json"} == commit["files"]
    for name in ("summary.json", "diff.json"):
        if name in files:
            files[name] = orjson.dumps({k: v for k, v in orjson.loads(files[name]).items() if k != "seconds"})
            commit["files"].pop(name)
    files["commit.json"] = orjson.dumps(commit)
    return {name: sha(data) for name, data in files.items()}


@pytest.fixture(scope="module")
def report_alone(job, tmp_path_factory) -> Path:
    """One run's report folder of the job, alone."""
    alone = tmp_path_factory.mktemp("alone") / "report"
    done = tracefuse("analyze", str(job), "-o", str(alone), "-q", "--workers", "1")
    assert done.wait(300) == 0, done.stderr.read()
    return alone


@pytest.mark.parametrize("force", [False, True], ids=["fresh", "force"])
def test_overlapping_analyses_of_one_report_folder(force, job, report_alone, tmp_path):
    out = tmp_path / "report"
    if force:
        out.mkdir()
        (out / "summary.json").write_text("{}")
        (out / "an-older-table.csv").write_text("x")
    cmd = ["analyze", str(job), "-o", str(out), "-q", "--workers", "1", *(["--force"] if force else [])]
    runs = overlapping([cmd] * 4, GAPS)
    assert_as_documented(runs, force)
    assert _folder(out) == _folder(report_alone)
    assert _leftovers_local(tmp_path) == []


def test_overlapping_analyses_on_s3(job, s3, bucket_name, tmp_path):
    s3.bucket(bucket_name)
    fs = s3.fs()
    for p in sorted(job.iterdir()):
        fs.put(str(p), f"{bucket_name}/in/{p.name}")
    cmd = ["analyze", f"s3://{bucket_name}/in/", "-o", f"s3://{bucket_name}/report", "-q", "--workers", "1",
           "--storage-options", json.dumps(s3.options), "--force"]
    assert tracefuse(*cmd[:3], f"s3://{bucket_name}/alone", *cmd[4:]).wait(300) == 0
    runs = overlapping([cmd] * 2, [0.0, 1.0])
    assert [r["code"] for r in runs] == [0, 0], [r["err"] for r in runs]
    fs.invalidate_cache()
    for name in ("report", "alone"):
        fs.get(f"{bucket_name}/{name}/", str(tmp_path / name), recursive=True)
    assert _folder(tmp_path / "report") == _folder(tmp_path / "alone")
    assert not (left := _leftovers_s3(fs, bucket_name)), left[:20]


def test_overlapping_diffs_of_one_folder(job, tmp_path):
    out = tmp_path / "diff"
    cmd = ["diff", str(job), str(shared("real", "hta_trace_filter")), "-o", str(out), "-q", "--workers", "1",
           "--force"]
    runs = overlapping([cmd] * 2, [0.0, 1.0])
    assert [r["code"] for r in runs] == [0, 0], [r["err"] for r in runs]
    alone = tmp_path / "alone"
    assert tracefuse(*cmd[:4], str(alone), *cmd[5:]).wait(300) == 0
    assert _folder(out) == _folder(alone)
    assert _leftovers_local(tmp_path) == []



# --- crashed and live runs -----------------------------------------------------------------------------------------

def _crash_mid_merge(cmd: list[str], has_partition) -> None:
    """Start ``cmd`` in a session of its own and SIGKILL the whole session (the run and its worker programs) once it
    has written a partition, as a node that dies would."""
    proc = tracefuse(*cmd, start_new_session=True)
    deadline = time.monotonic() + 120
    while not has_partition():
        assert proc.poll() is None and time.monotonic() < deadline, "the merge ended before it could be killed"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_a_crashed_run_s_leftovers_are_cleaned_and_a_live_run_s_are_not_local(job, tmp_path):
    from tracefuse_dask.storage.runs import run_folder

    out = tmp_path / "merged.json.gz"
    root = tmp_path / "merged.json.gz.tracefuse-tmp"
    cmd = ["merge", str(job), "-o", str(out), "-q", "--workers", "1"]
    _crash_mid_merge(cmd, lambda: any(root.glob("*/part-*")))
    crashed = sorted(p.name for p in root.iterdir())
    assert any(n.endswith(".lease") for n in crashed) and not out.exists()
    # a live run of another process (this one), and a run on another host whose lease is older than the stale age
    other = root / "0123456789abcdef.lease"
    other.write_bytes(orjson.dumps({"host": "another-host", "pid": 1, "started": "2026-01-01T00:00:00+00:00"}))
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    (root / "0123456789abcdef").mkdir()
    with run_folder(str(out), None) as live:
        Path(live).mkdir(parents=True)
        (Path(live) / "part-00000000.json").write_bytes(b"a live run's partition")
        assert tracefuse(*cmd).wait(300) == 0
        left = sorted(p.name for p in root.iterdir())
        assert left == sorted([Path(live).name, Path(live).name + ".lease"]), left
        assert (Path(live) / "part-00000000.json").read_bytes() == b"a live run's partition"
    assert not root.exists()
    assert_perfetto_rules(orjson.loads(gzip.decompress(out.read_bytes())))


def test_a_lease_renewed_on_another_host_is_alive_until_it_is_stale(tmp_path):
    """A lease that names another host is judged by its age alone: kept while younger than the stale age (Dask
    config tracefuse.lease.stale-after), removed once older."""
    from tracefuse_dask.storage.runs import run_folder

    out = tmp_path / "merged.json"
    root = tmp_path / "merged.json.tracefuse-tmp"
    root.mkdir()
    lease = root / "feedfacefeedface.lease"
    lease.write_bytes(orjson.dumps({"host": "another-host", "pid": os.getpid()}))
    (root / "feedfacefeedface").mkdir()
    import dask

    with dask.config.set({"tracefuse.lease.stale-after": 30}):
        with run_folder(str(out), None):
            assert lease.exists() and (root / "feedfacefeedface").is_dir()
        os.utime(lease, (time.time() - 31, time.time() - 31))
        with run_folder(str(out), None):
            assert not lease.exists() and not (root / "feedfacefeedface").exists()
    assert not root.exists()


@pytest.mark.parametrize("lease, age, alive", [
    pytest.param({"host": "another-host", "pid": 1}, 10, True, id="another-host-fresh"),
    pytest.param({"host": "another-host", "pid": 1}, 31, False, id="another-host-stale"),
    pytest.param({"host": "another-host", "pid": 1, "stale_after": 600}, 100, True,
                 id="its-own-longer-stale-age-counts"),
    pytest.param({"host": "HERE", "space": "another-machine/1", "pid": 4_000_000}, 10, True,
                 id="this-host-name-another-pid-namespace"),
    pytest.param({"host": "HERE", "space": "HERE", "pid": 4_000_000}, 10, False, id="this-machine-a-gone-process"),
    pytest.param({"host": "HERE", "space": "HERE", "pid": "ME"}, 10, False, id="this-process-an-ended-run"),
])
def test_a_lease_is_alive_by_its_age_on_the_storage_s_clock_and_by_its_process(lease, age, alive, tmp_path,
                                                                               monkeypatch):
    """A lease is judged by its age on the storage's clock (this machine's is an hour fast here), against the larger
    of this run's stale age (30 s) and its own; by its process only where its host name and pid namespace are
    this machine's (a container with the host's network shares the name, not the processes)."""
    import socket

    import dask

    from tracefuse_dask.storage import runs

    here = {"HERE": socket.gethostname()}
    lease = {k: here.get(v, v) if k == "host" else runs._process_space() if v == "HERE" else
             os.getpid() if v == "ME" else v for k, v in lease.items()}
    out = tmp_path / "m.json"
    root = tmp_path / "m.json.tracefuse-tmp"
    root.mkdir()
    (root / "feedface.lease").write_bytes(orjson.dumps(lease))
    (root / "feedface").mkdir()
    then = time.time() - age
    os.utime(root / "feedface.lease", (then, then))
    fast = time.time
    monkeypatch.setattr(runs.time, "time", lambda: fast() + 3600)
    with dask.config.set({"tracefuse.lease.stale-after": 30}), runs.run_folder(str(out), None):
        assert (root / "feedface").exists() is alive and (root / "feedface.lease").exists() is alive


def test_a_folder_key_and_a_live_run_on_s3_are_left_alone(job, s3, bucket_name):
    """A key "<out>.tracefuse-tmp/" (what S3 consoles write for a folder, listed by s3fs as an entry) is not a dead
    run's leftover: a run that found it removed every live run's folder."""
    from tracefuse_dask.storage.runs import run_folder

    s3.bucket(bucket_name)
    fs = s3.fs()
    for p in sorted(job.iterdir()):
        fs.put(str(p), f"{bucket_name}/in/{p.name}")
    out = f"s3://{bucket_name}/out/merged.json.gz"
    fs.call_s3("put_object", Bucket=bucket_name, Key="out/merged.json.gz.tracefuse-tmp/", Body=b"")
    with run_folder(out, s3.options) as live:
        fs.pipe(f"{live.removeprefix('s3://')}/part-00000000.json", b"a live run's partition")
        cmd = ["merge", f"s3://{bucket_name}/in/", "-o", out, "-q", "--workers", "1", "--storage-options",
               json.dumps(s3.options)]
        done = tracefuse(*cmd)
        assert done.wait(300) == 0, done.stderr.read()
        fs.invalidate_cache()
        assert fs.cat(f"{live.removeprefix('s3://')}/part-00000000.json") == b"a live run's partition"


def test_a_run_that_ends_aborts_its_own_unfinished_uploads_on_s3(s3, bucket_name):
    """A task killed mid-upload leaves a multipart upload under its run's folder: the run's end aborts it, and
    another run's upload stays (it is alive)."""
    from tracefuse_dask.storage.runs import run_folder

    s3.bucket(bucket_name)
    fs = s3.fs()
    out = f"s3://{bucket_name}/out/merged.json"
    with run_folder(out, s3.options) as other:
        with run_folder(out, s3.options) as mine:
            for folder in (mine, other):
                key = folder.removeprefix(f"s3://{bucket_name}/") + "/part-00000000.json"
                fs.call_s3("create_multipart_upload", Bucket=bucket_name, Key=key)
        left = [up["Key"] for up in fs.call_s3("list_multipart_uploads", Bucket=bucket_name).get("Uploads") or []]
        assert left == [other.removeprefix(f"s3://{bucket_name}/") + "/part-00000000.json"]
    assert not (left := _leftovers_s3(fs, bucket_name)), left


def test_a_crashed_run_s_leftovers_on_s3_are_cleaned_by_the_next_run(job, reference, s3, bucket_name):
    s3.bucket(bucket_name)
    fs = s3.fs()
    for p in sorted(job.iterdir()):
        fs.put(str(p), f"{bucket_name}/in/{p.name}")
    cmd = ["merge", f"s3://{bucket_name}/in/", "-o", f"s3://{bucket_name}/out/merged.json.gz", "-q", "--workers",
           "1", "--storage-options", json.dumps(s3.options)]

    def has_partition() -> bool:
        fs.invalidate_cache()
        try:
            return any("/part-" in p for p in fs.find(f"{bucket_name}/out"))
        except FileNotFoundError:
            return False

    _crash_mid_merge(cmd, has_partition)
    assert _leftovers_s3(fs, bucket_name)
    assert tracefuse(*cmd).wait(300) == 0
    fs.invalidate_cache()
    assert_same(fs.cat(f"{bucket_name}/out/merged.json.gz"), reference)
    assert not (left := _leftovers_s3(fs, bucket_name)), left[:20]


# --- storage that goes away ----------------------------------------------------------------------------------------

@pytest.fixture
def own_s3(tmp_path, job):
    """A SeaweedFS of this test's own (it is killed), with the job uploaded and an earlier output in place."""
    server = S3Server(tmp_path / "weed")
    server.start()
    try:
        server.bucket("traces")
        fs = server.fs()
        for p in sorted(job.iterdir()):
            fs.put(str(p), f"traces/in/{p.name}")
        fs.pipe("traces/out/merged.json", b"the previous output")
        yield server
    finally:
        server.stop()


def _merge_until_a_partition(server: S3Server, env: dict[str, str] | None = None) -> subprocess.Popen:
    fs = server.fs()
    proc = tracefuse("merge", "s3://traces/in/", "-o", "s3://traces/out/merged.json", "-q", "--force",
                     "--workers", "2", "--storage-options", json.dumps(server.options), env=env)
    deadline = time.monotonic() + 120
    while True:
        fs.invalidate_cache()
        if any("/part-" in p for p in fs.find("traces/out")):
            return proc
        assert proc.poll() is None and time.monotonic() < deadline, "the merge ended before the server went away"
        time.sleep(0.02)


@pytest.mark.serial  # timed
def test_a_storage_server_killed_mid_merge_ends_the_run_in_seconds(own_s3, job, tmp_path):
    """The default timeouts and retries (storage.files.options_for and RETRY_WAITS) and a job that stops at its first
    unreachable storage: exit 1 with one clear line well within 15 s of the kill (the bound asserted is generous,
    for a loaded machine), the previous output intact, and the next run cleans up."""
    proc = _merge_until_a_partition(own_s3)
    killed = time.monotonic()
    own_s3.proc.kill()
    own_s3.proc.wait()
    own_s3.proc = None
    _, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - killed
    assert proc.returncode == 1 and err.startswith("error: ") and "cannot reach the storage" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert seconds < 25, f"the run took {seconds:.1f} s to end after the storage was killed"
    own_s3.start()
    fs = own_s3.fs()
    assert fs.cat("traces/out/merged.json") == b"the previous output"
    again = tracefuse("merge", "s3://traces/in/", "-o", "s3://traces/out/merged.json", "-q", "--force",
                      "--workers", "1", "--storage-options", json.dumps(own_s3.options))
    assert again.wait(300) == 0, again.stderr.read()
    assert not (left := _leftovers_s3(fs, "traces")), left[:20]
    local = tmp_path / "local.json"
    assert tracefuse("merge", str(job), "-o", str(local), "-q", "--workers", "1").wait(300) == 0
    fs.invalidate_cache()
    assert_same(fs.cat("traces/out/merged.json"), local.read_bytes())


def test_an_input_storage_that_goes_away_leaves_no_local_temporaries(own_s3, tmp_path):
    """From S3 to a local disk: the storage that went away is the input's, so the run still removes its own
    temporaries from the output's disk."""
    out = tmp_path / "out" / "merged.json"
    out.parent.mkdir()
    proc = tracefuse("merge", "s3://traces/in/", "-o", str(out), "-q", "--workers", "2", "--storage-options",
                     json.dumps(own_s3.options))
    deadline = time.monotonic() + 120
    while not any((tmp_path / "out").glob("*.tracefuse-tmp/*/part-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the merge ended before the server went away"
        time.sleep(0.02)
    own_s3.proc.kill()
    own_s3.proc.wait()
    own_s3.proc = None
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "cannot reach the storage" in err and "s3://traces/in/" in err, err
    assert list(out.parent.iterdir()) == []


def test_a_storage_server_restarted_mid_merge_is_not_noticed(own_s3, job, tmp_path):
    """A server back within the tasks' retries (``RETRY_WAITS``: after 1 s and 2 s more) is not noticed. Idle, SeaweedFS
    is back in about a second; on a loaded machine it can take longer than the retries, and then the run either
    fails as documented for a server that went away (one clear line, the previous output intact), which is asserted
    instead, or did not call on the server while it was away (the time measured here runs from the kill to its first
    listing, longer than what a task saw), and its output is checked as when it is back in time."""
    from tracefuse_dask.storage.files import RETRY_WAITS

    proc = _merge_until_a_partition(own_s3)
    gone = time.monotonic()
    own_s3.proc.kill()
    own_s3.proc.wait()
    own_s3.proc = None
    own_s3.start()  # back once it lists the bucket
    down = time.monotonic() - gone
    _, err = proc.communicate(timeout=300)
    if down > sum(RETRY_WAITS) and proc.returncode != 0:
        assert proc.returncode == 1 and "cannot reach the storage" in err and "s3://traces/" in err, (down, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert own_s3.fs().cat("traces/out/merged.json") == b"the previous output"
        pytest.skip(f"the server was back after {down:.1f} s, after the {sum(RETRY_WAITS):g} s of retries: the run "
                    "failed as documented for a server that went away")
    assert proc.returncode == 0, (down, err)
    fs = own_s3.fs()
    local = tmp_path / "local.json"
    assert tracefuse("merge", str(job), "-o", str(local), "-q", "--workers", "1").wait(300) == 0
    assert_same(fs.cat("traces/out/merged.json"), local.read_bytes())
    assert not (left := _leftovers_s3(fs, "traces")), left[:20]
