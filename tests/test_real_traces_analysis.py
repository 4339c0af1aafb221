"""The analysis on what real traces of every Kineto vintage and accelerator hold: 2021-era categories, MTIA device
work, collective kernels by every name in use, graph launches."""
from __future__ import annotations

import copy
import gzip
from pathlib import Path

import pytest
from conftest import (
    SHARED,
    interval_union,
    only_trace,
    read_trace,
    shape_problems,
    shared,
    shared_params,
    write_trace,
)

from tracefuse_dask import analyze
from tracefuse_dask.analysis.schema import Summary

pytestmark = pytest.mark.integration



def test_2021_kineto_memcpy_and_memset_count(client):
    """Kernel/Memcpy/Memset (capitalised) are device work of their kinds; Operator ops are in the op table."""
    doc = read_trace(only_trace("kineto_2021_resnet50"))
    got = analyze(str(only_trace("kineto_2021_resnet50")), client=client)
    b = got.breakdown.iloc[0]
    assert b["memcpy_us"] > 0 and b["memset_us"] > 0 and b["non_compute_us"] > 0
    kinds = got.kernels.groupby("category")["count"].sum()
    n = sum(e.get("cat") in ("Kernel", "Memcpy", "Memset") for e in doc["traceEvents"])
    assert kinds.sum() == n and kinds["memory"] == sum(e.get("cat") in ("Memcpy", "Memset") for e in doc["traceEvents"])
    assert got.ops["count"].sum() > 0


def test_mtia_device_work_is_analysed_as_device_work(client):
    """MTIA's mtia_ccp_events carry args.stream: device work, dma* by name memory, as HTA classifies them."""
    doc = read_trace(only_trace("hta_mtia_inference"))
    ccp = [e for e in doc["traceEvents"] if e.get("cat") == "mtia_ccp_events"]
    got = analyze(str(only_trace("hta_mtia_inference")), client=client)
    b = got.breakdown.iloc[0]
    assert b["kernel_count"] == len(ccp) and b["gpu_span_us"] > 0 and b["memcpy_us"] > 0
    memory = got.kernels[got.kernels["category"] == "memory"]
    assert set(memory["name"]) == {e["name"] for e in ccp if e["name"].startswith("dma")}


@pytest.mark.parametrize("new_name", ["ncclDevKernel_", "rcclKernel_"])
def test_collective_kernels_by_every_name(new_name, client, tmp_path):
    """NCCL >= 2.19 names its kernels ncclDevKernel_*, RCCL rccl*: the collective matching finds them all; HTA's
    breakdown (^nccl.*Kernel) counts ncclDevKernel_* as communication too."""
    folder = shared("real", "hta_trace_filter")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for p in folder.iterdir():
        if p.name.endswith(".json.gz"):
            (renamed / p.name).write_bytes(gzip.compress(
                gzip.decompress(p.read_bytes()).replace(b'"ncclKernel_', f'"{new_name}'.encode())))
    base, got = analyze(str(folder), client=client), analyze(str(renamed), client=client)
    cols = ["rank", "index", "op", "gpu_start_ns", "gpu_end_ns", "stream"]
    assert base.collectives["gpu_start_ns"].notna().sum() > 10
    assert got.collectives[cols].equals(base.collectives[cols])
    if new_name.startswith("nccl"):
        assert got.breakdown.equals(base.breakdown)


# --- the temporal breakdown against an independent interval union over the raw JSON, with HTA's rules -----------

_DEVICE_CATS = {"kernel", "gpu_memcpy", "memcpy", "gpu_memset", "memset", "cuda_sync"}
_HOST_CATS = {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "operator", "runtime",
              "cpu_instant_event", "overhead", "external_correlation", "cuda_profiler_range", "glow_runtime",
              "mtia_runtime", "hpu_op", "xpu_runtime", "xpu_driver", "privateuse1_runtime", "privateuse1_driver",
              "collective_comm", "trace", "ac2g", "fwdbwd", "async"}


def _launched_by_the_steps(events: list[dict]) -> tuple[set, int] | None:
    """HTA's filter of device work (``_filter_irrelevant_gpu_kernels``, ``include_last_profiler_step=True``), from
    the text: with two or more ``ProfilerStep#N``, the correlations of the host events that start by the end of the
    last step, and that end (ns); None with fewer steps (HTA keeps all device work then)."""
    from decimal import Decimal

    steps = {e["name"]: int((Decimal(e["ts"]) + Decimal(e.get("dur", 0))) * 1000) for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")}
    if len(steps) < 2:
        return None
    last = max(steps.values())
    return {e["args"]["correlation"] for e in events
            if e.get("ph") == "X" and str(e.get("cat", "")).lower() in _HOST_CATS
            and isinstance(e.get("args"), dict) and "correlation" in e["args"]
            and int(Decimal(e["ts"]) * 1000) <= last}, last


def independent_breakdown(path: Path) -> dict[str, float]:
    """GPU span, idle, compute and non-compute (µs) of one rank file, from its text: device work is a GPU
    category's event, or an event of another non-host category with an integer args.stream; HTA's kernel types
    by name (^nccl.*Kernel communication, ^Memcpy|^Memset|^dma memory, *Sync not compute), and symmetric memory's
    collective kernels (multimem_all_reduce_kernel...) communication, as we count them. Device work that no
    host event of the profiled steps launched is left out, as HTA leaves it out (``_launched_by_the_steps``): in
    real/hta_negative_queue_length, 872 kernels, copies and sets run in step 550 that were queued before the host
    side of the trace begins (correlations 815091-824946; the first host correlation is 824968), and HTA's own
    figures for that trace (tests/data/hta_expected.json) leave them out."""
    import json
    import re
    from decimal import Decimal

    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw, parse_float=Decimal)
    launched = _launched_by_the_steps(doc["traceEvents"])
    spans, compute = [], []
    for e in doc["traceEvents"]:
        cat = str(e.get("cat", "")).lower()
        stream = (e.get("args") or {}).get("stream") if isinstance(e.get("args"), dict) else None
        if e.get("ph") != "X" or not (cat in _DEVICE_CATS or (cat not in _HOST_CATS and not cat.startswith("gpu_")
                                                               and type(stream) is int)):
            continue
        a = int(Decimal(e["ts"]) * 1000)
        if launched is not None:
            corr = e["args"].get("correlation") if isinstance(e.get("args"), dict) else None
            if (corr not in launched[0]) if isinstance(corr, (int, str)) else a > launched[1]:
                continue
        span = (a, a + int(Decimal(e.get("dur", 0)) * 1000))
        if (stream if type(stream) is int else 0) < 0:
            continue
        spans.append(span)
        name = e["name"]
        if not re.match(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)", name) and not re.match(r"^dma", name) \
                and not re.search(r"(multimem|one_shot|two_shot)_(all_reduce|all_gather|reduce_scatter)", name):
            compute.append(span)
    if not spans:
        return {}
    total = max(b for _, b in spans) - min(a for a, _ in spans)
    busy, comp = interval_union(spans), interval_union(compute)
    return {"gpu_span_us": total / 1e3, "idle_us": (total - busy) / 1e3, "computation_us": comp / 1e3,
            "non_compute_us": (busy - comp) / 1e3}


REAL_FILES = shared_params(sorted(str(p.relative_to(SHARED / "real")) for p in SHARED.glob("real/*/*.json*")))


@pytest.mark.parametrize("name", REAL_FILES)
def test_breakdown_equals_an_independent_interval_union(name, client):
    path = shared("real", *name.split("/"))
    want = independent_breakdown(path)
    a = analyze({0: str(path)}, client=client)
    assert shape_problems(a.summary, Summary) == []  # summary.json as schema.Summary declares it
    got = a.breakdown.iloc[0]
    if not want:
        assert got["kernel_count"] == 0
        return
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-6), (name, key)


def test_gpu_work_whose_launch_is_not_in_the_trace_is_left_out_as_hta_does(client, tmp_path):
    """A real two-step trace (hta_trace_filter rank 0) with device work HTA leaves out added: 5 kernels before the
    first step whose correlation no host event has (queued before the profiler started), and 3 kernels without a
    correlation after the last step. They are counted, said in the summary, the CLI and the report, and kept with
    --keep-unlaunched-gpu."""
    import subprocess
    import sys

    src = shared("real", "hta_trace_filter", "sampled_rank-0.json.gz")
    doc = read_trace(src)
    events = doc["traceEvents"]
    kernel = next(e for e in events if e.get("cat") == "kernel")
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    first, last = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    for i in range(5):
        k = copy.deepcopy(kernel)
        k.update(ts=first - 1000 + 10 * i, dur=5)
        k["args"]["correlation"] = 10**9 + i
        events.append(k)
    for i in range(3):
        k = copy.deepcopy(kernel)
        k.update(ts=last + 1000 + 10 * i, dur=5)
        del k["args"]["correlation"]
        events.append(k)
    write_trace(tmp_path / "in" / "rank0.json.gz", doc)
    base = analyze(str(src), client=client)
    got = analyze(str(tmp_path / "in"), str(tmp_path / "report"), client=client)
    kept = analyze(str(tmp_path / "in"), client=client, keep_unlaunched_gpu=True)
    left_out = got.summary["gpu_events_left_out"]
    assert left_out["count"] == 8 and "ProfilerStep" in left_out["why"]
    assert got.breakdown.iloc[0]["kernel_count"] == base.breakdown.iloc[0]["kernel_count"]
    assert got.breakdown.iloc[0]["gpu_span_us"] == base.breakdown.iloc[0]["gpu_span_us"]
    assert kept.breakdown.iloc[0]["kernel_count"] == base.breakdown.iloc[0]["kernel_count"] + 8
    assert kept.summary["gpu_events_left_out"] is None
    assert "8 GPU events left out" in (tmp_path / "report" / "report.html").read_text()
    done = subprocess.run([sys.executable, "-m", "tracefuse_dask", "analyze", str(tmp_path / "in"), "-o",
                           str(tmp_path / "cli")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "note: 8 GPU events left out" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "tracefuse_dask", "analyze", str(tmp_path / "in"), "-o",
                           str(tmp_path / "cli-kept"), "--keep-unlaunched-gpu"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "left out" not in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["tracelens_b200"])
def test_kernels_that_overrun_the_next_on_their_stream_are_clipped_in_the_kernel_tables_only(name, client):
    """The real trace where a kernel ends after the next one on its stream starts (74 times; in no other real
    trace): per-kernel durations end at that start, counted; the breakdown keeps the raw ends (the union test
    above). Stream waits neither clip nor are clipped (hta_alexnet's 16 overlaps are all cuda_sync)."""
    import json
    from decimal import Decimal

    from tracefuse_dask.kineto.vocabulary import kernel_type

    path = only_trace(name)
    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw, parse_float=Decimal)
    by_stream: dict = {}
    for e in doc["traceEvents"]:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in _DEVICE_CATS - {"cuda_sync"}:
            start = int(Decimal(e["ts"]) * 1000)
            stream = args["stream"] if type(args.get("stream")) is int else e.get("tid")
            by_stream.setdefault(stream, []).append((start, start + int(Decimal(e.get("dur", 0)) * 1000), e["name"]))
    overruns, cut = 0, 0
    for spans in by_stream.values():
        spans.sort()
        for (_, end, kernel), (nxt, _, _) in zip(spans, spans[1:]):
            if end > nxt:
                overruns += 1
                cut += end - nxt if kernel_type(kernel) != "OTHER" else 0  # the kernel table's set, as HTA's
    got = analyze({0: str(path)}, client=client)
    assert overruns > 10 and got.breakdown.iloc[0]["kernels_clipped"] == overruns
    assert got.summary["per_rank"]["0"]["kernels_clipped"] == overruns
    assert got.kernels["clipped_us"].sum() == pytest.approx(cut / 1e3, abs=1e-6)


def test_symmetric_memory_collectives_are_communication(client, tmp_path):
    """The B200 trace's 73 ``symm_mem::multimem_all_reduce_`` calls (vLLM's tensor-parallel all-reduce): each is a
    collective call with its kernel, op, message size and stream, read from the trace here; their kernels are
    communication in the breakdown and the kernel categories; op_perf leaves them out with the other collectives.
    Through the API and the CLI."""
    import json
    import subprocess
    import sys

    path = only_trace("tracelens_b200")
    doc = json.loads(gzip.decompress(path.read_bytes()))
    calls = [e for e in doc["traceEvents"] if e.get("name") == "symm_mem::multimem_all_reduce_"]
    kernels = {e["args"]["correlation"]: e for e in doc["traceEvents"]
               if e.get("cat") == "kernel" and "multimem_all_reduce" in e["name"]}
    assert len(calls) == len(kernels) == 73
    got = analyze({0: str(path)}, client=client)
    symm = got.collectives[got.collectives["name"] == "symm_mem::multimem_all_reduce_"]
    assert len(symm) == 73 and set(symm["op"]) == {"allreduce"} and set(symm["stream"]) == {7}
    assert sorted(symm["in_bytes"]) == sorted(e["args"]["Input Dims"][0][0] * 2 for e in calls)  # bf16
    assert symm["gpu_start_ns"].notna().all() and symm["gpu_start_ns"].is_unique  # each call found its kernel
    busy = sum(k["dur"] for k in kernels.values())  # one stream, one after the other
    assert got.breakdown.iloc[0]["communication_us"] >= busy - 1e-6
    assert "communication" in set(got.kernel_categories["category"])
    assert not got.op_perf["name"].str.startswith("symm_mem::").any()
    run = subprocess.run([sys.executable, "-m", "tracefuse_dask", "analyze", str(path.parent), "-o",
                          str(tmp_path / "report"), "--format", "csv"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert run.returncode == 0, run.stderr
    table = (tmp_path / "report" / "collectives.csv").read_text()
    assert table.count("symm_mem::multimem_all_reduce_") == 73


def graph_launch_trace(doc: dict, *, by_flow: bool) -> dict:
    """The real graph-capture trace with a hipGraphLaunch of 12 kernels added, inside a ``graph_replay`` op; its
    kernels share its correlation in their args, or (``by_flow``) carry none and are linked to it by one ac2g flow
    that starts at the launch and ends on each kernel, as Kineto writes a graph launch's flow."""
    events = doc["traceEvents"]
    host = next(e for e in events if e.get("cat") == "cuda_runtime")
    kernel = next(e for e in events if e.get("cat") == "kernel")
    op = next(e for e in events if e.get("cat") == "cpu_op")
    t = max(e["ts"] + e.get("dur", 0) for e in events if e.get("ph") == "X") + 100
    corr = 10**9
    events.append({**op, "name": "graph_replay", "ts": t - 5, "dur": 30, "args": {}})
    events.append({**host, "pid": op["pid"], "tid": op["tid"], "name": "hipGraphLaunch", "ts": t, "dur": 10,
                   "args": {} if by_flow else {"correlation": corr}})
    if by_flow:
        events.append({"ph": "s", "id": corr, "pid": op["pid"], "tid": op["tid"], "ts": t, "cat": "ac2g",
                       "name": "ac2g"})
    for i in range(12):
        k = copy.deepcopy(kernel)
        k.update(ts=t + 20 + 5 * i, dur=4, name=f"graph_kernel_{i}")
        if by_flow:
            del k["args"]["correlation"]
            events.append({"ph": "f", "id": corr, "pid": k["pid"], "tid": k["tid"], "ts": k["ts"], "cat": "ac2g",
                           "name": "ac2g", "bp": "e"})
        else:
            k["args"]["correlation"] = corr
        events.append(k)
    return doc


@pytest.mark.parametrize("by_flow", [False, True], ids=["correlation", "flow"])
def test_every_kernel_of_a_graph_launch_is_attributed_to_it(by_flow, client, tmp_path):
    """A graph launch's kernels share its correlation, or (without one) its ac2g flow, which ends on each of them:
    all 12 count for it in the launch statistics and the op table, not the first or the last one only. The real
    ROCm graph-capture trace, whose capture itself launches none, with such a launch added."""
    write_trace(tmp_path / "in" / "rank0.json.gz",
                graph_launch_trace(read_trace(only_trace("tracelens_vllm_cudagraph")), by_flow=by_flow))
    got = analyze(str(tmp_path / "in"), client=client)
    launch = got.kernel_launchers[got.kernel_launchers["name"] == "graph_replay"]
    assert launch["kernel_count"].tolist() == [12] and launch["gpu_time_us"].tolist() == [48.0]
    assert got.ops.set_index("name").loc["graph_replay", "kernel_count"] == 12


def test_collective_kernels_by_their_collective_name_arg(client, tmp_path):
    """Device work named like no NCCL or RCCL kernel is a collective's when its args carry ``Collective name``: the
    real two-rank trace with its ncclKernel_* renamed (no "nccl" left) and that arg added matches the same
    collectives' GPU times; renamed without the arg, none."""
    folder = shared("real", "hta_trace_filter")
    for sub, with_arg in (("arg", True), ("no-arg", False)):
        (tmp_path / sub).mkdir()
        for p in folder.iterdir():
            if p.name.endswith(".json.gz"):
                doc = read_trace(p)
                for e in doc["traceEvents"]:
                    if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_"):
                        e["name"] = e["name"].replace("nccl", "comm")  # ncclKernel_*(ncclDevComm*, ...)
                        if with_arg:
                            e["args"]["Collective name"] = "allreduce"
                write_trace(tmp_path / sub / p.name, doc)
    base = analyze(str(folder), client=client)
    got, bare = analyze(str(tmp_path / "arg"), client=client), analyze(str(tmp_path / "no-arg"), client=client)
    cols = ["rank", "index", "op", "gpu_start_ns", "gpu_end_ns", "stream"]
    assert base.collectives["gpu_start_ns"].notna().sum() > 10
    assert got.collectives[cols].equals(base.collectives[cols])
    assert bare.collectives["gpu_start_ns"].isna().all()
