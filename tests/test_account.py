"""The merge's account of every event it read (issue 48): ``read = kept + every reason for leaving out``,
exactly, per rank and in total, on both rewrite paths; in ``--summary-json`` and on stderr.

The counts are held to the inputs and the output, read here apart from the code under test.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from decimal import Decimal
from pathlib import Path
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
from tracefuse_dask.info import describe_traces
from tracefuse_dask.kineto.anomalies import ANOMALIES
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
    for key, rank in merged["metadata"]["tracefuse"]["ranks"].items():  # the merge links launches by their flows
        want = json_anomalies(read_trace(folder / rank["source"])["traceEvents"])
        assert account["ranks"][key]["anomalies"] == want, key
    if not include_pyfunc:  # info --json gives the account of this merge, from the merge's own rewrite
        assert describe_traces(str(folder), client=client)["account"] == account


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
    assert ("every one of the 21 events read was left out (2 python_function, 8 steps, 4 flow_end_left_out, "
            "4 process_metadata, 3 thread_metadata); check --keep, --steps, --window or filter_fn against the traces"
            ) in summary.warnings


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


# The analysis's account (``analyze``): read = analysed + every reason, and the anomalies.

def _analysis_counts(events: list[dict[str, Any]]) -> Counter:
    """What the analysis leaves out of a rank's events by their phase alone, counted here from the JSON."""
    c: Counter[str] = Counter()
    for e in events:
        if e.get("cat") == "python_function":
            c["python_function"] += 1
        elif e["ph"] == "M":
            c["metadata"] += 1
        elif e["ph"] not in ("X", "B", "E"):
            c["not_slices"] += 1
    return c


@pytest.mark.integration
@pytest.mark.parametrize("name", shared_params([f"real/{s}" for s in REAL_SETS] + ["gloo_4ranks"]))
def test_the_analysis_account_adds_up_on_every_shared_set(name, client):
    """Per rank and in total, on every shared set: read is the file's events, each reason the analysis counts by
    phase is the count in the file, and the window and step anomalies are those counted here from the JSON."""
    from tracefuse_dask.analysis.schema import LEFT_OUT as ANALYSIS_LEFT_OUT
    from tracefuse_dask.api import analyze

    folder = shared(*name.split("/"))
    s = analyze(str(folder), client=client).summary
    account = s["account"]
    assert account["read"] == account["analysed"] + sum(account["left_out"].values())
    assert list(account["left_out"]) == [k for k in ANALYSIS_LEFT_OUT if k in account["left_out"]]
    for rank, path in zip(s["ranks"], s["inputs"]):
        r = account["ranks"][str(rank)]
        events = read_trace(Path(path))["traceEvents"]
        assert r["read"] == len(events) == r["analysed"] + sum(r["left_out"].values())
        by_phase = _analysis_counts(events)
        assert {k: r["left_out"].get(k, 0) for k in by_phase} == dict(by_phase), rank
        assert r["left_out"].get("unlaunched_gpu", 0) == s["per_rank"][str(rank)]["gpu_events_left_out"]
        assert r["anomalies"] == json_anomalies(events), rank
    assert sum(a["count"] for a in account["anomalies"].values()) == sum(
        sum(r["anomalies"].values()) for r in account["ranks"].values())


def json_anomalies(events: list[dict[str, Any]]) -> dict[str, int]:
    """A rank's anomalies (those above 0) counted here from its JSON: slices outside the profiler's window marks,
    and ``_launch_anomalies``."""
    marks = {e["name"]: e["ts"] for e in events if e["ph"] == "i"}
    lo, hi = marks.get("Iteration Start: PyTorch Profiler"), marks.get("Record Window End")
    outside = 0 if lo is None or hi is None else sum(
        1 for e in events if e["ph"] == "X" and e.get("cat") != "python_function"
        and (e["ts"] < lo or e["ts"] + e.get("dur", 0) > hi))
    before, idle = _launch_anomalies(events)
    counts = {"outside_window": outside, "gpu_before_launch": before, "steps_without_gpu": idle}
    return {k: n for k, n in counts.items() if n}


def _launch_anomalies(events: list[dict[str, Any]]) -> tuple[int, int]:
    """Kernels, copies and sets that start before the host call with their correlation, and ProfilerStep#N spans
    in which no such call starts (where any device work has one), counted here from the JSON in exact ns."""
    def ns(v: Any) -> int:
        return int(Decimal(str(v)) * 1000)

    device = [e for e in events if e["ph"] == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launch: dict[Any, int] = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation") if isinstance(e.get("args"), dict) else None
        if e["ph"] == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and type(corr) is int:
            launch.setdefault(corr, ns(e["ts"]))
    linked = [(ns(e["ts"]), launch[c]) for e in device if (c := e["args"].get("correlation")) in launch]
    before = sum(1 for start, at in linked if start < at)
    steps = [(ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])) for e in events
             if e["ph"] == "X" and re.fullmatch(r"ProfilerStep#\d+", e.get("name", ""))]
    idle = sum(1 for lo, hi in steps if not any(lo <= at < hi for _, at in linked)) if linked else 0
    return before, idle


def anomalous_trace() -> dict[str, Any]:
    """Three steps: step 1 launches a kernel that starts 5 µs before its launch, step 2 launches nothing, step 3
    launches a kernel; a B/E pair in step 3, an op before the profiler's start mark and a kernel after its end mark."""
    ev: list[dict[str, Any]] = [
        {"ph": "i", "s": "g", "name": "Iteration Start: PyTorch Profiler", "pid": 9, "tid": 9, "ts": 100},
        {"ph": "i", "s": "g", "name": "Record Window End", "pid": 9, "tid": 9, "ts": 4000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::early", "pid": 9, "tid": 9, "ts": 50, "dur": 10},
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "python"}},
    ]
    for step, t in ((1, 200), (2, 1200), (3, 2200)):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 9, "tid": 9, "ts": t,
                   "dur": 900})
        if step == 2:
            continue
        ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": t + 20,
                "dur": 10, "args": {"correlation": step}},
               {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7,
                "ts": t + (15 if step == 1 else 40), "dur": 50 if step == 1 else 2000,
                "args": {"correlation": step, "stream": 7}}]
    ev += [{"ph": "B", "cat": "user_annotation", "name": "fwd", "pid": 9, "tid": 9, "ts": 2300},
           {"ph": "E", "cat": "user_annotation", "name": "fwd", "pid": 9, "tid": 9, "ts": 2400},
           {"ph": "E", "cat": "user_annotation", "name": "orphan", "pid": 9, "tid": 9, "ts": 2500}]
    return make_trace(0, ev)


def test_the_analysis_counts_each_anomaly_and_reason(client, tmp_path):
    """By hand: the kernel before its launch, the step without device work, the two slices outside the window
    (the op before it, the kernel that ends after it); the E that closed nothing, and --steps 3 leaving out steps 1
    and 2 (their step slices and step 1's launch and kernel) but not step 3's B/E pair."""
    from tracefuse_dask.api import analyze

    src = write_trace(tmp_path / "rank0.json", anomalous_trace())
    n = len(anomalous_trace()["traceEvents"])
    account = analyze(str(src), client=client).summary["account"]
    r = account["ranks"]["0"]
    assert r["anomalies"] == {"outside_window": 2, "gpu_before_launch": 1, "steps_without_gpu": 1}
    assert r["left_out"] == {"metadata": 1, "not_slices": 2, "unopened_end": 1}
    assert r["read"] == n and r["analysed"] == n - 4
    assert account["anomalies"]["steps_without_gpu"] == {
        "count": 1, "ranks": [0], "why": "a ProfilerStep#N that launched no kernel, memcpy or memset, in a rank "
                                         "that has some"}
    stepped = analyze(str(src), client=client, steps="3-3").summary["account"]["ranks"]["0"]
    assert stepped["left_out"]["steps"] == 5 and stepped["read"] == n
    assert stepped["anomalies"] == {"outside_window": 1}  # the early op is outside the steps too
    assert stepped["analysed"] == n - 4 - 5


def test_the_merge_counts_each_anomaly_as_the_analysis_does(client, tmp_path):
    """The hand-built anomalies with the ac2g flows Kineto writes (the merge links a launch to its device work by
    them): the merge, on both rewrite paths, info and analyze count the same, and the merge prints each."""
    from tracefuse_dask.api import analyze

    doc = anomalous_trace()
    launches = {e["args"]["correlation"]: e for e in doc["traceEvents"] if e.get("cat") == "cuda_runtime"}
    doc["traceEvents"] += [f for e in doc["traceEvents"] if e.get("cat") == "kernel" for f in (
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": e["args"]["correlation"], "pid": 9, "tid": 9,
         "ts": launches[e["args"]["correlation"]]["ts"]},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": e["args"]["correlation"], "pid": 0, "tid": 7, "ts": e["ts"],
         "bp": "e"})]
    src = write_trace(tmp_path / "in" / "rank0.json", doc)
    want = {"outside_window": 2, "gpu_before_launch": 1, "steps_without_gpu": 1}
    fast = merge_traces(str(src), str(tmp_path / "fast.json"))
    general = merge_traces(str(src), str(tmp_path / "general.json"), filter_fn=lambda e: True)
    assert fast.account["ranks"]["0"]["anomalies"] == general.account["ranks"]["0"]["anomalies"] == want
    assert {k: a["count"] for k, a in fast.account["anomalies"].items()} == want
    assert describe_traces(str(src))["account"]["anomalies"] == fast.account["anomalies"]
    assert analyze(str(src), client=client).summary["account"]["ranks"]["0"]["anomalies"] == want
    p = subprocess.run([sys.executable, "-m", "tracefuse_dask", "merge", str(src), "-o", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert ("anomaly: device slices before their launch: 1 in rank(s) 0: each starts before the call that launched "
            "it: the host's and the device's clocks disagree") in p.stderr.splitlines()
    assert "anomaly: slices outside the profiler's window: 2 in rank(s) 0: " in p.stderr


def test_the_analysis_account_of_a_merged_trace_counts_what_the_split_left_out(client, tmp_path):
    """A merged trace, analysed per rank, goes through the general path: the python_function events it holds
    (--include-pyfunc) and its lanes' thread metadata (two ranks, each with two ops that cross) are counted as
    left out there, and the account adds up to the file's events."""
    from tracefuse_dask.api import analyze

    for r in (0, 1):
        doc = rank_trace()
        doc["distributedInfo"] = {"backend": "nccl", "rank": r, "world_size": 2}
        doc["traceEvents"] += [{"ph": "X", "cat": "cpu_op", "name": name, "pid": 9, "tid": 9, "ts": t, "dur": 20}
                               for name, t in (("a", 2000), ("b", 2010))]
        write_trace(tmp_path / "in" / f"rank{r}.json", doc)
    summary = merge_traces(str(tmp_path / "in"), str(tmp_path / "m.json"), include_pyfunc=True)
    assert summary.on_lanes == 2
    account = analyze(str(tmp_path / "m.json"), client=client).summary["account"]
    merged = read_trace(tmp_path / "m.json")["traceEvents"]
    assert account["read"] == len(merged) == account["analysed"] + sum(account["left_out"].values())
    assert account["left_out"]["python_function"] == 4


def test_analyze_prints_the_account_and_the_anomalies(tmp_path):
    src = write_trace(tmp_path / "rank0.json", anomalous_trace())
    p = subprocess.run([sys.executable, "-m", "tracefuse_dask", "analyze", str(src), "-o", str(tmp_path / "r"),
                        "--workers", "1"], capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert "note: account: 14 events read = 10 analysed + 1 metadata + 2 instants, counters and flows + 1 E events " \
           "without their B" in lines
    assert "note: device slices before their launch: 1 in rank(s) 0: each starts before the call that launched " \
           "it: the host's and the device's clocks disagree" in lines
    html = (tmp_path / "r" / "report.html").read_text()
    assert "14 events read = 10 analysed" in html


def test_an_analysis_of_a_store_accounts_for_the_trace_it_was_indexed_from(client, tmp_path):
    """A store indexed with --keep gpu holds the kernels and their flow ends alone: its analysis reads the trace's
    events as the trace's own analysis does, and counts what the store does not hold."""
    from tracefuse_dask.api import analyze, index_traces

    src = write_trace(tmp_path / "in" / "rank0.json", rank_trace())
    index_traces(str(src), str(tmp_path / "store"), keep="gpu")
    r = analyze(str(tmp_path / "store"), client=client).summary["account"]["ranks"]["0"]
    trace = analyze(str(src), client=client).summary["account"]["ranks"]["0"]
    assert r["read"] == trace["read"] == len(rank_trace()["traceEvents"]) == 21
    # the two kernels are analysed; the trace's 7 metadata events and 2 python_function events are counted as the
    # trace's analysis counts them, and the 10 host events and flow events --keep gpu left out as not in the store
    assert r == {"read": 21, "analysed": 2, "left_out": {"metadata": 7, "python_function": 2, "not_in_store": 10},
                 "anomalies": {}}


def test_info_gives_the_account_of_each_path_and_says_it(tmp_path):
    """The hand-counted trace, on the fast path and (with a field the fast path does not take) the general one:
    info's account is the merge's, in --json and as one line of the table."""
    doc = rank_trace()
    src = write_trace(tmp_path / "fast" / "rank0.json", doc)
    doc["traceEvents"][1]["odd"] = 1  # an unknown field: the merge's general path
    general = write_trace(tmp_path / "general" / "rank0.json", doc)
    for path in (src, general):
        merged = merge_traces(str(path), str(tmp_path / "out.json"), force=True)
        assert describe_traces(str(path))["account"] == merged.account
        assert merged.account["left_out"] == {"python_function": 2, "process_metadata": 4, "thread_metadata": 2}
    p = subprocess.run([sys.executable, "-m", "tracefuse_dask", "info", str(src)], capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert "a merge with the default options keeps 13 of the 21 events of the per-rank traces (0 slices on lanes); " \
           "--json gives the reasons" in p.stdout.splitlines()


def test_edge_cases_of_the_analysis_account(client, tmp_path):
    """A device B/E pair that nothing launched is two events left out; an M event of category python_function is
    metadata, in a trace and in its store alike; device work that no launch links to says nothing of its steps."""
    from tracefuse_dask.api import analyze, index_traces

    def step(n: int, t: int) -> dict[str, Any]:
        return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 9, "tid": 9, "ts": t,
                "dur": 100}

    def kernel(t: int, corr: int | None) -> dict[str, Any]:
        args = {"stream": 7} if corr is None else {"stream": 7, "correlation": corr}
        return {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": t, "dur": 10, "args": args}

    launched = [step(1, 100), {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9,
                               "ts": 110, "dur": 5, "args": {"correlation": 1}}, kernel(120, 1), step(2, 300),
                {"ph": "B", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": 600,
                 "args": {"correlation": 99, "stream": 7}},
                {"ph": "E", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": 650},
                {"ph": "M", "name": "thread_name", "cat": "python_function", "pid": 9, "tid": 9,
                 "args": {"name": "py"}}]
    src = write_trace(tmp_path / "a" / "rank0.json", make_trace(0, launched))
    r = analyze(str(src), client=client).summary["account"]["ranks"]["0"]
    assert r["left_out"] == {"metadata": 1, "unlaunched_gpu": 2} and r["analysed"] == 4
    assert r["anomalies"] == {"steps_without_gpu": 1}
    index_traces(str(src), str(tmp_path / "store"))
    assert analyze(str(tmp_path / "store"), client=client).summary["account"]["ranks"]["0"] == r
    unlinked = write_trace(tmp_path / "b" / "rank0.json", make_trace(0, [step(1, 100), kernel(120, None),
                                                                         step(2, 300), kernel(320, None)]))
    assert analyze(str(unlinked), client=client).summary["account"]["ranks"]["0"]["anomalies"] == {}


def test_info_gives_no_account_where_the_merge_would_refuse_the_traces(tmp_path):
    """A rank in two files: info describes the files as before, with no account of a merge that would not run."""
    twice = tmp_path / "twice"
    write_trace(twice / "rank0.json", rank_trace())
    write_trace(twice / "rank0b.json", rank_trace())
    report = describe_traces(str(twice))
    assert report["account"] is None and all(r["account"]["read"] == 21 for r in report["per_rank"])


def test_a_negative_duration_is_left_out_and_named_an_anomaly(client, tmp_path):
    """A complete slice with a negative duration, and the flow that binds to it: the merge, info and analyze leave
    the slice out (its flow with it in the merge) and count it as a reason and as an anomaly; the rest merges."""
    from tracefuse_dask.api import analyze

    doc = rank_trace()
    doc["traceEvents"] += [{"ph": "X", "cat": "cpu_op", "name": "neg", "pid": 9, "tid": 9, "ts": 150, "dur": -5},
                           {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "id": 77, "pid": 9, "tid": 9, "ts": 150},
                           {"ph": "f", "cat": "fwdbwd", "name": "fwdbwd", "id": 77, "pid": 9, "tid": 9, "ts": 300,
                            "bp": "e"}]
    bad = write_trace(tmp_path / "bad" / "rank0.json", doc)
    summary = merge_traces(str(bad), str(tmp_path / "out.json"))
    merged = read_trace(tmp_path / "out.json")
    assert_adds_up(summary.account, merged)
    assert summary.account["left_out"]["negative_dur"] == 1
    assert summary.account["left_out"]["flow_end_left_out"] == 2
    assert summary.account["anomalies"] == {"negative_dur": {"count": 1, "ranks": [0], "why": ANOMALIES[
        "negative_dur"]}}
    assert not [e for e in merged["traceEvents"] if e.get("name") in ("neg", "fwdbwd")]
    report = describe_traces(str(bad))
    assert report["account"] == summary.account
    r = analyze(str(bad), client=client).summary["account"]["ranks"]["0"]
    assert r["left_out"]["negative_dur"] == 1 and r["anomalies"] == {"negative_dur": 1}
    assert r["read"] == len(doc["traceEvents"]) == r["analysed"] + sum(r["left_out"].values())


def test_repair_counts_what_it_recovered_and_about_what_it_lost(tmp_path, capsys):
    """Three ranks of 20 ops, the last cut in half: --repair recovers its complete events, and the account says
    how many and about how many came after the cut (the whole ranks' 20 less those); alone, the cut rank has no
    whole rank to compare, and what it lost is unknown (None)."""
    from tracefuse_dask.cli import main

    for r in range(3):
        ops = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 9, "tid": 9, "ts": 10 + 10 * i, "dur": 5}
               for i in range(20)]
        text = json.dumps(make_trace(r, ops, world_size=3))
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"rank{r}.json").write_text(text[:len(text) // 2] if r == 2 else text)
    summary = merge_traces(str(tmp_path / "in"), str(tmp_path / "out.json"), repair=True)
    merged = read_trace(tmp_path / "out.json")
    recovered = sum(1 for e in merged["traceEvents"] if e.get("name", "").startswith("op")) - 40
    assert 0 < recovered < 20
    assert summary.account["repaired"] == {"ranks": [2], "recovered": recovered, "lost_after_cut": 20 - recovered}
    assert summary.account["ranks"]["2"]["repaired"] == {"recovered": recovered, "lost_after_cut": 20 - recovered}
    assert "repaired" not in summary.account["ranks"]["0"]
    assert describe_traces(str(tmp_path / "in"), repair=True)["account"] == summary.account
    alone = merge_traces(str(tmp_path / "in" / "rank2.json"), str(tmp_path / "alone.json"), repair=True)
    assert alone.account["repaired"] == {"ranks": [2], "recovered": recovered, "lost_after_cut": None}
    assert main(["merge", str(tmp_path / "in"), "-o", str(tmp_path / "cli.json"), "--repair"]) == 0
    assert (f"; --repair recovered {recovered} events of rank(s) 2, about {20 - recovered} lost after the cut "
            "(the whole ranks' median count less those recovered)") in capsys.readouterr().err


def _launch(corr: int, t: float, kernel_at: float, kernel_pid: int = 0, ids: bool = True) -> list[dict[str, Any]]:
    """A launch at ``t`` of a kernel at ``kernel_at`` on stream 7 of ``kernel_pid``, with Kineto's ac2g flow."""
    flow = {"id": corr} if ids else {}
    return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": t, "dur": 10,
             "args": {"correlation": corr}},
            {"ph": "s", "cat": "ac2g", "name": "ac2g", **flow, "pid": 9, "tid": 9, "ts": t},
            {"ph": "X", "cat": "kernel", "name": "gemm", "pid": kernel_pid, "tid": 7, "ts": kernel_at, "dur": 50,
             "args": {"correlation": corr, "stream": 7}},
            {"ph": "f", "cat": "ac2g", "name": "ac2g", **flow, "pid": kernel_pid, "tid": 7, "ts": kernel_at, "bp": "e"}]


def test_a_negative_slice_leaves_its_twins_flow_where_it_was(tmp_path):
    """A negative-duration kernel at the very time and stream of a kept one, in a process with host events too:
    the kept kernel's launch arrow still ends in the kernel's process (the dropped slice is device work too)."""
    ev = _launch(1, 220, 240) + [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 0, "tid": 1, "ts": 100, "dur": 5}]
    neg = {"ph": "X", "cat": "kernel", "name": "negk", "pid": 0, "tid": 7, "ts": 240, "dur": -3,
           "args": {"correlation": 1, "stream": 7}}
    for events in (ev, [neg, *ev]):
        src = write_trace(tmp_path / f"in{len(events)}" / "rank0.json", make_trace(0, events))
        merge_traces(str(src), str(tmp_path / "o.json"), force=True)
        out = read_trace(tmp_path / "o.json")["traceEvents"]
        (kernel,) = [e["pid"] for e in out if e.get("name") == "gemm"]
        assert [e["pid"] for e in out if e["ph"] == "f"] == [kernel]


def test_flows_without_ids_link_nothing_and_an_open_b_ends_where_the_analysis_ends_it(client, tmp_path):
    """Flows without an id pair with nothing (no anomaly from them), and a B that no E closes ends at the rank's
    last time, an instant after the window's end included: the merge and analyze count alike."""
    from tracefuse_dask.api import analyze

    ev = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 9, "tid": 9, "ts": t, "dur": 900}
          for s, t in ((1, 200), (2, 1200))] + _launch(2, 1220, 1240, ids=False) + _launch(1, 220, 240, ids=False)
    ev += [{"ph": "i", "s": "g", "name": "Iteration Start: PyTorch Profiler", "pid": 9, "tid": 9, "ts": 100},
           {"ph": "i", "s": "g", "name": "Record Window End", "pid": 9, "tid": 9, "ts": 4000},
           {"ph": "B", "cat": "user_annotation", "name": "open", "pid": 9, "tid": 9, "ts": 3000},
           {"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": 9, "tid": 9, "ts": 4500}]
    src = write_trace(tmp_path / "in" / "rank0.json", make_trace(0, ev))
    merged = merge_traces(str(src), str(tmp_path / "o.json")).account["ranks"]["0"]["anomalies"]
    assert merged == analyze(str(src), client=client).summary["account"]["ranks"]["0"]["anomalies"] == {
        "outside_window": 1}


def test_an_event_store_keeps_the_negative_durations_account(client, tmp_path):
    """Analysing the store of a trace with a negative-duration slice gives the trace's account: the reason and
    the anomaly, not 'not in the event store'."""
    from tracefuse_dask.api import analyze, index_traces

    ev = _launch(1, 220, 240) + [{"ph": "X", "cat": "cpu_op", "name": "neg", "pid": 9, "tid": 9, "ts": 300, "dur": -5}]
    src = write_trace(tmp_path / "in" / "rank0.json", make_trace(0, ev))
    index_traces(str(src), str(tmp_path / "store"))
    of_trace = analyze(str(src), client=client).summary["account"]["ranks"]["0"]
    assert of_trace["left_out"]["negative_dur"] == 1 and of_trace["anomalies"] == {"negative_dur": 1}
    assert analyze(str(tmp_path / "store"), client=client).summary["account"]["ranks"]["0"] == of_trace
