"""Report folders committed whole (``storage/folders.py``): runs that commit one folder at once, on local disk, a
real S3 server (SeaweedFS) and a real GCS emulator (fake-gcs-server), leave one run's whole folder; readers refuse a
mixed or uncommitted folder; ``analyze --skip-if-unchanged`` trusts only what a commit shows.

Like ``test_overlap.py``, whose helpers it uses, every run is the command line in a process of its own."""
from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import orjson
import pytest

from conftest import shared
from test_overlap import A100, _folder, _leftovers_s3, overlapping, tracefuse

pytestmark = pytest.mark.integration


def _commit_store(store: str, request, bucket_name: str, tmp_path: Path):
    """A filesystem and a folder on it to commit into: local disk, SeaweedFS or fake-gcs-server."""
    if store == "local":
        import fsspec

        return fsspec.filesystem("file"), str(tmp_path / "folder")
    server = request.getfixturevalue(store)
    server.bucket(bucket_name)
    return server.fs(), f"{bucket_name}/folder"


@pytest.mark.parametrize("store", ["local", "s3", "gcs"])
def test_runs_that_commit_one_folder_at_once_leave_one_run_s_whole_folder(store, request, bucket_name, tmp_path):
    """Two runs of different jobs (other files, other names) commit one folder at the same moment, ten times: the
    folder is then one run's, whole (its files and nothing else, as its commit lists them); on object storage most
    of the commits overlapped."""
    from tracefuse_dask.storage.folders import commit_folder, read_committed

    fs, folder = _commit_store(store, request, bucket_name, tmp_path)
    runs = {run: {f"{t}.{fmt}": f"{run}'s {t} ".encode() * n for t in ("breakdown", "kernels", "ops")}
            | {"report.html": f"<p>{run}</p>".encode() * n, "summary.json": orjson.dumps({"run": run})}
            for run, fmt, n in (("a", "parquet", 3000), ("b", "csv", 50))}

    def stage(trial: int, run: str) -> str:
        staged = f"{folder}-staged/{trial}-{run}/folder"  # as run_folder gives each run its own
        fs.makedirs(staged, exist_ok=True)
        for name, data in runs[run].items():
            fs.pipe(f"{staged}/{name}", data)
        return staged

    solo = float("inf")  # a's quickest commit alone: b starts up to 45% of it later than a
    for warm in (-3, -2, -1):
        t0 = time.monotonic()
        commit_folder(fs, stage(warm, "a"), folder, runs["a"])
        solo = min(solo, time.monotonic() - t0)
    overlapped = 0
    for trial in range(10):
        staged = {run: stage(trial, run) for run in runs}
        start, spans = threading.Barrier(2), {}

        def commit(run: str) -> None:
            start.wait()
            time.sleep(solo * trial / 20 * (run == "b"))
            t0 = time.monotonic()
            commit_folder(fs, staged[run], folder, runs[run])
            spans[run] = (t0, time.monotonic())

        threads = [threading.Thread(target=commit, args=(run,)) for run in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(spans) == {"a", "b"}
        overlapped += spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1]
        url = folder if store == "local" else f"{store}://{folder}"
        committed = read_committed(url, request.getfixturevalue(store).options if store != "local" else None)
        won = orjson.loads(committed.read("summary.json"))["run"]
        assert {name: committed.read(name) for name in committed.names} == runs[won], trial
        fs.invalidate_cache()
        assert sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)) == \
            sorted([*runs[won], "commit.json"]), trial
    # a local commit is two renames, too quick to overlap reliably; an object store's takes rounds of requests
    assert store == "local" or overlapped >= 5, f"only {overlapped} of 10 trials had both commits at once"


def _upload_dir(fs, local: Path, prefix: str) -> None:
    for p in sorted(local.iterdir()):
        fs.put(str(p), f"{prefix}/{p.name}")


class ReportPoller(threading.Thread):
    """Reads the report folder ``url`` with ``read_report`` while the runs go on: each read must be a clear refusal
    (absent, being written, being replaced) or the whole report of one of ``jobs`` (job: its input URLs)."""

    def __init__(self, url: str, so: dict, jobs: dict[str, list[str]]) -> None:
        super().__init__(daemon=True)
        self.url, self.so, self.jobs = url, so, {j: sorted(paths) for j, paths in jobs.items()}
        self.seen, self.refused, self.bad = set(), 0, []
        self.stop = threading.Event()

    def run(self) -> None:
        from tracefuse_dask import MergeError
        from tracefuse_dask.analysis import read_report

        while not self.stop.wait(0.05):
            try:
                report = read_report(self.url, self.so)
            except MergeError as e:
                self.refused += 1
                if "no commit.json" not in str(e) and "is not the file its commit.json lists" not in str(e):
                    self.bad.append(str(e))
                continue
            except FileNotFoundError:
                continue
            job = next((j for j, paths in self.jobs.items() if sorted(report.summary["inputs"]) == paths), None)
            ranks = sorted(report.breakdown["rank"].unique().tolist())
            if job is None or ranks != sorted(report.summary["ranks"]):
                self.bad.append(f"a mixed report: inputs {report.summary['inputs'][:2]}..., ranks {ranks}")
            else:
                self.seen.add(job)


def test_two_analyses_of_different_jobs_into_one_s3_folder_leave_one_whole_report(s3, bucket_name, tmp_path):
    """Two ``analyze`` runs of two real jobs (2 A100 ranks of NCCL; 4 CPU ranks of gloo) into one S3 folder, started
    so that they end at the same moment, three times: the folder is each time one run's whole report, the same as
    that job analysed alone; a reader polling it meanwhile gets a whole report of one job, or a clear refusal, never
    a mix."""
    s3.bucket(bucket_name)
    fs = s3.fs()
    _upload_dir(fs, shared(*A100), f"{bucket_name}/big")
    _upload_dir(fs, shared("gloo_4ranks"), f"{bucket_name}/small")
    so = json.dumps(s3.options)
    common = ["-q", "--workers", "1", "--storage-options", so]
    alone, took = {}, {}
    for name in ("big", "small"):
        t0 = time.monotonic()
        p = tracefuse("analyze", f"s3://{bucket_name}/{name}/", "-o", f"s3://{bucket_name}/alone-{name}", *common)
        assert p.wait(300) == 0, p.stderr.read()
        took[name] = time.monotonic() - t0
        fs.invalidate_cache()
        fs.get(f"{bucket_name}/alone-{name}/", str(tmp_path / f"alone-{name}"), recursive=True)
        alone[name] = _folder(tmp_path / f"alone-{name}")
    jobs = {name: json.loads((tmp_path / f"alone-{name}" / "summary.json").read_text())["inputs"]
            for name in ("big", "small")}
    url = f"s3://{bucket_name}/report"
    poll = ReportPoller(url, s3.options, jobs)
    poll.start()
    lead = max(0.0, took["big"] - took["small"])
    for k, shift in enumerate((0.0, -0.3, 0.3)):
        cmds = [["analyze", f"s3://{bucket_name}/{name}/", "-o", url, "--force", *common] for name in ("big", "small")]
        runs = overlapping(cmds, [0.0, max(0.0, lead + shift)])
        assert [r["code"] for r in runs] == [0, 0], [r["err"] for r in runs]
        fs.invalidate_cache()
        got = tmp_path / f"report-{k}"
        fs.get(f"{bucket_name}/report/", str(got), recursive=True)
        assert _folder(got) in alone.values(), k
    poll.stop.set()
    poll.join(30)
    assert not poll.bad, poll.bad[:5]
    assert poll.seen, "the reader never read a whole report"
    assert not (left := _leftovers_s3(fs, bucket_name)), left[:20]


def test_readers_refuse_a_mixed_or_uncommitted_folder_and_skip_if_unchanged_rebuilds_it(tmp_path):
    """A report folder with another run's file in it (a run that stopped halfway through replacing it), or without
    its commit, is refused by ``diff`` with one clear line; ``analyze --skip-if-unchanged`` analyses again instead of
    trusting it, and leaves a whole folder."""
    out, other = tmp_path / "report", tmp_path / "other"
    job = shared(*A100)
    for folder, extra in ((out, []), (other, ["--ranks", "0"])):
        p = tracefuse("analyze", str(job), "-o", str(folder), "-q", "--workers", "1", *extra)
        assert p.wait(300) == 0, p.stderr.read()
    whole = _folder(out)
    (out / "kernels.parquet").write_bytes((other / "kernels.parquet").read_bytes())
    d = tracefuse("diff", str(out), str(other), "-o", str(tmp_path / "diff"), "-q", "--workers", "1")
    err = d.communicate(timeout=300)[1]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert d.returncode == 1 and "Traceback" not in err and len(errors) == 1, err
    assert f"{out}: kernels.parquet is not the file its commit.json lists: another run is replacing this folder now, " \
           "or one stopped halfway" in err
    assert not (tmp_path / "diff").exists()
    again = tracefuse("analyze", str(job), "-o", str(out), "--workers", "1", "--skip-if-unchanged")
    err = again.communicate(timeout=300)[1]
    assert again.returncode == 0 and "up to date" not in err and f"wrote {out}/report.html" in err, err
    assert _folder(out) == whole
    (out / "commit.json").unlink()
    d = tracefuse("diff", str(out), str(other), "-o", str(tmp_path / "diff"), "-q", "--workers", "1")
    err = d.communicate(timeout=300)[1]
    assert d.returncode == 1 and f"{out}: no commit.json, so not a finished tracefuse folder" in err, err


def test_analyze_skip_if_unchanged_skips_only_what_its_commit_shows(s3, bucket_name, tmp_path):
    """The nightly analysis on S3 of a real job: a second run with the same inputs and options does nothing (the
    folder is not touched); a changed input, or another option, analyses again."""
    s3.bucket(bucket_name)
    fs = s3.fs()
    job = shared(*A100)
    _upload_dir(fs, job, f"{bucket_name}/in")
    url = f"s3://{bucket_name}/report"
    cmd = ["analyze", f"s3://{bucket_name}/in/", "-o", url, "--workers", "1", "--storage-options",
           json.dumps(s3.options), "--skip-if-unchanged"]

    def run(*extra: str) -> str:
        p = tracefuse(*cmd, *extra)
        err = p.communicate(timeout=300)[1]
        assert p.returncode == 0, err
        return err

    def committed() -> bytes:
        fs.invalidate_cache()
        return fs.cat(f"{bucket_name}/report/commit.json")

    assert "up to date" not in run()
    first = committed()
    assert run() == f"unchanged: {url} is up to date: inputs, options and version as in its commit.json; nothing " \
                    "to do\n"
    assert committed() == first
    assert "up to date" not in run("--steps", "1-1")
    assert orjson.loads(committed())["made_from"]["options"]["steps"] == [1, 1]
    assert "up to date" in run("--steps", "1-1")
    rank0 = f"{bucket_name}/in/{sorted(job.glob('*.json.gz'))[0].name}"
    fs.pipe(rank0, gzip.compress(gzip.decompress(fs.cat(rank0)), mtime=1))  # the same trace in other bytes
    assert "up to date" not in run("--steps", "1-1")
    usage = tracefuse(*cmd, "--critical-path-trace", str(tmp_path / "path.json"))
    err = usage.communicate(timeout=60)[1]
    assert usage.returncode == 2 and "--skip-if-unchanged compares with the report folder's commit.json" in err, err


