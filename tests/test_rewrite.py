from __future__ import annotations

import copy
import random
from decimal import Decimal

import numpy as np
import orjson
import pytest
from hypothesis import given, strategies as st

from tracefuse_dask.errors import MergeError, TraceFormatError
from tracefuse_dask.model import MergeOptions
from tracefuse_dask.kineto.events import RankEvents
from tracefuse_dask.kineto.layout import PID_BASE, map_tid, out_pid
from tracefuse_dask.kineto.times import fmt_us, to_ns, to_ns_array
from tracefuse_dask.merge.rewrite import rewrite


@pytest.mark.parametrize(
    "value, expected",
    [
        pytest.param(4462667662984.309, 4462667662984309, id="round-is-1ns-low"),
        pytest.param(4430973486002.443, 4430973486002443, id="round-is-1ns-high"),
        pytest.param(4470465431844.691, 4470465431844691, id="round-high-2"),
        pytest.param(4430244168011.303, 4430244168011303, id="round-low-2"),
        pytest.param(0.001, 1, id="one-ns"),
        pytest.param(1682725897226747, 1682725897226747000, id="absolute-int-us"),
        pytest.param(1.5e15, 1500000000000000000, id="absolute-float-us"),
        pytest.param(39.018, 39018, id="dur"),
        pytest.param(-0.001, -1, id="negative"),
        pytest.param(0, 0, id="zero"),
    ],
)
def test_to_ns_is_exact(value, expected):
    assert to_ns(value) == expected


def test_to_ns_matches_decimal_text_on_kineto_like_values():
    rng = random.Random(7)
    for _ in range(20000):
        text = f"{rng.randrange(10**9, 8 * 10**12)}.{rng.randrange(1000):03d}"
        assert to_ns(float(text)) == int(Decimal(text) * 1000), text


@given(st.lists(st.one_of(st.integers(-(2**43) * 1000, 2**52).map(lambda n: n / 1000),
                          st.floats(-9e15, 9e15), st.integers(-(2**53) - 4, 9 * 10**15).map(float),  # whole µs
                          st.sampled_from([8796093022207.999, 2.0**43, 1.5e15, -0.0005, 2.0**53, 2.0**53 + 2,
                                           1682725898236767.0])),
                min_size=1, max_size=50))
def test_to_ns_array_is_to_ns_of_each_value(values):
    assert to_ns_array(np.array(values)).tolist() == [to_ns(v) for v in values]


@pytest.mark.parametrize("value", ["12.5", [1], None, float("nan"), float("inf"), True])
def test_to_ns_rejects_non_numbers(value):
    with pytest.raises((TypeError, ValueError)):
        to_ns(value)


@pytest.mark.parametrize(
    "ns, text",
    [(4462667662984309, b"4462667662984.309"), (1500, b"1.500"), (7, b"0.007"), (0, b"0.000")],
)
def test_fmt_us_writes_three_decimals(ns, text):
    assert orjson.dumps(fmt_us(ns)) == text


@pytest.mark.parametrize(
    "rank, slot, pid",
    [(0, 0, PID_BASE), (3, 2, PID_BASE + 3 * 64 + 2), (10_000, 63, PID_BASE + 10_000 * 64 + 63)],
)
def test_out_pid(rank, slot, pid):
    assert out_pid(rank, slot) == pid < 2**31


@pytest.mark.parametrize(
    "tid, expected",
    [(7, 7), (0, 0), (2**32 - 1, 2**32 - 1), ("stream 7", 7), ("PyTorch Profiler", None), (-5, None),
     (2**40, None)],
)
def test_map_tid(tid, expected):
    got = map_tid(tid)
    assert type(got) is int and 0 <= got < 2**32
    if expected is not None:
        assert got == expected
    assert map_tid(tid) == got  # stable


def x(name, pid, tid, ts, dur=1.0, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": dict(args)}


def flow(ph, fid, pid, tid, ts, cat="ac2g"):
    ev = {"ph": ph, "id": fid, "pid": pid, "tid": tid, "ts": ts, "cat": cat, "name": cat}
    if ph == "f":
        ev["bp"] = "e"
    return ev


def gpu_rank():
    """A small rank: host pid 542, a kernel on device 2, an ac2g flow, a fwdbwd flow, string pids, pid -1."""
    return [
        {"ph": "M", "name": "process_name", "pid": 542, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": 2, "tid": 0, "args": {"labels": "GPU 2"}},
        {"ph": "M", "name": "process_labels", "pid": 5, "tid": 0, "args": {"labels": "GPU 5"}},
        {"ph": "M", "name": "thread_name", "pid": 542, "tid": 542, "args": {"name": "thread 542 (python)"}},
        {"ph": "M", "name": "thread_name", "pid": 542, "tid": 542, "args": {"name": "thread 542 (dup)"}},
        x("ProfilerStep#3", 542, 542, 100.0, 100.0, cat="user_annotation"),
        x("aten::mm", 542, 542, 110.0, 20.0, **{"External id": 9}),
        x("cudaLaunchKernel", 542, 542, 115.0, 2.0, cat="cuda_runtime", correlation=77, **{"External id": 9}),
        flow("s", 77, 542, 542, 115.0),
        x("gemm_kernel", 2, 7, 130.0, 50.0, cat="kernel", correlation=77, **{"External id": 9}),
        flow("f", 77, 2, 7, 130.0),
        x("fwd", 542, 542, 150.0, 1.0),
        flow("s", 1, 542, 542, 150.0, cat="fwdbwd"),
        x("bwd", 542, 9, 160.0, 1.0),
        flow("f", 1, 542, 9, 160.0, cat="fwdbwd"),
        x("python_fn", 542, 542, 111.0, 1.0, cat="python_function"),
        x("ProfilerStep#4", 542, 542, 200.0, 100.0, cat="user_annotation"),
        x("late_kernel", 2, 7, 250.0, 5.0, cat="kernel", correlation=78),
        x("overhead", -1, 0, 120.0, 1.0, cat="overhead"),
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 90.0, "dur": 300.0},
        {"ph": "i", "s": "g", "name": "Iteration Start", "pid": "Traces", "tid": "Trace PyTorch Profiler", "ts": 100.0},
    ]


def run(events, rank=3, base=1000, base_out=0, **opts):
    sel = RankEvents(copy.deepcopy(events), base, MergeOptions(**opts), f"rank{rank}.json (rank {rank})")
    head, body = rewrite(sel, rank, base_out)
    return orjson.loads(orjson.dumps(head + body))


def names(out):
    return {ev["pid"]: ev["args"]["name"] for ev in out if ev["ph"] == "M" and ev["name"] == "process_name"}


def test_pid_slots_are_sorted_host_device_string_overhead_and_named():
    out = run(gpu_rank())
    assert names(out) == {
        out_pid(3, 0): "rank 3 · CPU (pid 542)",
        out_pid(3, 1): "rank 3 · GPU 2",
        out_pid(3, 3): "rank 3 · Spans",
        out_pid(3, 4): "rank 3 · Traces",
        out_pid(3, 5): "rank 3 · CPU overhead",
    }  # slot 2 (GPU 5) has no events and is dropped
    sort = {ev["pid"]: ev["args"]["sort_index"] for ev in out if ev["name"] == "process_sort_index"}
    assert sort[out_pid(3, 0)] == 3 * 64 and sort[out_pid(3, 5)] == 3 * 64 + 5


def test_keep_empty_processes_keeps_unused_gpus():
    out = run(gpu_rank(), keep_empty_processes=True)
    assert names(out)[out_pid(3, 2)] == "rank 3 · GPU 5"


def test_process_metadata_is_replaced_and_thread_names_deduplicated():
    out = run(gpu_rank())
    assert not [e for e in out if e["name"] == "process_labels"]
    threads = [e for e in out if e["name"] == "thread_name"]
    assert threads == [{"ph": "M", "name": "thread_name", "pid": out_pid(3, 0), "tid": 542,
                        "args": {"name": "thread 542 (python)"}}]


def test_pid_with_cpu_and_gpu_events_is_split():
    events = [x("aten::add", 1, 1, 10.0), x("kern", 1, 7, 12.0, cat="kernel")]
    out = run(events)
    assert names(out) == {out_pid(3, 0): "rank 3 · CPU (pid 1)", out_pid(3, 1): "rank 3 · GPU 1"}
    assert {e["name"]: e["pid"] for e in out if e["ph"] == "X"} == {"aten::add": out_pid(3, 0),
                                                                    "kern": out_pid(3, 1)}


@pytest.mark.parametrize("args, on_device", [
    pytest.param({"stream": 4}, True, id="int-stream"),
    pytest.param({"stream": 0, "wait_on_stream": 3}, True, id="stream-0"),
    pytest.param({"stream": "4"}, False, id="string-stream"),
    pytest.param({"stream": 4.0}, False, id="float-stream"),
    pytest.param({"stream": True}, False, id="bool-stream"),
    pytest.param({"stream_id": 4}, False, id="stream_id-is-not-a-stream"),
    pytest.param({}, False, id="no-stream"),
])
@pytest.mark.parametrize("cat", ["mtia_ccp_events", "npu_events"])
def test_an_unknown_category_runs_on_the_device_where_args_name_an_integer_stream(cat, args, on_device):
    """MTIA's mtia_ccp_events, and any accelerator's category the vocabulary does not know: device work by its
    args.stream; host categories (mtia_runtime here) stay with the host whatever their args say."""
    events = [x("launch", 17, 2, 10.0, cat="mtia_runtime", stream=4), x("work", 17, 5, 12.0, cat=cat, **args)]
    out = run(events)
    pid = {e["name"]: e["pid"] for e in out if e["ph"] == "X"}
    assert names(out)[pid["launch"]] == "rank 3 · CPU (pid 17)"
    assert names(out)[pid["work"]] == ("rank 3 · GPU 17" if on_device else "rank 3 · CPU (pid 17)")


@pytest.mark.parametrize("event, kept", [
    pytest.param(x("record_param_comms", 1, 1, 10.0), True, id="collective-call"),
    pytest.param(x("nccl:all_reduce", 1, 1, 10.0, cat="user_annotation"), True, id="nccl-annotation"),
    pytest.param(x("gloo:all_reduce", 1, 1, 10.0, cat="user_annotation"), True, id="gloo-annotation"),
    pytest.param(x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 2, 7, 10.0,
                   cat="kernel"), True, id="nccl-dev-kernel"),
    pytest.param(x("rcclGenericKernel", 2, 7, 10.0, cat="kernel"), True, id="rccl-kernel"),
    pytest.param(x("fused_allreduce", 2, 7, 10.0, cat="kernel", **{"Collective name": "allreduce"}), True,
                 id="kernel-with-collective-name"),
    pytest.param(x("gemm", 2, 7, 10.0, cat="kernel"), False, id="compute-kernel"),
    pytest.param(x("ncclCommInitRank", 1, 1, 10.0, cat="cuda_runtime"), False, id="host-call-named-nccl"),
    pytest.param(x("aten::mm", 1, 1, 10.0, **{"Collective name": "allreduce"}), False,
                 id="host-op-with-collective-name"),
])
def test_keep_comm_asks_the_vocabulary(event, kept):
    assert bool([e for e in run([event], keep=frozenset({"comm"})) if e["ph"] == "X"]) is kept


def test_time_is_aligned_exactly_to_the_output_base():
    events = [x("a", 1, 1, 4462667662984.309, 39.018)]
    sel = RankEvents(events, 1790857026000000000, MergeOptions(annotate_rank=True), "r")
    raw = orjson.dumps(rewrite(sel, 3, 1790857026000000000 - 5_000_000_001)[1][-1])
    assert b'"ts":4462672662984.31,' in raw and b'"dur":39.018' in raw and b'"rank":3' in raw


def test_negative_time_is_refused():
    with pytest.raises(MergeError, match="before the merged base time"):
        run([x("a", 1, 1, 1.0)], base=0, base_out=5000)


@pytest.mark.parametrize(
    "rank, ids, expected",
    [
        pytest.param(3, [77, 77], [(3 << 32) | 77] * 2, id="shifted"),
        pytest.param(0, [5, 5], [5, 5], id="rank0"),
        pytest.param(2, [2**40, 2**40, 9, 9], [(2 << 32) | 1, (2 << 32) | 1, 2 << 32, 2 << 32], id="dense-uint64"),
        pytest.param(1, ["0x1f", "0x1f"], [1 << 32, 1 << 32], id="dense-string"),
    ],
)
def test_flow_ids(rank, ids, expected):
    events = []
    for k, fid in enumerate(ids):
        ph = "s" if k % 2 == 0 else "f"
        events.append(x(f"e{k}", 1, 1, 10.0 + k))
        events.append(flow(ph, fid, 1, 1, 10.0 + k))
    out = run(events, rank=rank)
    assert [e["id"] for e in out if e["ph"] in "sf"] == expected


def test_flow_is_dropped_when_one_end_is_dropped():
    out = run(gpu_rank(), keep=frozenset({"gpu"}))
    assert not [e for e in out if e["ph"] in "sf"]
    assert {e["name"] for e in out if e["ph"] == "X"} == {"gemm_kernel", "late_kernel"}


def test_orphan_flow_ends_in_the_input_are_kept():
    events = [x("k", 0, 7, 10.0, cat="kernel"), flow("f", 4, 0, 7, 10.0)]
    assert [e["ph"] for e in run(events) if e["ph"] in "sf"] == ["f"]


def test_python_function_dropped_unless_included():
    assert "python_fn" not in {e["name"] for e in run(gpu_rank())}
    assert "python_fn" in {e["name"] for e in run(gpu_rank(), include_pyfunc=True)}


def test_steps_keep_gpu_events_by_their_launch():
    out = run(gpu_rank(), steps=(3, 3))
    kept = {e["name"] for e in out if e["ph"] == "X"}
    assert {"ProfilerStep#3", "aten::mm", "gemm_kernel"} <= kept
    assert not kept & {"ProfilerStep#4", "late_kernel", "PyTorch Profiler (0)"}
    assert sorted(e["cat"] for e in out if e["ph"] in "sf") == ["ac2g", "ac2g", "fwdbwd", "fwdbwd"]


@pytest.mark.parametrize(
    "keep, expected",
    [
        ({"gpu"}, {"gemm_kernel", "late_kernel"}),
        ({"comm"}, set()),
        ({"cpu"}, {"ProfilerStep#3", "aten::mm", "cudaLaunchKernel", "fwd", "bwd", "ProfilerStep#4", "overhead",
                   "PyTorch Profiler (0)"}),
    ],
)
def test_keep_presets(keep, expected):
    assert {e["name"] for e in run(gpu_rank(), keep=frozenset(keep)) if e["ph"] == "X"} == expected


def test_filter_fn_sees_raw_events():
    seen = []

    def fn(ev):
        seen.append(ev["pid"])
        return ev["name"] != "aten::mm"

    out = run(gpu_rank(), filter_fn=fn)
    assert "aten::mm" not in {e["name"] for e in out}
    assert 542 in seen and "Spans" in seen


def test_global_instants_become_process_scoped():
    (inst,) = [e for e in run(gpu_rank()) if e["ph"] == "i"]
    assert inst["s"] == "p" and inst["pid"] == out_pid(3, 4) and type(inst["tid"]) is int


def test_rewrite_ids_keeps_raw_values():
    out = run(gpu_rank(), rewrite_ids=True)
    (kern,) = [e for e in out if e["name"] == "gemm_kernel"]
    assert kern["args"]["correlation"] == (3 << 32) | 77 and kern["args"]["correlation_raw"] == 77
    assert kern["args"]["External id"] == (3 << 32) | 9 and kern["args"]["External id_raw"] == 9
    assert "correlation_raw" not in [e for e in run(gpu_rank()) if e["name"] == "gemm_kernel"][0]["args"]


@pytest.mark.parametrize(
    "event, message",
    [
        pytest.param({"ph": "X", "pid": 1, "tid": 1, "ts": "12.5", "dur": 1}, "ts='12.5'", id="string-ts"),
        pytest.param({"ph": "X", "pid": [1], "tid": 1, "ts": 1.0}, "pid=[1]", id="list-pid"),
        pytest.param({"ph": "X", "pid": 1, "tid": 1, "ts": 1.0, "dur": "3"}, "bad dur='3'", id="string-dur"),
        pytest.param({"ph": "B", "pid": 1, "tid": 1, "ts": 1.0, "dur": -3.0}, "negative dur=-3.0 on a ph='B' event", id="negative-dur-of-b"),
        pytest.param({"ph": "X", "pid": 1, "tid": 1, "ts": float("nan")}, "ts=nan", id="nan"),
        pytest.param({"ph": "X", "pid": 1, "tid": 1, "ts": float("inf")}, "ts=inf", id="inf"),
        pytest.param({"ph": 5, "pid": 1, "tid": 1, "ts": 1.0}, "ph=5", id="int-ph"),
        pytest.param({"ph": "s", "pid": 1, "tid": 1, "ts": 1.0, "id": 1.5}, "id=1.5", id="float-id"),
        pytest.param({"ph": "X", "pid": 1, "tid": {"a": 1}, "ts": 1.0}, "tid=", id="dict-tid"),
        pytest.param([1, 2], "not an object", id="not-object"),
    ],
)
def test_bad_fields_name_the_file_rank_and_event(event, message):
    with pytest.raises(TraceFormatError, match="rank3.json \\(rank 3\\): event #1") as e:
        run([x("ok", 1, 1, 1.0), event])
    assert message in str(e.value)


def test_args_values_pass_through_untouched():
    big = 2**64 - 1
    out = run([x("c10d::allreduce_", 1, 1, 1.0, **{"Comms Id": big, "Seq": 3})])
    assert out[-1]["args"] == {"Comms Id": big, "Seq": 3}
    out = run([x("c10d::allreduce_", 1, 1, 1.0, **{"Comms Id": big, "Seq": 3})], annotate_rank=True)
    assert out[-1]["args"] == {"Comms Id": big, "Seq": 3, "rank": 3}


def test_too_many_processes_is_a_clear_error():
    with pytest.raises(MergeError, match="65 distinct processes"):
        run([x("a", p, 1, 1.0) for p in range(65)])


def test_shifted_times_are_written_as_exact_text():
    rng = random.Random(3)
    events = [x(f"e{k}", 1, 1, rng.randrange(10**9, 8 * 10**12) / 1000) for k in range(3000)]
    shift = 7889238 * 10**9 + 1  # another base quarter, plus 1 ns
    want = [to_ns(e["ts"]) + shift for e in events]
    sel = RankEvents(copy.deepcopy(events), shift, MergeOptions(), "r")
    text = orjson.dumps(rewrite(sel, 0, 0)[1])
    import json

    got = [int(Decimal(e["ts"]) * 1000) for e in json.loads(text, parse_float=Decimal) if e["ph"] == "X"]
    assert got == want


def test_times_beyond_2_43_us_use_padded_text():
    sel = RankEvents([x("a", 1, 1, 1.0)], 9 * 10**18, MergeOptions(), "r")
    assert b'"ts":9000000000000001.000' in orjson.dumps(rewrite(sel, 0, 0)[1])
