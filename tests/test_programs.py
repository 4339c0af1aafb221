"""The embedded cluster's worker programs started ahead (``tracefuse_dask.programs``): the command line starts them
as soon as it knows it will need them, the cluster takes them as it starts, and those it does not take are stopped.
Real programs, a real cluster and the real command line."""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import dask
import pytest

from tracefuse_dask import cli, programs
from tracefuse_dask.cli_options import build_parser
from tracefuse_dask.cluster import connect
from tracefuse_dask.programs import SMALL_INPUT_BYTES
from tracefuse_dask.store import MANIFEST
from tracefuse_dask.synth import write_example

pytestmark = pytest.mark.integration


@pytest.fixture
def started(monkeypatch):
    """The modules of every worker program started (one tuple each, ``()`` for one the cluster started itself),
    each program in ``started.programs``; the programs still ahead are stopped after the test."""
    seen = _Started()
    real = programs._program

    def spy(modules, env):
        seen.append(tuple(modules))
        seen.programs.append(real(modules, env))
        return seen.programs[-1]

    monkeypatch.setattr(programs, "_program", spy)
    yield seen
    programs.stop_ahead()


class _Started(list):
    programs: list

    def __init__(self) -> None:
        super().__init__()
        self.programs = []


def test_the_cluster_takes_the_programs_started_ahead_and_stops_the_rest(started):
    programs.start_ahead(2, ["json"])
    first, second = (p for p, _ in programs._ahead)
    with connect(workers=1) as c:
        assert set(c.run(os.getpid).values()) == {first.pid}
        # the job's config (no profiler), and the quiet logs from its start (DASK_LOGGING__*)
        assert list(c.run(lambda: (dask.config.get("distributed.worker.profile.enabled"),
                                   logging.getLogger("distributed").getEffectiveLevel())).values()) == [
            (False, logging.CRITICAL)]
        assert second.poll() is not None and not programs._ahead
    assert started == [("json",), ("json",)]


def test_a_program_started_in_another_environment_is_not_taken(started, monkeypatch):
    """A variable set after the programs started (a caller's own) reaches the workers: the cluster starts its own."""
    programs.start_ahead(1)
    ahead = programs._ahead[0][0]
    monkeypatch.setenv("TRACEFUSE_TEST_SET_LATER", "yes")
    with connect(workers=1) as c:
        assert list(c.run(lambda: os.environ.get("TRACEFUSE_TEST_SET_LATER")).values()) == ["yes"]
        assert ahead.poll() is not None
    assert started == [(), ()]


def test_a_program_the_cluster_starts_has_the_callers_config_from_its_start(started):
    """What Dask reads as it is imported (here the offload threshold) comes from the caller's ``dask.config.set``."""
    with dask.config.set({"distributed.comm.offload": "1MiB"}), connect(workers=1) as c:
        import distributed.comm.utils

        assert list(c.run(lambda: distributed.comm.utils.OFFLOAD_THRESHOLD).values()) == [2**20]


def test_a_ctrl_c_at_the_terminal_is_left_to_the_command(started):
    """A program waiting for its job ignores SIGINT, which the terminal sends its whole process group: the command
    stops it (no traceback of its own)."""
    programs.start_ahead(1)
    ahead = programs._ahead[0][0]
    end = time.monotonic() + 30
    while not _ignores_sigint(ahead.pid) and time.monotonic() < end:  # the program's first lines have run
        time.sleep(0.01)
    ahead.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert ahead.poll() is None
    programs.stop_ahead()
    assert ahead.poll() is not None


def _ignores_sigint(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(status.split("SigIgn:")[1].split()[0], 16) & (1 << (signal.SIGINT - 1)))


def test_a_cluster_that_takes_none_stops_them(started):
    programs.start_ahead(1)
    ahead = programs._ahead[0][0]
    with connect(workers=1, in_process=True) as c:
        assert set(c.run(os.getpid).values()) == {os.getpid()}
        assert ahead.poll() is not None and not programs._ahead


@pytest.mark.parametrize("command, modules", [
    ("merge", ("tracefuse_dask.merge.plan", "tracefuse_dask.merge.tasks")),
    ("analyze", ("tracefuse_dask.analysis.tasks",)),
])
def test_the_command_line_runs_its_tasks_on_programs_it_started_ahead(started, tmp_path, command, modules):
    """With ``--workers 2`` the command starts two programs, which import its tasks' modules, before it imports
    the rest; the cluster runs on those two, and starts none."""
    write_example(str(tmp_path / "in"), ranks=2, rank_bytes=200_000)
    out = str(tmp_path / ("merged.json" if command == "merge" else "report"))
    assert cli.main([command, str(tmp_path / "in"), "-o", out, "--workers", "2", "-q"]) == 0
    assert started == [modules, modules]


@pytest.mark.parametrize("argv, ahead", [
    pytest.param(["analyze", "{small}", "-o", "out"], 0, id="small-input-runs-in-threads"),
    pytest.param(["analyze", "{big}", "-o", "out"], os.cpu_count(), id="big-local-input"),
    pytest.param(["merge", "{big}", "-o", "m.json", "--ranks", "1"], 0, id="the-ranks-asked-are-small"),
    pytest.param(["merge", "{big}", "-o", "m.json", "--workers", "3"], 3, id="workers-given"),
    pytest.param(["analyze", "s3://bucket/job", "-o", "out"], 0, id="object-storage-listed-once"),
    pytest.param(["analyze", "{big}", "-o", "out", "--skip-if-unchanged"], 0, id="skip-if-unchanged"),
    pytest.param(["index", "{big}", "-o", "store", "--scheduler", "tcp://127.0.0.1:1"], 0, id="a-cluster-to-join"),
    pytest.param(["analyze", "{missing}", "-o", "out"], 0, id="missing-input-left-to-the-command"),
    pytest.param(["merge", "{big}", "-o", "memory://m.json", "--workers", "2"], 0, id="memory-paths-run-in-threads"),
])
def test_the_command_line_starts_programs_ahead_only_when_the_command_will_start_them(started, tmp_path, argv, ahead):
    """The choice is ``connect``'s own (``programs.worker_programs``), on the inputs listed as the command lists
    them: a file over ``SMALL_INPUT_BYTES`` (sparse: nothing is read) starts one a core."""
    (tmp_path / "big").mkdir()
    with open(tmp_path / "big" / "rank0.json", "wb") as f:
        f.truncate(SMALL_INPUT_BYTES)
    (tmp_path / "big" / "rank1.json").write_bytes(b"{}")
    write_example(str(tmp_path / "small"), ranks=2, rank_bytes=10_000)
    places = {k: str(tmp_path / k) for k in ("big", "small", "missing")}
    cli._start_workers_ahead(build_parser().parse_args([a.format(**places) for a in argv]))
    assert len(programs._ahead) == ahead
    assert len(started) == ahead


@pytest.mark.parametrize("env, config, ahead, imports", [
    pytest.param({}, None, True, [], id="dask-s-defaults"),
    pytest.param({}, "scheduler-address: tcp://127.0.0.1:1", False, ["dask"], id="a-config-file-names-a-scheduler"),
    pytest.param({}, "distributed: {}", True, ["dask"], id="a-config-file-names-none"),
    pytest.param({"DASK_Scheduler_Address": "tcp://127.0.0.1:1"}, None, False, ["dask"], id="the-environment-names-one"),
    pytest.param({"DASK_SCHEDULER_ADDRESS": "None"}, "scheduler-address: tcp://127.0.0.1:1", True, ["dask"],
                 id="the-environment-overrides-the-file"),
])
def test_the_head_start_does_not_wait_for_dask_s_import(tmp_path, env, config, ahead, imports):
    """The command starts its programs before it imports Dask or numpy (0.13-0.26 s and 0.06 s of its start on 2
    cores) where Dask's config is its defaults: no Dask variable that could name a scheduler, no config file. Where
    there is one, the head start reads the config as Dask does, and starts none for a cluster to join. Each case in
    a fresh interpreter, with a home and Dask folders of its own."""
    import subprocess
    import sys

    with open(tmp_path / "rank0.json", "wb") as f:
        f.truncate(SMALL_INPUT_BYTES + 1)  # one a core, unless a cluster is to be joined
    folder = tmp_path / "dask-config"
    if config is not None:
        folder.mkdir()
        (folder / "scheduler.yaml").write_text(config)
    args = ["analyze", str(tmp_path), "-o", str(tmp_path / "out")]
    code = ("import sys; from tracefuse_dask import cli, programs; from tracefuse_dask.cli_options import build_parser; "
            f"cli._start_workers_ahead(build_parser().parse_args({args!r})); n = len(programs._ahead); "
            "programs.stop_ahead(); seen = sorted({m.split('.')[0] for m in sys.modules} & {'dask', 'distributed', "
            "'numpy', 'pandas'}); import dask.config; "
            "print(n, seen, set(dask.config.paths) == set(programs._dask_config_folders()))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    run_env = {**clean, "HOME": str(tmp_path / "home"), "DASK_ROOT_CONFIG": str(tmp_path / "etc-dask"),
               "DASK_CONFIG": str(folder), **env}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=run_env)
    assert got.stdout.split(" ", 1) == [str(os.cpu_count() if ahead else 0), f"{imports} True\n"], got.stderr


def test_a_cluster_to_join_stops_the_programs_started_ahead(started):
    """Programs started ahead for a cluster that a Dask config set in the process names (which the head start
    of the command line does not read) are stopped by ``connect`` as it joins that cluster."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as lc:
        programs.start_ahead(2)
        with dask.config.set({"scheduler-address": lc.scheduler_address}), connect() as c:
            assert c.scheduler.address == lc.scheduler_address
            assert not programs._ahead and all(p.poll() is not None for p in started.programs)


def test_an_event_store_given_to_analyze_counts_as_the_traces_it_was_indexed_from(started, tmp_path):
    """``analyze STORE`` decides as ``analyze`` does on a store: by the sizes of the files it was indexed from, in
    its manifest, of the ranks asked. A store of small traces runs in threads; one of big traces starts one program
    a core ahead, which imports the store's reader too, and the analysis runs on those and starts none."""
    write_example(str(tmp_path / "in"), ranks=2, rank_bytes=200_000)
    store = tmp_path / "store"
    assert cli.main(["index", str(tmp_path / "in"), "-o", str(store), "-q"]) == 0
    assert cli.main(["analyze", str(store), "-o", str(tmp_path / "small"), "-q"]) == 0
    assert started == []
    manifest = json.loads((store / MANIFEST).read_text())
    rank1 = next(r["file"] for r in manifest["ranks"] if r["rank"] == 1)
    for identity in manifest["made_from"]["inputs"]:  # as if rank 1 were indexed from a trace of SMALL_INPUT_BYTES
        identity["size"] = SMALL_INPUT_BYTES if identity["path"] == rank1 else identity["size"]
    (store / MANIFEST).write_text(json.dumps(manifest))
    assert cli.main(["analyze", str(store), "-o", str(tmp_path / "rank0"), "--ranks", "0", "-q"]) == 0
    assert started == []
    assert cli.main(["analyze", str(store), "-o", str(tmp_path / "big"), "-q"]) == 0
    assert started == [("tracefuse_dask.analysis.tasks", "tracefuse_dask.store.source", "duckdb")] * os.cpu_count()


def test_a_command_that_fails_before_its_cluster_stops_the_programs_it_started(started, tmp_path, capsys):
    """In a process that goes on (a notebook's ``cli.main``), and with one error line, as before."""
    (tmp_path / "big").mkdir()
    with open(tmp_path / "big" / "rank0.json", "wb") as f:
        f.truncate(SMALL_INPUT_BYTES + 1)
    (tmp_path / "out.json").write_bytes(b"{}")
    places = {"big": str(tmp_path / "big"), "out": str(tmp_path / "out.json")}
    assert cli.main(["merge", places["big"], "-o", places["out"], "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert "exists" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not programs._ahead and all(p.poll() is not None for p in started.programs)
