"""The merge's account of every event it read (issue 48): ``read = kept + every reason for leaving out``,
exactly, per rank and in total, on both rewrite paths; in ``--summary-json`` and on stderr.

The counts are held to the inputs and the output, read here apart from the code under test.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from conftest import (
    REAL_SETS,
    make_trace,
    read_trace,
    shared,
    shared_params,
    write_trace,
)
from perfetto_rules import LANE, lane_owners, load_exact

from tracefuse_dask import merge_traces
from tracefuse_dask.model import LEFT_OUT

PROCESS_M = ("process_name", "process_labels", "process_sort_index")


def added_by_the_merge(merged: dict[str, Any]) -> int:
    """The output's events that no input holds: the merge's process names and sort indices, and in processes with
    lanes the lanes' names and every thread's sort index."""
    events = merged["traceEvents"]
    laned = {pid for pid, _ in lane_owners(events)}
    return sum(1 for e in events if e["ph"] == "M" and (
        e["name"] in PROCESS_M or (e["name"] == "thread_name" and LANE.match(e["args"]["name"]))
        or (e["name"] == "thread_sort_index" and e["pid"] in laned)))


def assert_adds_up(account: dict[str, Any], merged: dict[str, Any]) -> None:
    assert account["read"] == account["kept"] + sum(account["left_out"].values())
    assert account["written"] == account["kept"] + account["added"] == len(merged["traceEvents"])
    assert account["added"] == added_by_the_merge(merged)
    assert list(account["left_out"]) == [k for k in LEFT_OUT if k in account["left_out"]]
    per_rank = account["ranks"].values()
    for key in ("read", "kept", "added", "written", "on_lanes"):
        assert account[key] == sum(r[key] for r in per_rank), key
    assert Counter(account["left_out"]) == sum((Counter(r["left_out"]) for r in per_rank), Counter())


@pytest.mark.integration
@pytest.mark.parametrize("include_pyfunc", [False, True], ids=["default", "pyfunc"])
@pytest.mark.parametrize("name", shared_params([f"real/{s}" for s in REAL_SETS] + ["gloo_4ranks"]))
def test_the_account_adds_up_on_every_shared_set(name, include_pyfunc, client, tmp_path):
    folder = shared(*name.split("/"))
    out = tmp_path / "out.json"
    summary = merge_traces(str(folder), str(out), client=client, include_pyfunc=include_pyfunc)
    merged = load_exact(out)
    account = summary.account
    assert_adds_up(account, merged)
    inputs = [read_trace(folder / m["source"])["traceEvents"]
              for m in merged["metadata"]["tracefuse"]["ranks"].values()]
    events = [e for doc in inputs for e in doc]
    assert account["read"] == len(events) == summary.events_in
    pyfunc = sum(e.get("cat") == "python_function" for e in events)
    assert account["left_out"].get("python_function", 0) == (0 if include_pyfunc else pyfunc)
    process_m = sum(e["ph"] == "M" and e.get("name") in PROCESS_M and
                    (include_pyfunc or e.get("cat") != "python_function") for e in events)
    assert account["left_out"].get("process_metadata", 0) == process_m
    assert account["on_lanes"] == summary.on_lanes
    assert set(account["left_out"]) <= {"python_function", "process_metadata", "thread_metadata"}


def rank_trace() -> dict[str, Any]:
    """Steps 1 and 2, each an op that launches a kernel (ac2g flow), a python_function, Kineto's process
    metadata, a thread named twice and the metadata of a process with no events."""
    ev: list[dict[str, Any]] = []
    for step, t in ((1, 100), (2, 1000)):
        corr = step
        ev += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 9, "tid": 9, "ts": t,
                "dur": 800},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": t + 10, "dur": 100},
               {"ph": "X", "cat": "python_function", "name": "forward", "pid": 9, "tid": 9, "ts": t + 5, "dur": 200},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": t + 20,
                "dur": 10, "args": {"correlation": corr}},
               {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": corr, "pid": 9, "tid": 9, "ts": t + 20},
               {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": t + 40, "dur": 50,
                "args": {"correlation": corr, "stream": 7}},
               {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": corr, "pid": 0, "tid": 7, "ts": t + 40, "bp": "e"}]
    ev += [{"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "python"}},
           {"ph": "M", "name": "process_sort_index", "pid": 9, "args": {"sort_index": 9}},
           {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
           {"ph": "M", "name": "thread_name", "pid": 9, "tid": 9, "args": {"name": "main"}},
           {"ph": "M", "name": "thread_name", "pid": 9, "tid": 9, "args": {"name": "main again"}},
           {"ph": "M", "name": "thread_name", "pid": 3, "tid": 3, "args": {"name": "GPU 3's only thread"}},
           {"ph": "M", "name": "process_labels", "pid": 3, "args": {"labels": "GPU 3"}}]
    return make_trace(0, ev)


@pytest.mark.parametrize("options, left_out", [
    pytest.param({}, {"python_function": 2, "process_metadata": 4, "thread_metadata": 2}, id="default"),
    pytest.param({"include_pyfunc": True}, {"process_metadata": 4, "thread_metadata": 2}, id="include_pyfunc"),
    # --keep gpu: the host ops and the launch go, and with them both flows (an end left out each), and the host
    # process's thread name (its process shows no event)
    pytest.param({"keep": "gpu"}, {"python_function": 2, "keep": 6, "flow_end_left_out": 4,
                                   "process_metadata": 4, "thread_metadata": 3}, id="keep-gpu"),
    # step 2 only: step 1's four host events and its kernel (by its launch's step), and its two flow events
    pytest.param({"steps": "2-2"}, {"python_function": 2, "steps": 4, "flow_end_left_out": 2,
                                    "process_metadata": 4, "thread_metadata": 2}, id="steps"),
    pytest.param({"filter_fn": lambda ev: ev.get("name") != "aten::mm"},
                 {"python_function": 2, "filter_fn": 2, "process_metadata": 4, "thread_metadata": 2},
                 id="filter_fn"),
])
def test_each_reason_counts_what_it_left_out(tmp_path, options, left_out):
    src = write_trace(tmp_path / "in" / "rank0.json", rank_trace())
    summary = merge_traces(str(src), str(tmp_path / "out.json"), **options)
    merged = load_exact(tmp_path / "out.json")
    assert summary.account["left_out"] == left_out
    assert summary.account["read"] == len(rank_trace()["traceEvents"])
    assert_adds_up(summary.account, merged)


def test_a_window_and_the_general_path_count_alike(tmp_path):
    """--window leaves out what starts outside it (here step 1's events); the fast path (no filter) and the general
    path (a filter that keeps all) count the same reasons."""
    src = write_trace(tmp_path / "in" / "rank0.json", rank_trace())
    window = merge_traces(str(src), str(tmp_path / "w.json"), window="0.8:5")
    assert window.account["left_out"]["window"] == 4 and window.account["left_out"]["flow_end_left_out"] == 2
    assert_adds_up(window.account, load_exact(tmp_path / "w.json"))
    fast = merge_traces(str(src), str(tmp_path / "fast.json"))
    general = merge_traces(str(src), str(tmp_path / "general.json"), filter_fn=lambda ev: True)
    assert fast.account == general.account


def test_a_merge_that_keeps_nothing_says_so(tmp_path):
    src = write_trace(tmp_path / "in" / "rank0.json", rank_trace())
    summary = merge_traces(str(src), str(tmp_path / "out.json"), steps="7-9")
    assert summary.account["kept"] == 0
    assert ("every one of the 21 events read was left out (the account says by what): check --keep, --steps, "
            "--window or filter_fn against the traces") in summary.warnings


def test_the_cli_prints_the_account_and_its_table(tmp_path):
    src = write_trace(tmp_path / "in" / "rank0.json", rank_trace())

    def run(*extra: str) -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, "-m", "tracefuse_dask", "merge", str(src), "-o", str(tmp_path / "o.json"),
                            "--force", "--keep", "gpu", *extra], capture_output=True, text=True, timeout=300,
                           check=False)
        assert p.returncode == 0, p.stderr
        return p

    line = ("account: 21 events read = 2 kept + 2 python_function + 6 --keep + 4 flows with an end left out + "
            "4 process metadata + 3 thread metadata")
    assert line in run().stderr.splitlines()
    table = run("-v").stderr
    assert f"{line}\n  21  read\n   2  kept\n   2  python_function events (--include-pyfunc keeps them)\n" in table
    assert "   4  flow events whose other end was left out\n" in table
    summary = json.loads(run("--summary-json").stdout)
    assert summary["account"]["ranks"]["0"]["left_out"]["keep"] == 6
    assert summary["account"]["kept"] == 2


def test_ranks_left_unread_by_ranks_are_counted_where_the_job_says_its_size(tmp_path, capsys):
    """--ranks reads only some ranks: their events are not counted (they are not read), but how many of the job's
    ranks were left unread is, from distributedInfo's world_size."""
    from tracefuse_dask.cli import main

    for r in range(4):
        write_trace(tmp_path / "in" / f"rank{r}.json", make_trace(r, rank_trace()["traceEvents"], world_size=4))
    summary = merge_traces(str(tmp_path / "in"), str(tmp_path / "out.json"), ranks="0-1")
    assert summary.account["ranks_not_read"] == 2 and sorted(summary.account["ranks"]) == ["0", "1"]
    assert_adds_up(summary.account, load_exact(tmp_path / "out.json"))
    assert "ranks_not_read" not in merge_traces(str(tmp_path / "in"), str(tmp_path / "all.json")).account
    assert main(["merge", str(tmp_path / "in"), "-o", str(tmp_path / "cli.json"), "--ranks", "0-1"]) == 0
    assert "; 2 of the job's ranks not read (--ranks)" in capsys.readouterr().err
