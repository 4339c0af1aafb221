"""The analysis on what real traces of every Kineto vintage and accelerator hold: 2021-era categories, MTIA device
work, collective kernels by every name in use, graph launches."""
from __future__ import annotations

import copy
import gzip
import shutil
from pathlib import Path

import orjson
import pytest

from conftest import shared, write_trace
from tracefuse_dask import analyze

pytestmark = pytest.mark.integration


def only_trace(name: str) -> Path:
    (path,) = [p for p in shared("real", name).iterdir() if p.name.endswith((".json", ".json.gz"))]
    return path


def read(path: Path) -> dict:
    raw = path.read_bytes()
    return orjson.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def test_2021_kineto_memcpy_and_memset_count(client):
    """Kernel/Memcpy/Memset (capitalised) are device work of their kinds; Operator ops are in the op table."""
    doc = read(only_trace("kineto_2021_resnet50"))
    got = analyze(str(only_trace("kineto_2021_resnet50")), client=client)
    b = got.breakdown.iloc[0]
    assert b["memcpy_us"] > 0 and b["memset_us"] > 0 and b["non_compute_us"] > 0
    kinds = got.kernels.groupby("category")["count"].sum()
    n = sum(e.get("cat") in ("Kernel", "Memcpy", "Memset") for e in doc["traceEvents"])
    assert kinds.sum() == n and kinds["memory"] == sum(e.get("cat") in ("Memcpy", "Memset") for e in doc["traceEvents"])
    assert got.ops["count"].sum() > 0


def test_mtia_device_work_is_analysed_as_device_work(client):
    """MTIA's mtia_ccp_events carry args.stream: device work, dma* by name memory, as HTA classifies them."""
    doc = read(only_trace("hta_mtia_inference"))
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


def test_every_kernel_of_a_graph_launch_is_attributed_to_it(client, tmp_path):
    """A graph launch's kernels share its correlation: all of them count for it in the launch statistics. The real
    ROCm graph-capture trace with a hipGraphLaunch of 12 kernels added (its capture itself launches none)."""
    doc = read(only_trace("tracelens_vllm_cudagraph"))
    events = doc["traceEvents"]
    host = next(e for e in events if e.get("cat") == "cuda_runtime")
    kernel = next(e for e in events if e.get("cat") == "kernel")
    op = next(e for e in events if e.get("cat") == "cpu_op")
    t = max(e["ts"] + e.get("dur", 0) for e in events if e.get("ph") == "X") + 100
    corr = 10**9
    events.append({**op, "name": "graph_replay", "ts": t - 5, "dur": 30, "args": {}})
    events.append({**host, "pid": op["pid"], "tid": op["tid"], "name": "hipGraphLaunch", "ts": t, "dur": 10,
                   "args": {"correlation": corr}})
    for i in range(12):
        k = copy.deepcopy(kernel)
        k.update(ts=t + 20 + 5 * i, dur=4, name=f"graph_kernel_{i}")
        k["args"]["correlation"] = corr
        events.append(k)
    write_trace(tmp_path / "in" / "rank0.json.gz", doc)
    got = analyze(str(tmp_path / "in"), client=client)
    launch = got.kernel_launchers[got.kernel_launchers["name"] == "graph_replay"]
    assert launch["kernel_count"].tolist() == [12] and launch["gpu_time_us"].tolist() == [48.0]
    shutil.rmtree(tmp_path / "in")
