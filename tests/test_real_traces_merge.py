"""The merge on what real traces of every Kineto vintage and accelerator hold: MTIA device work, 2021-era
categories and flows, graph launches under --steps; and, for every shared set, the same bytes with one worker
as with two, Perfetto's import rules, and every input event in the output or dropped for a stated reason."""
from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import orjson
import pytest

from conftest import REAL_SETS, only_trace, read_trace, shared, write_trace
from perfetto_rules import assert_inputs_kept, assert_lanes, assert_perfetto_rules, is_lane_metadata, load_exact
from tracefuse_dask import MergeSummary, merge_traces

pytestmark = pytest.mark.integration

SETS = ["gloo_4ranks", "gloo_2ranks_tb_nostraggler"] + [f"real/{s}" for s in REAL_SETS]



def process_names(merged: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


@pytest.fixture(scope="module")
def one_worker():
    from tracefuse_dask.cluster import connect

    with connect(workers=1) as c:
        yield c


_PROCESS_M = ("process_name", "process_labels", "process_sort_index")


def assert_accounted_for(merged: dict, folder: Path, summary: MergeSummary) -> None:
    """Every input event is in the merge, or dropped for a reason the merge gives: ``python_function`` events
    (dropped by default), Kineto's process metadata (replaced by the merge's own: a name and a sort index per
    process shown), a ``thread_name`` already given for its thread, and the thread metadata of a pid left with
    no events. The summary counts the events on both sides."""
    pid_rank = assert_perfetto_rules(merged)
    ranks = merged["metadata"]["tracefuse"]["ranks"]
    inputs = {int(r): load_exact(folder / meta["source"]) for r, meta in ranks.items()}

    def not_pyfunc(ev: dict) -> bool:
        return ev.get("cat") != "python_function"

    assert_inputs_kept(merged, inputs, keep=not_pyfunc)  # every other non-M event, once, at the same ns
    laned = {pid_rank[pid] for pid in assert_lanes(merged)}  # their thread sort indices are the merge's own
    want: Counter = Counter()
    for r, doc in inputs.items():
        events = [e for e in doc["traceEvents"] if not_pyfunc(e)]
        live = {e["pid"] for e in events if e["ph"] != "M"}
        named: set = set()
        for e in events:
            if e["ph"] != "M" or e["name"] in _PROCESS_M or e["pid"] not in live:
                continue
            if e["name"] == "thread_sort_index" and r in laned:
                continue
            if e["name"] == "thread_name":
                if (e["pid"], e.get("tid")) in named:
                    continue
                named.add((e["pid"], e.get("tid")))
            want[(r, e["name"], orjson.dumps(e.get("args"), option=orjson.OPT_SORT_KEYS))] += 1
    out_m = [e for e in merged["traceEvents"] if e["ph"] == "M"]
    got = Counter((pid_rank[e["pid"]], e["name"], orjson.dumps(e.get("args"), option=orjson.OPT_SORT_KEYS))
                  for e in out_m if e["name"] not in _PROCESS_M and not is_lane_metadata(e, pid_rank, laned))
    assert got == want, (got - want, want - got)
    assert sorted(e["name"] for e in out_m if e["name"] in _PROCESS_M) == sorted(
        ["process_name", "process_sort_index"] * len(pid_rank))
    n_in = sum(len(doc["traceEvents"]) for doc in inputs.values())
    assert (summary.events_in, summary.events_out) == (n_in, len(merged["traceEvents"]))


@pytest.mark.parametrize("name", SETS)
def test_one_worker_and_two_give_the_same_bytes_and_every_event_is_accounted_for(name, one_worker, client,
                                                                                  tmp_path):
    folder = shared(*name.split("/"))
    for suffix in ("json", "json.gz"):
        one, two = tmp_path / f"one.{suffix}", tmp_path / f"two.{suffix}"
        merge_traces(str(folder), str(one), client=one_worker)
        summary = merge_traces(str(folder), str(two), client=client)
        assert one.read_bytes() == two.read_bytes(), suffix
        if suffix == "json":
            assert_accounted_for(load_exact(two), folder, summary)


def test_mtia_device_work_goes_to_a_device_process(client, tmp_path):
    """MTIA puts its device work under mtia_ccp_events with an integer args.stream, on the device's pid (17),
    beside host mtia_runtime calls: the pid splits into a host and a device process, as the spec says."""
    path = only_trace("hta_mtia_inference")
    streamed = sum(1 for e in read_trace(path)["traceEvents"]
                   if e.get("cat") == "mtia_ccp_events" and type((e.get("args") or {}).get("stream")) is int)
    out = tmp_path / "m.json"
    merge_traces([str(path)], str(out), client=client)
    merged = load_exact(out)
    assert_perfetto_rules(merged)
    names = process_names(merged)
    where = Counter((names[e["pid"]], e.get("cat")) for e in merged["traceEvents"] if e["ph"] != "M")
    assert streamed > 1000 and where[("rank 0 · GPU 17", "mtia_ccp_events")] == streamed
    assert where[("rank 0 · CPU (pid 17)", "mtia_runtime")] > 0 and not where[("rank 0 · GPU 17", "mtia_runtime")]


def test_2021_kineto_categories_flows_and_stream_tids(client, tmp_path):
    """Kernel/Memcpy/Memset on devices, Runtime/Operator on the host, string tids mapped to ints, and the async
    launch flows of two ranks (the same file twice) each kept within their rank."""
    path = only_trace("kineto_2021_resnet50")
    doc = read_trace(path)
    folder = tmp_path / "in"
    for r in range(2):
        write_trace(folder / f"rank{r}.json.gz", doc)
    out = tmp_path / "m.json"
    merge_traces(str(folder), str(out), client=client)
    merged = load_exact(out)
    pid_rank = assert_perfetto_rules(merged)  # flows never cross ranks, every tid an int
    names = process_names(merged)
    kinds = Counter((names[e["pid"]].split(" · ")[1].split(" ")[0], e.get("cat"))
                    for e in merged["traceEvents"] if e["ph"] != "M")
    cats = Counter(e.get("cat") for e in doc["traceEvents"])
    for cat in ("Kernel", "Memcpy", "Memset"):
        assert kinds[("GPU", cat)] == 2 * cats[cat] and not kinds[("CPU", cat)]
    for cat in ("Runtime", "Operator"):
        assert kinds[("CPU", cat)] == 2 * cats[cat] and not kinds[("GPU", cat)]
    flows = [e for e in merged["traceEvents"] if e.get("cat") == "async"]
    assert len(flows) == 2 * cats["async"]
    ids = {r: {e["id"] for e in flows if pid_rank[e["pid"]] == r} for r in range(2)}
    assert ids[0] and not ids[0] & ids[1]
    assert any(type(e.get("tid")) is str for e in doc["traceEvents"])


def test_steps_keep_every_kernel_of_a_graph_launch_with_its_launch(client, tmp_path):
    """A graph launch's kernels share its correlation and run after it, here in the next step's time: --steps
    keeps all of them with the launch's step, and none with the next one. The real ROCm graph-capture trace,
    with two steps and a hipGraphLaunch of 12 kernels added (its capture itself launches none)."""
    doc = read_trace(only_trace("tracelens_vllm_cudagraph"))
    events = doc["traceEvents"]
    host = next(e for e in events if e.get("cat") == "cpu_op")
    kernel = next(e for e in events if e.get("cat") == "kernel")
    times = sorted(e["ts"] for e in events if e.get("ph") == "X")
    t0, t1 = times[0], times[-1]
    mid = (t0 + t1) / 2
    step = {**host, "cat": "user_annotation", "args": {}}
    corr = 10**9
    launch = {**host, "cat": "cuda_runtime", "name": "hipGraphLaunch", "ts": mid - 50, "dur": 10,
              "args": {"correlation": corr}}
    graph = [{**copy.deepcopy(kernel), "ts": mid + 10 + 5 * i, "dur": 4} for i in range(12)]
    for k in graph:
        k["args"]["correlation"] = corr
    events += [{**step, "name": "ProfilerStep#1", "ts": t0, "dur": mid - t0},
               {**step, "name": "ProfilerStep#2", "ts": mid, "dur": t1 - mid + 1}, launch, *graph]
    folder = tmp_path / "in"
    write_trace(folder / "rank0.json.gz", doc)
    for steps, expected in (("1", 12), ("2", 0)):
        out = tmp_path / f"steps{steps}.json"
        merge_traces(str(folder), str(out), client=client, steps=steps)
        kept = [e for e in load_exact(out)["traceEvents"] if (e.get("args") or {}).get("correlation") == corr]
        assert sum(e.get("cat") == "kernel" for e in kept) == expected, steps


def test_annotate_rank_from_the_cli(tmp_path):
    """Off by default (the pid says the rank); --annotate-rank writes it into every event's args."""
    import subprocess
    import sys

    folder = str(shared("gloo_4ranks"))
    for flag in ([], ["--annotate-rank"]):
        out = tmp_path / f"m{len(flag)}.json"
        done = subprocess.run([sys.executable, "-m", "tracefuse_dask", "merge", folder, "-o", str(out), "-q", *flag],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        merged = load_exact(out)
        pid_rank = assert_perfetto_rules(merged)
        ranks = [(e.get("args") or {}).get("rank") for e in merged["traceEvents"] if e["ph"] != "M"]
        if flag:
            assert ranks == [pid_rank[e["pid"]] for e in merged["traceEvents"] if e["ph"] != "M"]
        else:
            assert set(ranks) == {None}
        assert merged["metadata"]["tracefuse"]["options"]["annotate_rank"] is bool(flag)
