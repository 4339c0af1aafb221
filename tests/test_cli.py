from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from conftest import make_trace, shared, write_trace
from perfetto_rules import assert_perfetto_rules, load_exact
from tracefuse_dask import __version__
from tracefuse_dask.cli import _parser, main


def test_every_command_and_option_has_help():
    parser = _parser()
    for action in parser._subparsers._group_actions[0].choices.values():
        for opt in action._actions:
            if opt.dest not in ("help",):
                assert opt.help, f"{action.prog} {opt.dest} has no help"


def test_the_workers_option_says_what_each_command_runs_in_this_process():
    """merge and info run small inputs in this process, analyze too unless it writes the critical-path trace; diff
    starts its cluster's worker programs whatever the sides' size."""
    commands = _parser()._subparsers._group_actions[0].choices
    helps = {name: next(a.help for a in p._actions if a.dest == "workers") for name, p in commands.items()
             if name in ("merge", "analyze", "diff", "info")}
    assert "--critical-path-trace" in helps["analyze"]
    assert not any("--critical-path-trace" in helps[name] for name in ("merge", "info", "diff"))
    assert "this process" not in helps["diff"] and "this process" in helps["merge"]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tracefuse {__version__}"


@pytest.mark.integration
def test_merge_cli_prints_summary_json(tmp_path, capsys, client):
    out = tmp_path / "merged.json.gz"
    code = main(["merge", str(shared("gloo_2ranks_tb_nostraggler")), "-o", str(out), "--summary-json",
                 "--scheduler", client.scheduler.address, "--include-pyfunc", "--keep", "cpu,comm"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["status"] == "ok" and summary["ranks"] == 2 and summary["output"] == str(out)
    assert set(summary) >= {"ranks", "skipped", "events_in", "events_out", "bytes_out", "seconds", "mb_per_s"}
    assert "merged 2 ranks" in captured.err
    assert_perfetto_rules(load_exact(out))


@pytest.mark.integration
def test_info_json(capsys, client):
    assert main(["info", str(shared("gloo_4ranks")), "--json", "--scheduler", client.scheduler.address]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == [0, 1, 2, 3] and report["world_size"] == 4
    assert report["per_rank"][2]["flows"]["ids"] == 20 and report["categories"]["cpu_op"] > 0
    assert any("generation_info.json" in s for s in report["ignored"])


@pytest.mark.integration
def test_info_table(capsys, client):
    assert main(["info", str(shared("real", "hta_trace_filter")), "--scheduler", client.scheduler.address]) == 0
    out = capsys.readouterr().out
    assert "2 files, ranks [0, 1], world size 128" in out


@pytest.mark.integration
def test_info_gives_the_rank_merge_would_use(tmp_path, capsys, client):
    """A bad distributedInfo.rank gives way to the file's name, as in merge; a file nothing gives a rank is '?'."""
    ev = {"ph": "X", "cat": "cpu_op", "name": "a", "pid": 7, "tid": 7, "ts": 1.0, "dur": 1.0}
    doc = make_trace(None, [ev])
    write_trace(tmp_path / "job" / "rank5.json", {**doc, "distributedInfo": {"rank": -1, "world_size": 8}})
    write_trace(tmp_path / "job" / "trace.json", doc)
    assert main(["info", str(tmp_path / "job"), "--json", "--scheduler", client.scheduler.address]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["world_size"]) for r in report["per_rank"]] == [(5, 8), (None, None)]
    assert main(["info", str(tmp_path / "job"), "--scheduler", client.scheduler.address]) == 0
    assert "    ?" in capsys.readouterr().out


@pytest.mark.integration
def test_info_of_a_merged_trace_describes_each_rank(tmp_path, capsys, client):
    folder = shared("real", "hta_trace_filter")
    assert main(["info", str(folder), "--json", "--scheduler", client.scheduler.address]) == 0
    inputs = json.loads(capsys.readouterr().out)
    merged = tmp_path / "merged.json.gz"
    assert main(["merge", str(folder), "-o", str(merged), "--scheduler", client.scheduler.address, "-q"]) == 0
    capsys.readouterr()
    assert main(["info", str(merged), "--json", "--scheduler", client.scheduler.address]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == 1 and report["ranks"] == [0, 1] and report["world_size"] == 128
    assert report["bytes"] == merged.stat().st_size and report["span_ms"] == inputs["span_ms"]
    for before, after in zip(inputs["per_rank"], report["per_rank"]):
        assert after["source"] == before["path"].rsplit("/", 1)[1] and after["path"] == str(merged)
        assert after["bytes"] is None  # a merged rank has no size of its own; the file's is in the total
        assert after["categories"] == before["categories"]  # the rank's own events, and only those
        assert after["end_ns"] - after["start_ns"] == before["end_ns"] - before["start_ns"]
    assert main(["info", str(merged), "--scheduler", client.scheduler.address]) == 0
    assert "(from sampled_rank-1.json.gz)" in capsys.readouterr().out
    # in a folder beside the per-rank files it merged, it is skipped, as merge skips it
    job = tmp_path / "job"
    job.mkdir()
    for f in [*folder.iterdir(), merged]:
        (job / f.name).write_bytes(f.read_bytes())
    assert main(["info", str(job), "--json", "--scheduler", client.scheduler.address]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["ranks"] == [0, 1] and listed["files"] == 2
    assert [s for s in listed["ignored"] if "merged.json.gz" in s]


@pytest.mark.integration
def test_a_reader_that_goes_away_stops_the_output_quietly():
    """`tracefuse info … | head -1`: once the reader has gone, no error message and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "tracefuse_dask", "info", str(shared("gloo_4ranks")),
                             "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "error" not in err and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize(
    "argv, code, message",
    [
        pytest.param(["merge", "x.json"], 2, "-o/--output", id="no-output"),
        pytest.param(["merge", "x.json", "-o", "o.json", "--storage-options", "{bad"], 2, "not valid JSON",
                     id="bad-storage-options"),
        pytest.param(["merge", "missing.json", "-o", "o.json"], 1,
                     "error: missing.json: no such file or object; check the path\n", id="missing-file"),
        pytest.param(["merge", "missing.json", "-o", "o.json", "--ranks", "5-1"], 2,
                     "tracefuse merge: error: argument --ranks: bad rank spec '5-1'", id="bad-ranks"),
        pytest.param(["merge", "missing.json", "-o", "o.json", "--keep", "gpu,disk"], 2,
                     "tracefuse merge: error: argument --keep: unknown --keep preset(s) disk", id="bad-keep"),
        pytest.param(["merge", "missing.json", "-o", "o.json", "--steps", "5-1"], 2,
                     "tracefuse merge: error: argument --steps: bad step range '5-1'", id="bad-steps"),
        pytest.param(["merge", "missing.json", "-o", "o.json", "--rank-regex", "(", "--workers", "2"], 2,
                     "tracefuse merge: error: argument --rank-regex: '(' is not a regular expression (missing ), "
                     "unterminated subpattern at position 0); give one with a named group 'rank'", id="bad-rank-regex"),
        pytest.param(["merge", "missing.json", "-o", "o.json", "--window", "9:1"], 2,
                     "tracefuse merge: error: argument --window: bad window '9:1'", id="bad-window"),
        pytest.param(["analyze", "missing.json", "-o", "o.json", "--runtime-cutoff", "-5"], 2,
                     "tracefuse analyze: error: argument --runtime-cutoff: -5 is not above 0; give a positive number",
                     id="bad-cutoff"),
        pytest.param(["analyze", "missing.json", "-o", "o.json", "--max-queue-length", "many"], 2,
                     "tracefuse analyze: error: argument --max-queue-length: 'many' is not a number",
                     id="bad-queue-length"),
        pytest.param(["analyze", "x.json", "-o", "o.json", "--counters"], 2,
                     "tracefuse analyze: error: --counters adds counter tracks", id="counters-alone"),
        pytest.param(["analyze", "x.json", "-o", "o.json", "--storage-options", "{bad"], 2,
                     "tracefuse analyze: error: --storage-options is not valid JSON", id="analyze-storage-options"),
        pytest.param(["merge", "x.json", "-o", "o.json", "--scheduler", "tcp://127.0.0.1:9", "--timeout", "1"], 1,
                     "could not connect to the Dask scheduler at tcp://127.0.0.1:9", id="no-scheduler"),
    ],
)
def test_errors_exit_cleanly_without_traceback(argv, code, message, tmp_path, monkeypatch, capsys):
    """One convention: 2 and the command's own usage for what the command line says wrong (argparse's own errors,
    a bad option value, options that do not go together), 1 and ``error: …`` for what the inputs or the storage
    say wrong."""
    monkeypatch.chdir(tmp_path)
    if "x.json" in argv:
        write_trace(tmp_path / "x.json", make_trace(0, []))
    assert main(argv) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    if code == 2:
        assert err.startswith(f"usage: tracefuse {argv[0]} "), err
    assert not (tmp_path / "o.json").exists()


@pytest.mark.integration
def test_an_existing_output_names_the_fix_as_the_command_line_spells_it(tmp_path, capsys):
    """The command line says --force, the API force=True, each only its own spelling."""
    from tracefuse_dask import OutputExistsError, merge_traces

    write_trace(tmp_path / "rank0.json", make_trace(0, []))
    (tmp_path / "o.json").write_text("{}")
    assert main(["merge", str(tmp_path / "rank0.json"), "-o", str(tmp_path / "o.json")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'o.json'}: the output exists; pass --force to replace it\n"
    with pytest.raises(OutputExistsError) as raised:
        merge_traces(str(tmp_path / "rank0.json"), str(tmp_path / "o.json"), workers=1)
    assert str(raised.value).endswith("the output exists; pass force=True to replace it")
    back = pickle.loads(pickle.dumps(raised.value))  # as it comes back from a worker
    assert str(back) == str(raised.value) and back.for_cli().endswith("pass --force to replace it")


@pytest.mark.integration
@pytest.mark.parametrize("spec, message", [
    (None, 'cannot read the file (No such file or directory); give the path of a JSON device table'),
    ('{"devices": [', 'not JSON (line 1, column 14: Expecting value); give {"devices": '),
    ("[]", 'not a device table: it has no "devices" list at its top; give {"devices": '),
    ('{"devices": [{"name": "mine"}]}', 'not a device table: device 1 of 1 (mine) has no "memory_tb_s"; give '),
    ('{"devices": [{"name": "mine", "memory_tb_s": "fast"}]}',
     'not a device table: device 1 of 1 (mine): "matrix" and "vector" map precisions to TFLOPS and "memory_tb_s" '
     'is a number'),
], ids=["missing", "not-json", "no-devices", "no-bandwidth", "bad-number"])
def test_a_bad_gpu_spec_says_what_is_wrong_with_the_file(spec, message, tmp_path, capsys):
    """Each way a --gpu-spec file can be wrong gets its own one-line error, naming the file (no ``KeyError``, no
    "cannot read it as JSON" for a file that is not there), before any output."""
    write_trace(tmp_path / "rank0.json", make_trace(0, []))
    path = tmp_path / "gpus.json"
    if spec is not None:
        path.write_text(spec)
    assert main(["analyze", str(tmp_path / "rank0.json"), "-o", str(tmp_path / "rep"), "--gpu-spec", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(path) in err and message in err, err
    assert err.count("\n") == 1 and "Error:" not in err and "Traceback" not in err
    assert not (tmp_path / "rep").exists()


@pytest.mark.integration
def test_analyze_counts_one_rank_and_one_step_in_the_singular(tmp_path, capsys):
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 10}]
    write_trace(tmp_path / "rank0.json", make_trace(0, events))
    assert main(["analyze", str(tmp_path / "rank0.json"), "-o", str(tmp_path / "rep")]) == 0
    assert "analysed 1 rank, 1 step in " in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "tracefuse_dask", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "merge" in done.stdout and "info" in done.stdout


@pytest.mark.integration
def test_performance_report_and_quiet(tmp_path, capsys):
    report = tmp_path / "perf.html"
    out = tmp_path / "m.json"
    assert main(["merge", str(shared("gloo_4ranks")), "-o", str(out), "-q", "--workers", "1",
                 "--performance-report", str(report)]) == 0
    assert capsys.readouterr().err == ""
    assert report.read_text().lstrip().lower().startswith("<!doctype html") or "<html" in report.read_text()


def test_the_package_and_version_load_no_dask_nor_pandas():
    """``tracefuse --version`` and ``import tracefuse_dask`` stay quick: Dask, pandas and fsspec load with the API
    (fsspec alone took ``--version`` from 0.17 to 0.33 s)."""
    code = ("import sys, tracefuse_dask; from tracefuse_dask.cli import main; main(['--version']); "
            "print(sorted(m for m in ('dask', 'distributed', 'pandas', 'fsspec') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"
    code = "import tracefuse_dask as t; print(t.TraceFuse.__name__, t.merge_traces.__name__, t.analyze.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["TraceFuse", "merge_traces", "analyze"]


def test_the_merge_api_loads_no_pandas():
    """A merge never needs pandas (0.5 s of a command line's start), nor does ``info``: the analysis loads it when
    first asked."""
    code = ("import sys; from tracefuse_dask import TraceFuse, merge_traces; assert 'pandas' not in sys.modules; "
            "from tracefuse_dask.api import analyze, describe_traces; print('pandas' in sys.modules, analyze.__module__,"
            " describe_traces.__module__); from tracefuse_dask import Analysis; print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "tracefuse_dask.api", "tracefuse_dask.info", "True"]


def test_a_quiet_merge_from_a_fresh_process_prints_nothing(tmp_path):
    write_trace(tmp_path / "in" / "rank0.json", make_trace(0, [{"ph": "X", "name": "a", "pid": 1, "tid": 1,
                                                                 "ts": 1.0, "dur": 1.0}]))
    proc = subprocess.run([sys.executable, "-m", "tracefuse_dask", "merge", str(tmp_path / "in"), "-o",
                           str(tmp_path / "m.json"), "-q", "--workers", "1"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == ""
