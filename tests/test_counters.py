"""Launch statistics, queue length and memory bandwidth (``analysis.per_rank.counters``) on hand-built streams whose answers
are known: a full queue, copies of known bandwidth and duration, launches with known delays, ROCm's calls; and across
ranks, a rank whose kernels wait long for their launches named through the CLI. HTA's own figures on the real
traces are in test_hta_agreement.py."""
from __future__ import annotations

import json

import pytest
from conftest import make_trace, write_trace

from tracefuse_dask import Cutoffs, MergeError, analyze
from tracefuse_dask.analysis.per_rank.rank import analyze_rank
from tracefuse_dask.cli import main

PID, TID = 100, 100


def launch(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": PID, "tid": TID, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def kernel(ts: float, dur: float, corr: int, stream: int = 7, name: str = "gemm_kernel", cat: str = "kernel",
           **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0, **args}}


def op(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": PID, "tid": TID, "ts": ts, "dur": dur, "args": {}}


def tables(events: list[dict], cutoffs: Cutoffs = Cutoffs()) -> dict:
    return analyze_rank(events, 0, "hand-built", cutoffs=cutoffs).tables


def test_a_full_queue_and_the_time_at_its_maximum():
    """1,030 launches, one a µs, of kernels that run 10 µs each from 2 ms on: the queue reaches 1,030 at 1,029 µs,
    stays there until the first kernel starts, and is full (1,024) until the seventh does at 2,060 µs."""
    events = [op("aten::mm", 0, 1040)]
    for i in range(1030):
        events += [launch("cudaLaunchKernel", i, 0.5, i + 1), kernel(2000 + 10 * i, 10, i + 1)]
    q = tables(events)["queue_length"].set_index("stream").loc[7]
    assert (q["samples"], q["max"]) == (2060, 1030)
    assert q["time_at_max_us"] == pytest.approx(2000 - 1029)
    assert q["time_full_us"] == pytest.approx(2060 - 1023)
    values = [min(i + 1, 1030) for i in range(1030)] + [1030 - k - 1 for k in range(1030)]
    assert q["mean"] == pytest.approx(sum(values) / len(values))
    smaller = tables(events, Cutoffs(max_queue_length=1030))["queue_length"].set_index("stream").loc[7]
    assert smaller["time_full_us"] == pytest.approx(2000 - 1029)  # full only at its maximum


def test_copies_of_known_bandwidth_add_up_while_they_overlap():
    """HtoD copies at 10 GB/s over [0, 100] µs and 20 GB/s over [50, 150]: 10, then 30, then 20, then 0 GB/s; a
    memset of 0 µs lasts 1 µs; a copy without a bandwidth adds nothing."""
    events = [op("aten::copy_", 0, 300),
              launch("cudaMemcpyAsync", 1, 1, 1), launch("cudaMemcpyAsync", 2, 1, 2),
              launch("cudaMemsetAsync", 3, 1, 3), launch("cudaMemcpyAsync", 4, 1, 4),
              kernel(10, 100, 1, name="Memcpy HtoD (Pinned -> Device)", cat="gpu_memcpy",
                     **{"memory bandwidth (GB/s)": 10.0}),
              kernel(60, 100, 2, stream=9, name="Memcpy HtoD (Pinned -> Device)", cat="gpu_memcpy",
                     **{"memory bandwidth (GB/s)": 20.0}),
              kernel(200, 0, 3, name="Memset (Device)", cat="gpu_memset", **{"memory bandwidth (GB/s)": 5.0}),
              kernel(250, 10, 4, name="Memcpy DtoH (Device -> Pinned)", cat="gpu_memcpy")]
    m = tables(events)["memory_bw"].set_index("kind")
    assert list(m.index) == ["Memcpy HtoD", "Memset"]  # the DtoH copy gives no bandwidth: no row
    assert (m.loc["Memcpy HtoD", "samples"], m.loc["Memcpy HtoD", "max_gbps"]) == (3, 30.0)
    assert m.loc["Memcpy HtoD", "mean_gbps"] == pytest.approx(20.0)
    assert (m.loc["Memset", "samples"], m.loc["Memset", "mean_gbps"]) == (1, 5.0)


def test_launch_delays_short_kernels_and_outliers_with_their_ops():
    """Delays of 200, 20 and 0 µs (a kernel that starts before its call ends counts 0), a call of 60 µs, and a
    ROCm launch that HTA 0.5.0 would not count."""
    events = [op("aten::mm", 0, 1000), launch("cudaLaunchKernel", 100, 5, 1), kernel(305, 50, 1),
              op("aten::add", 1000, 100), launch("cudaLaunchKernel", 1010, 60, 2), kernel(1090, 5, 2),
              op("aten::mul", 2000, 100), launch("hipLaunchKernel", 2010, 10, 3), kernel(2015, 2, 3, name="mul_k"),
              launch("cudaStreamSynchronize", 2100, 5, 4)]
    t = tables(events)
    row = t["launch_stats"].iloc[0]
    assert row["launches"] == 3 and row["launch_delay_outliers"] == 1 and row["runtime_outliers"] == 1
    assert row["short_kernels"] == 1  # mul_k: 2 µs of GPU time for a 10 µs call; the 60 µs call is an outlier
    assert (row["median_launch_delay_us"], row["max_launch_delay_us"]) == (20.0, 200.0)
    worst = t["launch_worst"]
    assert list(worst["op"]) == ["aten::mm", "aten::add", "aten::mul"]
    assert list(worst["launch_delay_us"]) == [200.0, 20.0, 0.0] and worst["call"].iloc[2] == "hipLaunchKernel"
    row = tables(events, Cutoffs(runtime_us=70, launch_delay_us=10))["launch_stats"].iloc[0]
    assert (row["launch_delay_outliers"], row["runtime_outliers"]) == (2, 0)


def test_bad_cutoffs_say_which_and_what_to_give():
    with pytest.raises(MergeError, match=r"the launch delay cutoff is -1; give a positive number"):
        Cutoffs(launch_delay_us=-1)


@pytest.mark.integration
def test_a_rank_whose_kernels_wait_long_for_their_launches_is_named(tmp_path, capsys, client):
    """Eight ranks launch the same 40 kernels; rank 5's start 400 µs after their calls, the others' after 10 µs, and
    rank 5's queue grows longer. The CLI's summary and summary.json name rank 5 for both."""
    for r in range(8):
        wait = 400 if r == 5 else 10
        events = [op("ProfilerStep#1", 0, 30_000)]
        for i in range(40):
            t = 100 + i * 20
            events += [launch("cudaLaunchKernel", t, 4, i + 1), kernel(t + 4 + wait + 15 * i * (r == 5), 5, i + 1)]
        write_trace(tmp_path / "job" / f"rank{r}.json", make_trace(r, events, world_size=8))
    code = main(["analyze", str(tmp_path / "job"), "-o", str(tmp_path / "report"), "--scheduler",
                 client.scheduler.address])
    err = capsys.readouterr().err
    assert code == 0, err
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    launches = summary["launches"]
    assert launches["outlier_ranks"] == {"median_launch_delay_us": [5], "queue_length_mean": [5]}
    assert launches["launches"] == 320 and launches["launch_delay_outliers"] == 40
    assert any(n.startswith("rank 5's median_launch_delay_us is") for n in summary["outliers"])
    assert "launches: 320 launches on 8 rank(s)" in err and "rank(s) 5 stand out by median launch delay" in err
    again = analyze(str(tmp_path / "job"), client=client, cutoffs=Cutoffs(launch_delay_us=1000))
    assert again.summary["launches"]["launch_delay_outliers"] == 0


def independent_sequences(doc: dict, operator: str) -> dict[str, int]:
    """HTA's rule written out on the raw events: the host ops whose names contain ``operator``, at the shallowest
    nesting among them (ops on the same thread that contain one), that launched 3 or more device events (runtime
    calls inside the op, linked by correlation); each one's name and its device events' names by start."""
    events = doc["traceEvents"]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    device = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            device.setdefault(e["args"]["correlation"], []).append(e)
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]

    def inside(e, o):
        return (e["pid"], e["tid"]) == (o["pid"], o["tid"]) and o["ts"] <= e["ts"] and \
            e["ts"] + e["dur"] <= o["ts"] + o["dur"]
    ops = [o for o in host if operator in o["name"]]
    depth = {id(o): sum(inside(o, h) and h is not o for h in host) for o in ops}
    top = min(depth.values())
    counts: dict[str, int] = {}
    for o in ops:
        if depth[id(o)] != top:
            continue
        launched = [k for r in runtime if inside(r, o) for k in device.get(r["args"].get("correlation"), [])]
        if len(launched) >= 3:
            pattern = "|".join([o["name"], *(k["name"] for k in sorted(launched, key=lambda k: k["ts"]))])
            counts[pattern] = counts.get(pattern, 0) + 1
    return counts


@pytest.mark.integration
def test_frequent_kernel_sequences_across_ranks_match_the_rule_written_out(tmp_path, capsys, client):
    """The A100 set's optimizer steps: each rank's sequences are those the rule gives on its raw events, and the
    summary counts them over both ranks."""
    from conftest import read_trace, shape_problems, shared

    from tracefuse_dask.analysis.schema import Summary

    job = shared("real", "hta_trace_filter")
    code = main(["analyze", str(job), "-o", str(tmp_path / "report"), "--scheduler", client.scheduler.address,
                 "--kernel-sequences", "Optimizer.step"])
    err = capsys.readouterr().err
    assert code == 0, err
    a = analyze(str(job), client=client, kernel_sequences="Optimizer.step")
    expected_total: dict[str, int] = {}
    for r, path in enumerate(sorted(p for p in job.iterdir() if ".json" in p.name)):
        want = independent_sequences(read_trace(path), "Optimizer.step")
        got = a.kernel_sequences[a.kernel_sequences["rank"] == r]
        assert dict(zip(got["pattern"], got["count"])) == want and want, r
        for p, c in want.items():
            expected_total[p] = expected_total.get(p, 0) + c
    assert shape_problems(json.loads((tmp_path / "report" / "summary.json").read_text()), Summary) == []
    s = a.summary["kernel_sequences"]
    assert s["distinct"] == len(expected_total) and s["operator"] == "Optimizer.step"
    top = s["top"][0]
    assert top["count"] == max(expected_total.values()) == 4 and top["ranks"] == 2
    assert top["pattern"].startswith("Optimizer.step#EMAOptimizer.step|")
    assert (f"kernel sequences of Optimizer.step: {len(expected_total)} distinct; the most frequent ran 4 times on 2"
            in err)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["kernel_sequences"] == json.loads(json.dumps(s))


def test_the_examples_kernels_start_after_their_launch_returns(tmp_path, client):
    """``tracefuse example``'s launch latency is an idle A100's (2-6 µs after the call returns), never 0: its
    launches line reads as a real job's."""
    from tracefuse_dask.synth import write_example

    write_example(str(tmp_path / "job"), ranks=2, rank_bytes=200_000)
    launches = analyze(str(tmp_path / "job"), client=client).summary["launches"]
    assert 2 <= launches["median_launch_delay_us"] <= 6, launches
