"""Counter tracks in the merged trace (``merge --counters``, HTA's ``generate_trace_with_counters``): each stream's
queue length and each copy kind's memory bandwidth, as Chrome ``C`` events on the device's merged process.

The tracks must load by Perfetto's rules, sit on the rank's device process at the times of the merged trace's own
events, agree with the analysis's ``queue_length`` and ``memory_bw`` tables (the same series functions), come out
byte for byte the same whatever the cluster, and be absent unless asked.
"""
from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections import defaultdict
from typing import Any

import pytest

from conftest import BASE, make_trace, shared, write_trace
from perfetto_rules import assert_perfetto_rules, load_exact, ns
from tracefuse_dask import MergeError, analyze, merge_traces
from tracefuse_dask.analysis.per_rank.counters import counter_series
from tracefuse_dask.cli import main
from tracefuse_dask.kineto.events import RankEvents
from tracefuse_dask.kineto.vocabulary import QUEUE_CALLS
from tracefuse_dask.merge import plan, tasks
from tracefuse_dask.merge.rewrite import rewrite
from tracefuse_dask.model import MergeOptions

_QUEUE = re.compile(r"^stream (\d+)$")  # the arg's key of a "Queue length" event


def _x(cat: str, name: str, pid: int, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


# One rank by hand: three queue calls (two kernels and a copy on stream 7), a launch whose kernel is not in the
# trace, a kernel without a launch on stream 9, a 0 µs copy with a bandwidth and a set without one.
_HAND = [
    _x("cuda_runtime", "cudaLaunchKernel", 10, 1, 1.0, 0.5, correlation=1),
    _x("cuda_runtime", "cudaLaunchKernel", 10, 1, 2.0, 0.5, correlation=2),
    _x("cuda_runtime", "cudaMemcpyAsync", 10, 1, 3.0, 0.5, correlation=3),
    _x("cuda_runtime", "cudaLaunchKernel", 10, 1, 3.5, 0.5, correlation=4),
    _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 0, 7, 4.0, 0.0, stream=7, correlation=3,
       **{"memory bandwidth (GB/s)": 2.5}),
    _x("kernel", "k1", 0, 7, 5.0, 1.0, stream=7, correlation=1),
    _x("kernel", "k2", 0, 7, 6.0, 1.0, stream=7, correlation=2),
    _x("kernel", "k3", 0, 9, 6.5, 1.0, stream=9),
    _x("gpu_memset", "Memset (Device)", 0, 7, 8.0, 2.0, stream=7),
]


def _counters(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "C"]


def test_a_hand_made_rank_gets_its_counter_tracks_on_its_device_shifted_as_its_events():
    """Queue +1 at each call's start and -1 at its device event's start; bandwidth up at a copy's start and down
    at its end (a 0 µs copy lasts 1 µs); a set without a bandwidth adds no sample. Rank 2's device 0 is its second
    slot (host pid 10 first); the rank's base is 1 ms after the merged one."""
    sel = RankEvents(copy.deepcopy(_HAND), BASE + 1_000_000, MergeOptions(counters=True), "hand (rank 2)")
    _, body = rewrite(sel, 2, BASE, counter_series=counter_series)
    pid = 2**22 + 2 * 64 + 1
    queue = [(1001.0, 1), (1002.0, 2), (1003.0, 3), (1004.0, 2), (1005.0, 1), (1006.0, 0)]
    memory = [(1004.0, 2.5), (1005.0, 0.0)]
    assert _counters(body) == (
        [{"ph": "C", "name": "Queue length", "pid": pid, "ts": ts, "args": {"stream 7": n}} for ts, n in queue]
        + [{"ph": "C", "name": "Memcpy BW (GB/s)", "pid": pid, "ts": ts, "args": {"Memcpy HtoD": x}}
           for ts, x in memory])
    assert body[-len(queue) - len(memory) - 1]["name"] == "Memset (Device)"  # after the rank's own events


def test_without_counters_a_rank_gets_no_counter_events_and_with_them_needs_the_series():
    _, body = rewrite(RankEvents(copy.deepcopy(_HAND), BASE, MergeOptions(), "hand (rank 0)"), 0, BASE)
    assert _counters(body) == []
    with pytest.raises(MergeError, match="counters=True needs the analysis's counter series"):
        rewrite(RankEvents(copy.deepcopy(_HAND), BASE, MergeOptions(counters=True), "hand (rank 0)"), 0, BASE)


def test_the_metadata_names_counters_only_when_asked():
    """Merges without counters keep the metadata (and manifests) they had before the option existed."""
    assert "counters" not in MergeOptions().describe()
    assert MergeOptions(counters=True).describe()["counters"] is True
    assert plan.build_options(counters=True).counters is True


def _tracks(events: list[dict[str, Any]], pid_rank: dict[int, int]) -> tuple[dict[Any, list[Any]], ...]:
    """The queue tracks by (rank, pid, stream) and the bandwidth tracks by (rank, pid, kind): their (ns, value)
    samples in file order."""
    queue: dict[Any, list[Any]] = defaultdict(list)
    memory: dict[Any, list[Any]] = defaultdict(list)
    for e in _counters(events):
        (key, value), = e["args"].items()
        if e["name"] == "Queue length":
            m = _QUEUE.match(key)
            assert m, e
            queue[(pid_rank[e["pid"]], e["pid"], int(m.group(1)))].append((ns(e["ts"]), int(value)))
        else:
            assert e["name"] == "Memcpy BW (GB/s)", e
            memory[(pid_rank[e["pid"]], e["pid"], key)].append((ns(e["ts"]), float(value)))
    return queue, memory


@pytest.mark.integration
@pytest.mark.parametrize("name, calls", [
    ("hta_trace_filter", {"cudaLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync"}),
    ("tracelens_mi300_qwen", {"hipLaunchKernel", "hipExtModuleLaunchKernel", "hipMemcpyWithStream"}),
    ("hta_negative_queue_length", {"cudaLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync"}),
])
def test_counter_tracks_load_in_perfetto_and_agree_with_the_analysis(name, calls, client, tmp_path):
    """Real CUDA and ROCm ranks: every track is on one of its rank's device processes; its samples are those of
    the analysis's tables (with the device work HTA leaves out, which a merge keeps); each +1 is at the start of
    a queue call of the rank (``calls``: the calls the trace has, the ROCm ones included), each -1 at the start of
    an event on that device, each bandwidth sample at a start or end of a copy of that kind there."""
    folder = shared("real", name)
    out = tmp_path / "merged.json.gz"
    merge_traces(str(folder), str(out), client=client, counters=True)
    merged = load_exact(out)
    pid_rank = assert_perfetto_rules(merged)
    assert merged["metadata"]["tracefuse"]["options"]["counters"] is True
    events = merged["traceEvents"]
    devices = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
               and re.match(r"rank \d+ · GPU \d+$", e["args"]["name"])}
    assert {e["pid"] for e in _counters(events)} <= devices
    queue, memory = _tracks(events, pid_rank)

    a = analyze(str(folder), client=client, keep_unlaunched_gpu=True)
    want_queue = {(r.rank, r.stream): (r.samples, r.max, r.mean) for r in a.queue_length.itertuples()}
    got_queue = {(rank, stream): (len(s), max(v for _, v in s), sum(v for _, v in s) / len(s))
                 for (rank, _, stream), s in queue.items()}
    assert want_queue.keys() == got_queue.keys() and want_queue
    for k, (samples, top, mean) in want_queue.items():
        assert got_queue[k][:2] == (samples, top) and got_queue[k][2] == pytest.approx(mean, rel=1e-12), k
    want_memory = {(r.rank, r.kind): (r.samples, r.max_gbps) for r in a.memory_bw.itertuples()}
    got_memory = {(rank, kind): (sum(v > 0 for _, v in s), max(v for _, v in s))
                  for (rank, _, kind), s in memory.items() if any(v > 0 for _, v in s)}
    assert got_memory == want_memory

    host_calls: dict[tuple[int, int], set[str]] = defaultdict(set)
    device_starts: dict[int, set[int]] = defaultdict(set)
    copy_times: dict[tuple[int, str], set[int]] = defaultdict(set)
    for e in events:
        if e["ph"] != "X":
            continue
        t = ns(e["ts"])
        if e["pid"] in devices:
            device_starts[e["pid"]].add(t)
            if e["name"].startswith(("Memcpy", "Memset")):
                kind = "Memset" if e["name"].startswith("Memset") else e["name"][:11]
                copy_times[(e["pid"], kind)] |= {t, t + (ns(e["dur"]) or 1000)}  # 0 µs lasts 1 µs
        elif e["name"] in QUEUE_CALLS:
            host_calls[(pid_rank[e["pid"]], t)].add(e["name"])
    seen_calls: set[str] = set()
    for (rank, pid, _), samples in queue.items():
        before = 0
        for t, value in samples:
            assert abs(value - before) == 1
            if value > before:
                assert (rank, t) in host_calls
                seen_calls |= host_calls[(rank, t)]
            else:
                assert t in device_starts[pid]
            before = value
    assert seen_calls == calls
    for (_, pid, kind), samples in memory.items():
        assert {t for t, _ in samples} <= copy_times[(pid, kind)]


@pytest.mark.integration
def test_counter_tracks_are_byte_identical_with_one_and_four_workers(tmp_path, monkeypatch):
    """CUDA and ROCm ranks with and without a base time, batched on one worker, then each rank its own task on
    four."""
    filter_ranks = sorted(shared("real", "hta_trace_filter").iterdir())
    inputs = {0: str(filter_ranks[0]), 1: str(filter_ranks[1]),
              2: str(next(shared("real", "tracelens_mi300_qwen").iterdir())),
              3: str(next(shared("real", "hta_amd_trace").iterdir()))}
    one, four = tmp_path / "one.json.gz", tmp_path / "four.json.gz"
    merge_traces(inputs, str(one), counters=True, workers=1)
    monkeypatch.setattr(plan, "BATCH_BYTES", 1)
    monkeypatch.setattr(tasks, "BATCH_BYTES", 1)
    merge_traces(inputs, str(four), counters=True, workers=4)
    assert one.read_bytes() == four.read_bytes()
    ranks = {(e["pid"] - 2**22) // 64 for e in _counters(load_exact(one)["traceEvents"])}
    assert ranks == {0, 1, 2, 3}


@pytest.mark.integration
def test_without_counters_the_merge_is_as_before(client, tmp_path):
    """The default merge has no C events and no ``counters`` in its metadata; with counters the merge holds the
    same events in the same order (the general path, which counters take, writes what the fast path writes), plus
    the tracks after each rank's events."""
    folder = str(shared("real", "hta_trace_filter"))
    merge_traces(folder, str(tmp_path / "plain.json"), client=client)
    merge_traces(folder, str(tmp_path / "counters.json"), client=client, counters=True)
    plain, counted = (load_exact(tmp_path / f) for f in ("plain.json", "counters.json"))
    assert _counters(plain["traceEvents"]) == []
    assert "counters" not in plain["metadata"]["tracefuse"]["options"]
    assert [e for e in counted["traceEvents"] if e["ph"] != "C"] == plain["traceEvents"]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracefuse_dask", *argv], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.integration
def test_tracefuse_merge_counters_from_a_fresh_process(tmp_path):
    out = tmp_path / "out.json"
    done = _run("merge", str(shared("real", "hta_trace_filter")), "-o", str(out), "--counters", "-q")
    assert done.returncode == 0, done.stderr
    merged = load_exact(out)
    assert_perfetto_rules(merged)
    tracks = {(e["name"], *e["args"]) for e in _counters(merged["traceEvents"])}
    assert tracks >= {("Queue length", "stream 7"), ("Memcpy BW (GB/s)", "Memcpy HtoD")}


@pytest.mark.integration
def test_tracefuse_analyze_adds_counters_to_the_critical_path_trace(tmp_path):
    path = tmp_path / "path.json"
    done = _run("analyze", str(shared("real", "hta_trace_filter")), "-o", str(tmp_path / "rep"),
                "--critical-path-trace", str(path), "--counters", "-q", "--workers", "1")
    assert done.returncode == 0, done.stderr
    merged = load_exact(path)
    assert merged["metadata"]["tracefuse"]["options"]["counters"] is True
    tracks = {(e["name"], *e["args"]) for e in _counters(merged["traceEvents"])}
    assert ("Queue length", "stream 7") in tracks
    assert any(e.get("cat") == "critical_path" for e in merged["traceEvents"])


def test_analyze_counters_need_the_critical_path_trace(tmp_path, capsys):
    trace = write_trace(tmp_path / "rank0.json", make_trace(0, [_x("cpu_op", "a", 1, 1, 1.0, 1.0)]))
    assert main(["analyze", str(trace), "-o", str(tmp_path / "rep"), "--counters"]) == 2
    err = capsys.readouterr().err
    assert "--counters adds counter tracks to the --critical-path-trace trace" in err
    assert not (tmp_path / "rep").exists()
    with pytest.raises(MergeError, match="pass critical_path_trace too"):
        analyze(str(trace), counters=True)
