"""The critical path goes where the host waits: a blocking call (a sync, a blocking copy) owns only its time after
the device work it waited for, and that work, with the launches behind it, is on the path (issue 44).

Each hand-built trace is one rank, ``ProfilerStep#1`` from 0 µs, with its expected path written out: (kind, name,
µs), earliest first. Kernels run on pid 0, the host on pid 100.
"""
from __future__ import annotations

import copy
import html
import json
import subprocess
import sys

import pytest
from conftest import make_trace, shared, write_trace

from tracefuse_dask import analyze, diff

pytestmark = pytest.mark.integration

PID = 100


def host(name, ts, dur, correlation=None, cat="cuda_runtime"):
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": PID, "ts": ts, "dur": dur, "args": args}


def device(name, ts, dur, stream, correlation, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation, "device": 0}}


def step(dur):
    return host("ProfilerStep#1", 0, dur, cat="user_annotation")


def path_of(tmp_path, events, client, name="rank0.json"):
    write_trace(tmp_path / name, make_trace(0, events))
    got = analyze(str(tmp_path / name), client=client)
    seg = got.critical_path.sort_values("order")
    return [(k, n, round(d, 3)) for k, n, d in zip(seg["kind"], seg["name"], seg["dur_us"])], got.summary


def three_kernels_then(sync):
    """Three launches [10, 15], [15, 20], [20, 25] of kernels [30, 130], [130, 230], [230, 330] on stream 7, then
    ``sync`` [30, 340]; the step ends at 350."""
    return [step(350), host("cudaLaunchKernel", 10, 5, 1), host("cudaLaunchKernel", 15, 5, 2),
            host("cudaLaunchKernel", 20, 5, 3), host(sync, 30, 310, 4),
            device("gemm_a", 30, 100, 7, 1), device("gemm_b", 130, 100, 7, 2), device("gemm_c", 230, 100, 7, 3)]


def test_a_device_sync_waits_for_the_kernels_it_followed(client, tmp_path):
    """1. The path is the launch of the first kernel, the kernels (queued one behind the other), the sync's tail
    after the last kernel and the step's end; not the sync."""
    got, summary = path_of(tmp_path, three_kernels_then("cudaDeviceSynchronize"), client)
    assert got == [("cpu_op", "ProfilerStep#1", 10.0), ("launch gap", "gemm_a", 20.0), ("kernel", "gemm_a", 100.0),
                   ("kernel", "gemm_b", 100.0), ("kernel", "gemm_c", 100.0),
                   ("sync overhead", "cudaDeviceSynchronize", 10.0), ("cpu_op", "ProfilerStep#1", 10.0)]
    assert summary["bound"]["bound"] == "GPU"
    assert summary["bound"]["text"].startswith("GPU-bound: 86% of the slowest step's critical path (ProfilerStep#1, "
                                               "0.3 ms) is GPU work: GEMM 86%")
    assert summary["bound"]["text"].endswith("; the host waits in `cudaDeviceSynchronize` for it")


def test_a_stream_sync_follows_its_own_stream(client, tmp_path):
    """2. cudaStreamSynchronize [30, 240] on stream 7 while stream 13 runs longer ([20, 300], launched before the
    step): the sync returned after stream 7's last kernel [130, 230]; the path follows stream 7 only."""
    events = [step(250), host("cudaLaunchKernel", -10, 5, 9), host("cudaLaunchKernel", 10, 5, 1),
              host("cudaLaunchKernel", 15, 5, 2), host("cudaStreamSynchronize", 30, 210, 4),
              device("long_other", 20, 280, 13, 9), device("gemm_a", 30, 100, 7, 1), device("gemm_b", 130, 100, 7, 2)]
    got, _ = path_of(tmp_path, events, client)
    assert got == [("cpu_op", "ProfilerStep#1", 10.0), ("launch gap", "gemm_a", 20.0), ("kernel", "gemm_a", 100.0),
                   ("kernel", "gemm_b", 100.0), ("sync overhead", "cudaStreamSynchronize", 10.0),
                   ("cpu_op", "ProfilerStep#1", 10.0)]


def item_trace(names):
    """``aten::item`` [20, 300] → ``aten::_local_scalar_dense`` → a blocking copy call [25, 290] whose
    device-to-host copy [260, 280] follows a long kernel [30, 260] on stream 7 (launched at [10, 15])."""
    launch, copy_call, kernel_cat = names
    return [step(310), host(launch, 10, 5, 1), host("aten::item", 20, 280, cat="cpu_op"),
            host("aten::_local_scalar_dense", 22, 276, cat="cpu_op"), host(copy_call, 25, 265, 2),
            device("reduce_kernel", 30, 230, 7, 1, cat=kernel_cat),
            device("Memcpy DtoH (Device -> Pageable)", 260, 20, 7, 2, cat="gpu_memcpy")]


ITEM_PATH = [("cpu_op", "ProfilerStep#1", 10.0), ("launch gap", "reduce_kernel", 20.0),
             ("kernel", "reduce_kernel", 230.0), ("memcpy", "Memcpy DtoH (Device -> Pageable)", 20.0)]


def test_a_blocking_copy_goes_through_the_kernel_before_its_copy(client, tmp_path):
    """3. ``aten::item``: the path goes through the long kernel and the copy, then the copy call's tail."""
    got, summary = path_of(tmp_path, item_trace(("cudaLaunchKernel", "cudaMemcpyAsync", "kernel")), client)
    assert got == [*ITEM_PATH, ("sync overhead", "cudaMemcpyAsync", 10.0), ("cpu_op", "aten::_local_scalar_dense", 8.0),
                   ("cpu_op", "aten::item", 2.0), ("cpu_op", "ProfilerStep#1", 10.0)]
    assert summary["bound"]["bound"] == "GPU"


def test_rocm_names_give_the_same_paths(client, tmp_path):
    """4. The same traces in ROCm's names: hipDeviceSynchronize, hipMemcpyWithStream, hipLaunchKernel."""
    events = [{**e, "name": e["name"].replace("cuda", "hip")} for e in three_kernels_then("cudaDeviceSynchronize")]
    got, _ = path_of(tmp_path, events, client)
    assert [x for x in got if x[0] == "sync overhead"] == [("sync overhead", "hipDeviceSynchronize", 10.0)]
    assert [x[0] for x in got].count("kernel") == 3
    got, _ = path_of(tmp_path, item_trace(("hipLaunchKernel", "hipMemcpyWithStream", "kernel")), client, "rocm.json")
    assert got == [*ITEM_PATH, ("sync overhead", "hipMemcpyWithStream", 10.0),
                   ("cpu_op", "aten::_local_scalar_dense", 8.0), ("cpu_op", "aten::item", 2.0),
                   ("cpu_op", "ProfilerStep#1", 10.0)]


def test_a_sync_that_returns_long_after_the_gpu_went_idle_owns_the_gap(client, tmp_path):
    """5. A kernel [30, 80] and a cudaDeviceSynchronize [25, 400]: the host owns what follows the kernel's end."""
    events = [step(410), host("cudaLaunchKernel", 10, 5, 1), host("cudaDeviceSynchronize", 25, 375, 2),
              device("gemm", 30, 50, 7, 1)]
    got, summary = path_of(tmp_path, events, client)
    assert got == [("cpu_op", "ProfilerStep#1", 10.0), ("launch gap", "gemm", 20.0), ("kernel", "gemm", 50.0),
                   ("sync overhead", "cudaDeviceSynchronize", 320.0), ("cpu_op", "ProfilerStep#1", 10.0)]
    assert summary["bound"]["bound"] == "host"
    assert "`cudaDeviceSynchronize` 78%" in summary["bound"]["text"]


def test_cuda_sync_events_give_the_same_path_as_the_calls_alone(client, tmp_path):
    """6. Kineto's cuda_sync events (a Context Sync for case 1, a Stream Sync on stream 7 for case 2) change
    nothing: the calls alone are recognised by name, and the Stream Sync names the stream the call already
    chose."""
    for name, events, sync in (
            ("device", three_kernels_then("cudaDeviceSynchronize"), ("Context Sync", 30, 310, 4)),
            ("stream", [step(250), host("cudaLaunchKernel", -10, 5, 9), host("cudaLaunchKernel", 10, 5, 1),
                        host("cudaLaunchKernel", 15, 5, 2), host("cudaStreamSynchronize", 30, 210, 4),
                        device("long_other", 20, 280, 13, 9), device("gemm_a", 30, 100, 7, 1),
                        device("gemm_b", 130, 100, 7, 2)], ("Stream Sync", 30, 210, 4))):
        plain, _ = path_of(tmp_path, copy.deepcopy(events), client, f"{name}.json")
        label, ts, dur, corr = sync
        synced = [*events, device(label, ts, dur, 7, corr, cat="cuda_sync")]
        with_events, _ = path_of(tmp_path, synced, client, f"{name}_sync.json")
        assert with_events == plain


def test_a_stream_sync_event_names_the_stream_when_another_ends_later_in_the_block(client, tmp_path):
    """With a Stream Sync event on stream 7, a kernel of stream 13 that ends while the call blocks, after stream 7's
    last kernel, is not what the call waited for; without it, the latest end is all the trace says."""
    events = [step(260), host("cudaLaunchKernel", 5, 5, 9), host("cudaLaunchKernel", 10, 5, 1),
              host("cudaStreamSynchronize", 30, 210, 4), device("other", 20, 215, 13, 9),
              device("gemm", 30, 200, 7, 1), device("Stream Sync", 30, 210, 7, 4, cat="cuda_sync")]
    got, _ = path_of(tmp_path, events, client)
    assert ("kernel", "gemm", 200.0) in got and not any(n == "other" for _, n, _ in got)
    got, _ = path_of(tmp_path, events[:-1], client, "plain.json")
    assert ("kernel", "other", 215.0) in got


def test_a_step_ends_when_the_device_work_it_launched_ends(client, tmp_path):
    """A step whose host part ends at 50 µs while the kernel it launched runs to 200: the step lasts 200 µs, and
    its path ends with the kernel; its period on the host (``host_us``) stays 50 µs, and that is the step time
    ``diff`` compares, as it compares each rank's step times (``breakdown_by_step``)."""
    events = [step(50), host("cudaLaunchKernel", 10, 5, 1), device("gemm", 20, 180, 7, 1)]
    got, summary = path_of(tmp_path, events, client)
    assert got == [("cpu_op", "ProfilerStep#1", 10.0), ("launch gap", "gemm", 10.0), ("kernel", "gemm", 180.0)]
    assert (summary["critical_path"][0]["duration_us"], summary["critical_path"][0]["host_us"]) == (200.0, 50.0)
    s = diff(str(tmp_path / "rank0.json"), str(tmp_path / "rank0.json"), client=client).summary
    assert s["step_time"]["base"] == s["step_time"]["new"] == 50.0


@pytest.mark.parametrize("name,sync", [("tracelens_h100_qwen", "cudaDeviceSynchronize"),
                                       ("tracelens_mi300_qwen", "hipDeviceSynchronize")])
def test_tracefuse_analyze_says_a_gpu_bound_step_is_gpu_bound(name, sync, tmp_path):
    """From a fresh process, as a user runs it: the real single-GPU inference traces, whose steps wait in a device
    sync for the GEMMs and attention queued before it, are GPU-bound by their path, the verdict names the sync and
    the path's kernel categories, and the report says the same."""
    done = subprocess.run([sys.executable, "-m", "tracefuse_dask", "analyze", str(shared("real", name)), "-o",
                           str(tmp_path / "rep")], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("bound: "))
    assert line.startswith("bound: GPU-bound: 8") or line.startswith("bound: GPU-bound: 9"), line
    assert "GEMM" in line and "attention" in line and line.endswith(f"; the host waits in `{sync}` for it"), line
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["bound"]["text"] == line.removeprefix("bound: ") and summary["bound"]["why"] is None
    step = summary["critical_path"][0]
    assert step["duration_us"] == step["path_us"] and step["gpu_us"] / step["path_us"] > 0.85
    assert f"Bound: {summary['bound']['text']}." in html.unescape((tmp_path / "rep" / "report.html").read_text())


def test_a_thread_set_going_by_the_steps_thread_continues_there(client, tmp_path):
    """autograd's backward thread (tid 2) runs `bw_op` [50, 150], which launches a kernel that ends last; its
    previous work ended before the step: the walk goes from `bw_op`'s start to the steps' thread, which was in
    `aten::backward` [10, 210] then (its own time, not idle). The kernel started 90 µs after its launch returned,
    its stream free: held on the device (GPU idle), not a launch gap."""
    def op(name, ts, dur, tid):
        return {**host(name, ts, dur, cat="cpu_op"), "tid": tid}

    events = [step(300), op("aten::backward", 10, 200, PID), op("prev_bw", -50, 10, 2), op("bw_op", 50, 100, 2),
              {**host("cudaLaunchKernel", 60, 10, 1), "tid": 2}, device("gemm", 160, 240, 7, 1)]
    got, _ = path_of(tmp_path, events, client)
    assert got == [("cpu_op", "ProfilerStep#1", 10.0), ("cpu_op", "aten::backward", 40.0), ("cpu_op", "bw_op", 10.0),
                   ("cpu_op", "cudaLaunchKernel", 10.0), ("idle", "GPU idle", 90.0), ("kernel", "gemm", 240.0)]


@pytest.mark.parametrize("name, bound, why", [
    ("hta_negative_queue_length", "GPU", "the GPU is idle 69% of the trace (breakdown), yet the step waited for it: "
                                         "66% of the path is gaps between GPU work already queued"),
    ("kineto_2021_resnet50", "host", "kernels wait 9,488 µs in their launch queues (median, launches), so the GPU is "
                                     "behind the host at times; yet the step's end waited for the host"),
])
def test_where_the_launches_or_the_breakdown_seem_to_disagree_the_verdict_says_why(name, bound, why, client):
    """One consistent story on two real traces whose other lines seem to say the opposite of the path: a GPU
    mostly idle yet on the path (its queued work held by what the trace does not show), and long launch queues on a
    step whose end waits for the host (the single-process data loader)."""
    got = analyze(str(shared("real", name)), client=client).summary
    assert got["bound"]["bound"] == bound and got["bound"]["why"].startswith(why), got["bound"]
