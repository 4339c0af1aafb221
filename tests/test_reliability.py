"""Bad input, faults and interruptions: clear errors, no partial output, typed exceptions."""
from __future__ import annotations

import gzip
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import orjson
import pytest

from conftest import make_trace, shared, write_trace
from perfetto_rules import assert_perfetto_rules, load_exact
from tracefuse_dask import OutputWriteError, TraceFormatError, merge_traces
from tracefuse_dask.cli import main
from tracefuse_dask.synth import make_rank_trace

pytestmark = pytest.mark.integration

EV = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 7, "tid": 7, "ts": 10.5, "dur": 2.25}


def good(rank: int, n: int = 200) -> bytes:
    return orjson.dumps(make_trace(rank, [dict(EV, ts=10.5 + k) for k in range(n)], world_size=3))


def cut(data: bytes) -> bytes:
    return data[: int(len(data) * 0.6)]


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


TAR = _tar({"perfetto_manifest.json": b"{}", "rank-00001.json": good(1)})  # as --format perfetto-archive writes


BAD = [
    pytest.param("rank1.json", cut(good(1)), "it was probably truncated; pass --repair to recover its complete "
                 "events, or re-export the trace or drop this file", id="truncated"),
    pytest.param("rank1.json.gz", gzip.compress(good(1), mtime=0)[:-300], "corrupt or truncated gzip",
                 id="truncated-gz"),
    pytest.param("rank1.json", b"", "the file is empty", id="empty"),
    pytest.param("rank1.json.gz", b"", "the file is empty", id="empty-gz"),
    pytest.param("rank1.json.gz", b"\x1f\x8b\x08\x00garbage-not-deflate", "corrupt or truncated gzip",
                 id="corrupt-gz"),
    pytest.param("rank1.json", b"hello, world", "not valid JSON at byte 0, near 'hello, world': the file is damaged "
                 "or not a trace. Re-export the trace or drop this file", id="not-json"),
    pytest.param("rank1.json", b'{"traceEvents": [tru]}', "not valid JSON at byte 17, near '{\"traceEvents\": [tru]}'",
                 id="bad-literal"),
    pytest.param("merged.tar", TAR, "a TAR archive, not a JSON trace", id="perfetto-archive"),
    pytest.param("rank1.json", b'{"schemaVersion": 1}', "no traceEvents key", id="no-trace-events"),
    pytest.param("rank1.json", b'{"traceEvents": {"a": 1}}', "traceEvents is a dict, not a list",
                 id="trace-events-not-list"),
    pytest.param("rank1.json", orjson.dumps(make_trace(1, [dict(EV, ts="12.5")], world_size=3)), "ts='12.5'",
                 id="string-ts"),
    pytest.param("rank1.json", orjson.dumps(make_trace(1, [dict(EV, pid=[1])], world_size=3)), "pid=[1]",
                 id="list-pid"),
    pytest.param("rank1.json", orjson.dumps(make_trace(1, [dict(EV, dur="4")], world_size=3)), "bad dur='4'",
                 id="string-dur"),
    pytest.param("rank1.json", good(1).replace(b'"ts":10.5', b'"ts":NaN', 1), "not valid JSON", id="nan"),
    pytest.param("rank1.json", good(1).replace(b'"ts":10.5', b'"ts":Infinity', 1), "not valid JSON",
                 id="infinity"),
    pytest.param("rank1.json", good(1).replace(b'"ts":10.5', b'"ts":123456789012345678901234', 1),
                 "within ±2**63 ns", id="int-beyond-2-64"),
    pytest.param("rank1.json", good(1).replace(b"aten::mm", b"aten::\xff\xfe", 1), "not UTF-8", id="non-utf8"),
]


@pytest.mark.parametrize("name, data, message", BAD)
def test_bad_input_is_one_clear_error_and_leaves_nothing(name, data, message, client, tmp_path, capsys):
    inputs = tmp_path / "in"
    write_trace(inputs / "rank0.json", good(0))
    (inputs / name).write_bytes(data)
    out = tmp_path / "out" / "merged.json.gz"
    out.parent.mkdir()
    code = main(["merge", str(inputs / "rank0.json"), str(inputs / name), "-o", str(out),
                 "--scheduler", client.scheduler.address])
    err = capsys.readouterr().err
    assert code == 1
    assert message in err and name in err and "Traceback" not in err, err
    assert err.startswith("error: ") and "Otherwise" not in err and "expected '" not in err  # no parser's words
    assert list(out.parent.iterdir()) == []


def test_on_error_skip_goes_on_and_records_the_bad_rank(client, tmp_path, capsys):
    write_trace(tmp_path / "rank0.json", good(0))
    (tmp_path / "rank1.json").write_bytes(cut(good(1)))
    write_trace(tmp_path / "rank2.json.gz", good(2))
    out = tmp_path / "m.json"
    assert main(["merge", str(tmp_path), "-o", str(out), "--on-error", "skip", "--summary-json",
                 "--scheduler", client.scheduler.address]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["ranks"] == 2 and [s["rank"] for s in summary["skipped"]] == [1]
    assert "skipped rank 1:" in captured.err and "truncated" in captured.err
    merged = load_exact(out)
    (skipped,) = merged["metadata"]["tracefuse"]["skipped"]
    assert skipped["rank"] == 1 and skipped["source"] == "rank1.json" and str(tmp_path) not in skipped["reason"]
    assert sorted(merged["metadata"]["tracefuse"]["ranks"]) == ["0", "2"]
    assert_perfetto_rules(merged)


@pytest.mark.parametrize("gz", [False, True], ids=["json", "gz"])
def test_repair_recovers_complete_events(gz, client, tmp_path):
    data = good(0, n=500)
    raw = cut(data)
    p = tmp_path / ("rank0.json.gz" if gz else "rank0.json")
    p.write_bytes(gzip.compress(data, mtime=0)[: int(len(gzip.compress(data, mtime=0)) * 0.6)] if gz else raw)
    out = tmp_path / "m.json"
    s = merge_traces([str(p)], str(out), client=client, repair=True)
    (note,) = [w for w in s.warnings if "repaired" in w]
    n = int(note.split("recovered ")[1].split(" ")[0])
    assert 0 < n < 500 and "the data ends at byte" in note
    xs = [e for e in load_exact(out)["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == n and [e["ts"] for e in xs] == [10.5 + k for k in range(n)]


def test_repair_assumes_the_job_base_when_it_was_after_the_cut(client, tmp_path):
    doc = make_trace(1, [dict(EV, ts=10.5 + k) for k in range(300)], world_size=2)
    base = doc.pop("baseTimeNanoseconds")
    doc["baseTimeNanoseconds"] = base  # Kineto's on-demand path writes keys after traceEvents
    write_trace(tmp_path / "rank0.json", make_trace(0, [EV], world_size=2))
    (tmp_path / "rank1.json").write_bytes(cut(orjson.dumps(doc)))
    s = merge_traces(str(tmp_path), str(tmp_path / "m.json"), client=client, repair=True)
    assert any("came after the cut; assumed the earliest base of the other ranks" in w for w in s.warnings)
    assert load_exact(tmp_path / "m.json")["baseTimeNanoseconds"] == base


@pytest.fixture
def job_with_a_cut_rank(tmp_path):
    """The real gloo_4ranks job with rank 3 cut at 60% of its text, as a job killed while it wrote its trace."""
    job = tmp_path / "job"
    job.mkdir()
    for r in range(4):
        data = gzip.decompress((shared("gloo_4ranks") / f"rank{r}.json.gz").read_bytes())
        (job / f"rank{r}.json").write_bytes(cut(data) if r == 3 else data)
    return job


def _reading(command, job, out):
    return {"analyze": ["analyze", str(job), "-o", str(out)], "info": ["info", str(job), "--json"],
            "diff": ["diff", str(job), str(job), "-o", str(out)]}[command]


@pytest.mark.parametrize("command", ["analyze", "info", "diff"])
def test_every_command_that_reads_traces_takes_the_repair_its_error_suggests(command, job_with_a_cut_rank, tmp_path,
                                                                             client, capsys):
    """One truncated rank of four: each command stops and says to pass --repair; --on-error skip goes on without
    the rank and lists it, --repair recovers its complete events and says so, as merge does."""
    out = tmp_path / "out"
    argv = [*_reading(command, job_with_a_cut_rank, out), "--scheduler", client.scheduler.address]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "rank3.json (rank 3)" in err and "pass --repair" in err and "Traceback" not in err, err
    assert not out.exists()

    assert main([*argv, "--on-error", "skip"]) == 0
    captured = capsys.readouterr()
    skipped = "skipped rank 3: " + str(job_with_a_cut_rank / "rank3.json (rank 3): not valid JSON")
    if command == "info":
        report = json.loads(captured.out)
        assert report["ranks"] == [0, 1, 2] and [sk["rank"] for sk in report["skipped"]] == [3]
        assert "truncated" in report["skipped"][0]["reason"]
    elif command == "analyze":
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ranks"] == [0, 1, 2] and [sk["rank"] for sk in summary["skipped"]] == [3]
        assert skipped in captured.err and "skipped rank 3: " in (out / "report.html").read_text()
    else:
        warnings = json.loads((out / "diff.json").read_text())["warnings"]
        assert [w.split(":")[0] for w in warnings if "skipped rank 3: " in w] == ["the base run", "the new run"]
        assert f"warning: the base run: {skipped}" in captured.err

    assert main([*argv, "--repair", "--force"] if command != "info" else [*argv, "--repair"]) == 0
    captured = capsys.readouterr()
    if command == "info":
        report = json.loads(captured.out)
        assert report["ranks"] == [0, 1, 2, 3] and not report["skipped"]
        (note,) = report["repaired"]
    elif command == "analyze":
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ranks"] == [0, 1, 2, 3] and not summary["skipped"]
        (note,) = summary["repaired"]
        assert f"warning: {note}" in captured.err
    else:
        notes = [w for w in json.loads((out / "diff.json").read_text())["warnings"] if "repaired" in w]
        assert len(notes) == 2
        note = notes[0].removeprefix("the base run: ")
    assert note.startswith(f"{job_with_a_cut_rank / 'rank3.json'} (rank 3): repaired a truncated trace")
    assert int(note.split("recovered ")[1].split(" ")[0].replace(",", "")) > 0


def test_disk_full_is_a_clear_error_and_leaves_nothing(client, tmp_path, capsys):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        inputs = tmp_path / "in"
        for r in range(2):
            write_trace(inputs / f"rank{r}.json", make_rank_trace(r, 2, target_bytes=1_000_000))
        code = main(["merge", str(inputs), "-o", str(small / "m.json"), "--scheduler", client.scheduler.address])
        err = capsys.readouterr().err
        assert code == 1 and "could not write it" in err and "free some space" in err and "Traceback" not in err
        assert list(small.iterdir()) == []
        with pytest.raises(OutputWriteError):
            merge_traces(str(inputs), str(small / "m.json"), client=client)
        assert isinstance(OutputWriteError("x"), OSError)
    finally:
        subprocess.run(["umount", str(small)])


def test_a_killed_worker_is_retried_and_the_output_is_identical(tmp_path):
    from tracefuse_dask.cluster import connect

    inputs = tmp_path / "in"
    for r in range(4):
        write_trace(inputs / f"rank{r}.json", make_rank_trace(r, 4, target_bytes=300_000))
    marker = tmp_path / "killed-once"

    def die_once(ev, marker=str(marker)):
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the worker process dies in the middle of a rank
        return True

    with connect(workers=2) as c:
        merge_traces(str(inputs), str(tmp_path / "faulty.json"), client=c, filter_fn=die_once)
        assert marker.exists()
        merge_traces(str(inputs), str(tmp_path / "clean.json"), client=c, filter_fn=die_once)
    assert (tmp_path / "faulty.json").read_bytes() == (tmp_path / "clean.json").read_bytes()


def test_worker_programs_log_no_storage_request_their_client_library_abandoned(client):
    """A storage killed mid-merge: a worker program's fsspec loop had asyncio log an aiohttp request abandoned under
    it ("Task exception was never retrieved", with its traceback) on the run's stderr, before the run's one error
    line (seen once in test_overlap's killed server). The workers' asyncio logger, as the command line's own, is
    silent below CRITICAL; the run's error says what happened."""
    import logging

    levels = client.run(lambda: logging.getLogger("asyncio").getEffectiveLevel())
    assert len(levels) == 2 and set(levels.values()) == {logging.CRITICAL}, levels


@pytest.mark.parametrize("workers", [["--workers", "1"], []], ids=["worker-program", "in-process"])
def test_sigterm_removes_temporaries_and_exits_nonzero(tmp_path, workers):
    inputs = tmp_path / "in"
    for r in range(8):
        write_trace(inputs / f"rank{r}.json", make_rank_trace(r, 8, target_bytes=4_000_000))
    out = tmp_path / "out" / "m.json"
    out.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tracefuse_dask", "merge", str(inputs), "-o", str(out), *workers],
                            stderr=subprocess.PIPE, text=True)
    tmp = Path(str(out) + ".tracefuse-tmp")
    deadline = time.monotonic() + 60
    # mid-merge: once a task has written (the run's lease and folder exist before its cluster starts)
    while not any(tmp.glob("*/*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any(tmp.glob("*/*")), "the merge finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert list(out.parent.iterdir()) == []
    # and a rerun works without any manual cleanup
    assert main(["merge", str(inputs), "-o", str(out), "--workers", "1", "-q"]) == 0


def test_rerun_after_a_crash_cleans_stale_temporaries(client, tmp_path):
    write_trace(tmp_path / "in" / "rank0.json", good(0))
    stale = tmp_path / "m.json.tracefuse-tmp"
    stale.mkdir()
    (stale / "part-00000000.json").write_text("half a part")
    merge_traces(str(tmp_path / "in"), str(tmp_path / "m.json"), client=client)
    assert not stale.exists() and load_exact(tmp_path / "m.json")["traceEvents"]


def test_errors_are_typed_and_subclass_builtins(client, tmp_path):
    (tmp_path / "rank0.json").write_bytes(b"[1, 2]")
    with pytest.raises(TraceFormatError) as e:
        merge_traces([str(tmp_path / "rank0.json")], str(tmp_path / "o.json"), client=client)
    assert isinstance(e.value, ValueError) and "rank0.json" in str(e.value)
    with pytest.raises(FileNotFoundError):
        merge_traces([str(tmp_path / "nope.json")], str(tmp_path / "o.json"), client=client)


def test_real_traces_merge_with_debug_off_and_no_tracebacks(client, tmp_path, capsys):
    (path,) = shared("real", "hta_amd_trace").iterdir()
    assert main(["merge", str(path), "-o", str(tmp_path / "m.json"),
                 "--scheduler", client.scheduler.address]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_filter_the_workers_cannot_import_is_a_clear_error_not_a_hang(tmp_path):
    """Pickled by reference to a module on the client's path only: once, the workers could not read the task
    and the merge waited forever."""
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "hidden_filter.py").write_text("def keep_all(event):\n    return True\n")
    inputs = tmp_path / "in"
    for r in range(2):
        write_trace(inputs / f"rank{r}.json", make_rank_trace(r, 2, target_bytes=100_000))
    out = tmp_path / "out" / "m.json"
    out.parent.mkdir()
    code = ("import sys\nfrom tracefuse_dask import merge_traces\nfrom tracefuse_dask.cluster import connect\n"
            "with connect(workers=1) as c:\n"
            f"    sys.path.insert(0, {str(tmp_path / 'hidden')!r})\n"
            "    from hidden_filter import keep_all\n"
            "    try:\n"
            f"        merge_traces({str(inputs)!r}, {str(out)!r}, client=c, filter_fn=keep_all)\n"
            "    except Exception as e:\n"
            "        print(type(e).__name__, e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("MergeError filter_fn keep_all cannot be loaded in a Dask worker (ModuleNotFoundError")
    assert "importable on every worker" in done.stdout
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("command", ["analyze", "info"])
def test_skipping_every_rank_is_an_error_that_gives_the_first_reason(command, tmp_path, client, capsys):
    (tmp_path / "job").mkdir()
    for r in (0, 1):
        (tmp_path / "job" / f"rank{r}.json").write_bytes(cut(good(r)))
    argv = [*_reading(command, tmp_path / "job", tmp_path / "out"), "--on-error", "skip",
            "--scheduler", client.scheduler.address]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: every rank failed; the first: " in err and "rank0.json (rank 0)" in err and "(and 1 more)" in err
    assert not (tmp_path / "out").exists()
