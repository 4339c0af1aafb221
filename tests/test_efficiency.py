"""Is one GPU slower than the rest? An 8-rank job built from the real A100 NCCL trace with
../shared/tools/make_dataset.py, analysed as it is (no rank named) and with one rank's GEMM kernels made 15% longer,
every later event shifted (that rank named, with its factor); and the collectives against the device's links."""
from __future__ import annotations

import bisect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED, shape_problems
from tracefuse_dask import analyze
from tracefuse_dask.analysis.schema import Summary

pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    not (SHARED.parent / "tools" / "make_dataset.py").is_file() or not (SHARED / "real").is_dir(),
    reason="../shared/tools/make_dataset.py or ../shared/traces/real is missing beside the repository")]

SOURCE = SHARED / "real" / "hta_negative_queue_length" / "rank0.json.gz"
GEMMS = ("aten::mm", "aten::addmm")


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("slow_gpu") / "base"
    subprocess.run([sys.executable, str(SHARED.parent / "tools" / "make_dataset.py"), "--source", str(SOURCE),
                    "--ranks", "8", "--mb-per-rank", "8", "--no-gzip", "--out", str(out)], check=True,
                   capture_output=True, timeout=600)
    return out


def slow_down_gemms(path: Path, factor: float) -> int:
    """Make the kernels that the rank's aten::mm / aten::addmm calls launched ``factor`` times longer, and shift
    every event that starts after such a kernel by the time added before it. Returns how many kernels."""
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    ops = [(e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events
           if e.get("cat") == "cpu_op" and e.get("name") in GEMMS]
    launches = {e["args"]["correlation"] for e in events if e.get("cat") == "cuda_runtime"
                and "Launch" in e.get("name", "") and any(p == e["pid"] and t == e["tid"] and a <= e["ts"] <= b
                                                          for p, t, a, b in ops)}
    kernels = sorted((e for e in events if e.get("cat") == "kernel"
                      and (e.get("args") or {}).get("correlation") in launches), key=lambda e: e["ts"])
    starts, added, total = [], [], 0.0
    for k in kernels:
        extra = k["dur"] * (factor - 1)
        k["dur"] = round(k["dur"] * factor, 3)
        starts.append(k["ts"])
        total += extra
        added.append(total)
    for e in events:
        if "ts" in e and e.get("ph") != "M":
            i = bisect.bisect_left(starts, e["ts"])  # the kernels that start strictly before the event
            if i:
                e["ts"] = round(e["ts"] + added[i - 1], 3)
    path.write_text(json.dumps(doc))
    return len(kernels)


def test_an_unchanged_job_names_no_slow_gpu(job, client):
    a = analyze(str(job), client=client)
    assert a.summary["slow_gpu"] is None or a.summary["slow_gpu"]["rank"] is None
    gemm = a.gpu_speed[a.gpu_speed["category"] == "GEMM"]
    assert len(gemm) == 8 and (gemm["groups"] >= 3).all() and not a.gpu_speed["slow"].any()


def test_a_rank_with_15_percent_slower_gemms_is_named(job, client, tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    for f in job.iterdir():
        (slow / f.name).write_bytes(f.read_bytes())
    assert slow_down_gemms(slow / "rank03.pt.trace.json", 1.15) >= 15
    run = subprocess.run([sys.executable, "-m", "tracefuse_dask", "analyze", str(slow), "-o", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert shape_problems(summary, Summary) == []  # summary.json as schema.Summary declares it
    verdict = summary["slow_gpu"]
    assert (verdict["rank"], verdict["category"]) == (3, "GEMM") and verdict["factor"] == pytest.approx(1.15, abs=0.02)
    assert verdict["groups"] >= 3 and not verdict["others"]
    assert f"gpu: rank 3's GPU runs its GEMMs {100 * (verdict['factor'] - 1):.0f}% slower than the median rank at " \
           f"equal shapes ({verdict['groups']} op groups): a slow or throttled GPU" in run.stderr
    page = (tmp_path / "r" / "report.html").read_text()
    answers = page[page.index('<h2 id="answers">'):page.index('<h2 id="outliers">')]
    assert "rank 3&#x27;s GPU runs its GEMMs" in answers and "Roofline: " in answers


def test_collectives_are_put_against_the_links(job, client):
    """make_dataset lays 8 ranks to a node (the trace lists the node's 8 A100s): intra-node, on NVLink 3."""
    a = analyze(str(job), client=client)
    inst = a.collective_instances.dropna(subset=["busbw_gbps"])
    assert len(inst) and (inst["scope"] == "intra-node").all()
    expected = 100 * inst["busbw_gbps"] / (600 / 2)  # A100 SXM4: NVLink 3, 600 GB/s both directions
    assert inst["link_pct"].tolist() == pytest.approx(expected.tolist())
    assert "link_pct_mean" in a.collective_summary and (a.collective_summary["scope"] == "intra-node").any()
