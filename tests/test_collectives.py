"""Collectives: per-rank calls, cross-rank matching, wait and skew, the straggler verdict and clock offsets."""
from __future__ import annotations

import pickle

import pandas as pd
import pytest
from conftest import shared, write_trace

from tracefuse_dask import analyze
from tracefuse_dask.analysis.cross_rank.collectives import instance_metrics, match_collectives
from tracefuse_dask.analysis.per_rank.rank import analyze_rank
from tracefuse_dask.kineto.collectives import canonical_op, group_spec
from tracefuse_dask.kineto.vocabulary import is_collective_call, is_comm_kernel, kernel_type
from tracefuse_dask.synth import make_rank_trace

HOST = 100


def x(name, ts, dur, tid=1, cat="cpu_op", **args):
    ev = {"ph": "X", "cat": cat, "name": name, "pid": HOST, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = args
    return ev


def nccl_call(ts, kernel_ts, kernel_dur, corr, *, seq=None, pg="0", nelems=1024, ranks="[0, 1]"):
    """c10d::allreduce_ > record_param_comms > nccl:all_reduce > cudaLaunchKernel, and its NCCL kernel."""
    params = {"Collective name": "allreduce", "Process Group Name": pg, "Process Group Description": "default_pg",
              "Process Group Ranks": ranks, "Group size": 2, "dtype": "Float", "In msg nelems": nelems,
              "Out msg nelems": nelems, "Rank": 0}
    if seq is not None:
        params["Seq"] = seq
    return [
        x("c10d::allreduce_", ts, 50),
        x("record_param_comms", ts + 1, 40, **params),
        x("nccl:all_reduce", ts + 2, 30, cat="user_annotation"),
        x("cudaLaunchKernel", ts + 3, 5, cat="cuda_runtime", correlation=corr),
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 20,
         "ts": kernel_ts, "dur": kernel_dur, "args": {"stream": 20, "correlation": corr}},
    ]


def test_symmetric_memorys_collectives_and_their_kernels():
    """PyTorch's symm_mem collectives are collective calls, its helpers are not; their kernels (as
    torch/csrc/distributed/c10d/symm_mem names them) are communication, in HTA's kernel types too."""
    calls = ("multimem_all_reduce_", "multimem_one_shot_all_reduce", "multimem_one_shot_reduce_out",
             "multimem_all_gather_out", "one_shot_all_reduce_out", "two_shot_all_reduce_", "reduce_scatter_out",
             "all_to_all_vdev")
    helpers = ("memset32_", "stream_write_value32_", "_async_input_mm", "get_remote_tensors",
               "fused_all_gather_matmul", "nvshmem_put")
    assert all(is_collective_call(f"symm_mem::{n}") for n in calls)
    assert not any(is_collective_call(f"symm_mem::{n}") for n in helpers)
    assert {canonical_op(f"symm_mem::{n}") for n in calls[:2]} == {"allreduce"}
    assert canonical_op("symm_mem::multimem_one_shot_reduce_out") == "reduce"  # to one root
    assert canonical_op("symm_mem::multimem_all_gather_out") == "allgather"
    kernels = ("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)",
               "void c10d::symmetric_memory::multimem_one_shot_reduce_kernel<float, 16>(float*)",
               "one_shot_all_reduce_kernel<float>", "two_shot_all_reduce_kernel_inplace<float>",
               "multimem_all_gather_kernel")
    assert all(is_comm_kernel(k) and kernel_type(k) == "COMMUNICATION" for k in kernels)
    for other in ("void at::native::reduce_kernel<512, 1>", "one_shot_gemm_kernel", "all_reduce_sum_kernel"):
        assert not is_comm_kernel(other) and kernel_type(other) == "COMPUTATION"


def test_canonical_op_names():
    assert {canonical_op(n) for n in ("c10d::allreduce_", "nccl:all_reduce", "allreduce", "gloo:all_reduce")} == {
        "allreduce"}
    assert canonical_op("c10d::_allgather_base_") == canonical_op("nccl:_all_gather_base") == "allgather"
    assert canonical_op("c10d::_reduce_scatter_base_") == canonical_op("reduce_scatter_tensor") == "reducescatter"
    assert canonical_op("c10d::alltoall_base_") == canonical_op("nccl:all_to_all") == "alltoall"
    assert canonical_op("c10d::barrier") == "barrier"


def test_a_call_gathers_args_over_its_chain_and_its_kernel():
    events = [x("ProfilerStep#5", 0, 1000, cat="user_annotation"), *nccl_call(100, 110, 20, 7, seq=3)]
    calls = analyze_rank(events, 0, "r0.json", base=10**9).tables["collectives"]
    assert len(calls) == 1
    c = calls.iloc[0]
    assert (c["op"], c["name"], c["pg_name"], c["group_ranks"], c["dtype"]) == (
        "allreduce", "c10d::allreduce_", "0", "0-1", "Float")
    assert (c["in_nelems"], c["in_bytes"], c["seq"], c["step"]) == (1024, 4096, 3, 5)
    assert (c["cpu_start_ns"], c["gpu_start_ns"], c["gpu_end_ns"], c["stream"]) == (
        10**9 + 100_000, 10**9 + 110_000, 10**9 + 130_000, 20)


def test_a_kernel_without_a_launch_belongs_to_no_call():
    """An NCCL kernel whose launch is unknown (no correlation, no flow) gives no call its GPU times, even when the
    file's last X event is a call's own event (an index of -1 once read the launch as that event)."""
    events = [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 20,
               "ts": 110, "dur": 20, "args": {"stream": 20}}, *nccl_call(100, 110, 20, 7)[:4][::-1]]
    calls = analyze_rank(events, 0, "r0.json").tables["collectives"]
    assert len(calls) == 1
    assert calls["gpu_start_ns"].isna().all() and calls["stream"].isna().all()


def test_a_rank_of_a_big_job_holds_its_groups_as_rank_specs():
    """A 10,000-rank job's groups cost a few bytes per call, not the 59 kB of their full lists."""
    world = list(range(10_000))
    events = [*nccl_call(100, 110, 20, 1, ranks=str(world)), *nccl_call(300, 310, 20, 2, pg="5"),
              *nccl_call(500, 510, 20, 3, ranks="[" + ", ".join(map(str, range(30))) + ", ...]")]
    for e in events:
        if e["name"] == "record_param_comms":
            e["args"]["Group size"] = 10_000
    del events[6]["args"]["Process Group Ranks"], events[6]["args"]["Group size"]  # pg 5: only in pg_config
    pgs = [{"pg_name": "0", "ranks": world}, {"pg_name": "5", "ranks": world[3::8]}]
    rt = analyze_rank(events, 3, "r3.json", header={"distributedInfo": {"rank": 3, "pg_config": pgs}})
    calls = rt.tables["collectives"]
    # the full list, pg_config alone, and Kineto's first 30 ranks and "..." (pg_config has them all)
    assert calls["group_ranks"].tolist() == ["0-9999", "3-9995:8", "0-9999"]
    assert calls["group_size"].tolist() == [10_000, 1250, 10_000]
    assert rt.pg_config == {"0": "0-9999", "5": "3-9995:8"}
    assert len(pickle.dumps(rt)) < 30_000  # its tables; the full lists alone would add 59 kB


@pytest.mark.parametrize("ranks, spec", [
    ("[0, 1, 2]", "0-2"), ([5, 3, 4], "3-5"), ('"[0, 2]"', None), ("[]", None), ("[-1]", None), ([True], None),
    ("[0, 1, ..., 29, ...]", None), (None, None), ("abc", None), ([[1]], None),
])
def test_group_spec_takes_lists_of_ranks_only(ranks, spec):
    assert group_spec(ranks) == spec


def test_a_group_known_only_from_pg_config_reports_its_missing_rank():
    """Ranks 0 and 1 call twice, rank 2 of the same 3-rank group once: the second call lacks it, found
    through the reduce tasks' join (in any order of tasks) and the group's rank spec from pg_config."""
    from tracefuse_dask.analysis.cross_rank.critical_path import walks_in
    from tracefuse_dask.analysis.per_rank.rank import rows_for
    from tracefuse_dask.analysis.reduce import reduce_ranks
    from tracefuse_dask.analysis.schema import TABLES, AnalyzeRequest
    from tracefuse_dask.analysis.tasks import batch, combine
    from tracefuse_dask.analysis.transport import as_text, join_parts

    def rank(r, calls):
        events = [e for k in range(calls) for e in nccl_call(100 + 200 * k, 110 + 200 * k, 20, k + 1)]
        for e in events:
            e.get("args", {}).pop("Process Group Ranks", None)
        header = {"distributedInfo": {"rank": r, "pg_config": [{"pg_name": "0", "ranks": [0, 1, 2]}]}}
        return analyze_rank(events, r, f"r{r}.json", header=header)

    ranks = [rank(0, 2), rank(1, 2), rank(2, 1)]
    files = [{"ranks": [rt], "world_size": 3, "notes": [], "repaired": [], "parts": []} for rt in ranks]
    # as reduce tasks send them: text columns as categoricals, joined by the client over their categories
    results = [combine([batch(files[2:])], coded=True), combine([batch([{"ignored": "x.txt: ignored"}])],
                                                                   coded=True),
               combine([batch(files[:1]), batch(files[1:2])], coded=True)]
    segments = join_parts([res["tables"]["path_segments"] for res in results])
    a = reduce_ranks(results, lambda wanted: walks_in(segments, wanted), [], AnalyzeRequest())
    assert a.summary["ignored"] == ["x.txt: ignored"] and a.summary["collectives"]["matched"] == 1
    assert a.summary["collectives"]["problem_examples"] == [
        "unmatched allreduce #1 of group 0: no call from rank(s) [2]"]
    for name in TABLES:  # with their text in Python storage (``as_text``)
        pd.testing.assert_frame_equal(getattr(a, name), as_text(rows_for(ranks, name)))


def calls_of(rank, events, base=0, pgs=None):
    header = {"distributedInfo": {"rank": rank, "pg_config": pgs or [{"pg_name": "0", "ranks": [0, 1]}]}}
    t = analyze_rank(events, rank, f"r{rank}.json", base=base, header=header).tables["collectives"]
    return t.assign(rank=rank)


def test_matching_uses_seq_and_reports_missing_and_inconsistent_calls():
    r0 = calls_of(0, [*nccl_call(100, 110, 20, 1, seq=1), *nccl_call(300, 310, 20, 2, seq=2),
                      *nccl_call(500, 510, 20, 3, seq=3, nelems=8)])
    r1 = calls_of(1, [*nccl_call(120, 125, 5, 1, seq=2), *nccl_call(400, 410, 20, 2, seq=3)])
    matched, problems = match_collectives(pd.concat([r0, r1], ignore_index=True), {"0": {0, 1}})
    # seq 2 matches rank 0's second call with rank 1's first; seq 3 disagrees on size; seq 1 lacks rank 1
    assert sorted(matched["seq"].tolist()) == [2, 2]
    assert any(p.startswith("inconsistent allreduce #3 of group 0") and "rank 0: allreduce 8" in p for p in problems)
    assert any(p.startswith("unmatched allreduce #1 of group 0: no call from rank(s) [1]") for p in problems)


def test_wait_skew_latency_and_bandwidth_of_one_instance():
    r0 = calls_of(0, nccl_call(100, 110, 120, 1))  # GPU arrives at 110, ends at 230
    r1 = calls_of(1, nccl_call(100, 200, 30, 1))  # GPU arrives at 200, ends at 230: rank 1 is last
    matched, problems = match_collectives(pd.concat([r0, r1], ignore_index=True), {"0": {0, 1}})
    assert not problems
    inst, waits = instance_metrics(matched, {})
    row = inst.iloc[0]
    assert (row["skew_us"], row["last_rank"], row["comm_latency_us"], row["bytes"]) == (90, 1, 30, 4096)
    assert row["algbw_gbps"] == pytest.approx(4096 / 30_000)
    assert row["busbw_gbps"] == pytest.approx(4096 / 30_000 * 2 * (2 - 1) / 2)
    assert waits.set_index("rank")["wait_us"].to_dict() == {0: 90, 1: 0}


def test_a_rank_takes_part_only_in_its_groups():
    pgs = [{"pg_name": "0", "ranks": [0, 1, 2]}, {"pg_name": "1", "ranks": [0, 2]}]
    sub = dict(pg="1", ranks="[0, 2]")
    r0 = calls_of(0, [*nccl_call(100, 110, 20, 1, **sub)], pgs=pgs)
    r1 = calls_of(1, [], pgs=pgs[:1])
    r2 = calls_of(2, [*nccl_call(100, 112, 18, 1, **sub)], pgs=pgs)
    matched, problems = match_collectives(pd.concat([r0, r1, r2], ignore_index=True), {"0": {0, 1, 2}, "1": {0, 2}})
    assert not problems and sorted(matched["rank"]) == [0, 2]


@pytest.mark.integration
def test_gloo_straggler_is_named(client):
    a = analyze(str(shared("gloo_4ranks")), client=client)
    verdict = a.summary["straggler"]
    assert verdict["rank"] == 2 and verdict["confidence"] >= 0.5 and verdict["pattern"] == "chronic"
    assert verdict["evidence"].startswith("rank 2 is the straggler, chronic: late in 2 of 2 steps; fixing it would ")
    # the shared job's rank 2 sleeps 40 ms in every step: fixing it saves about that
    assert 30_000 < verdict["what_if"]["gain_us"] < 42_000 and verdict["cause"]["op"] == "straggler_sleep"
    assert a.summary["collectives"]["matched"] == 18 and a.summary["collectives"]["problems"] == 0
    s = a.straggler_ranks.set_index("rank")
    assert s["wait_caused_us"].idxmax() == 2 and s["own_wait_us"].idxmin() == 2
    assert set(a.collective_instances["op"]) == {"allreduce", "allgather", "broadcast", "reducescatter", "alltoall",
                                                 "barrier"}
    assert a.summary["clock_offset_us"] == {} and "need NCCL" in a.summary["clock_note"]


@pytest.mark.integration
def test_no_straggler_is_named_without_one(client):
    a = analyze(str(shared("gloo_2ranks_tb_nostraggler")), client=client)
    assert a.summary["straggler"]["rank"] is None
    assert a.summary["straggler"]["evidence"].startswith("no straggler")


@pytest.mark.integration
def test_clock_offsets_recover_shifted_clocks(client, tmp_path):
    shifts = {0: 0, 1: 250_000, 2: -1_000_000, 3: 0, 4: 20_000_000, 5: 0}  # rank 4 looks 20 ms late
    for r, shift in shifts.items():
        doc = make_rank_trace(r, len(shifts), target_bytes=200_000, clock_shift_ns=shift, straggler=3)
        doc["host_name"] = f"node{r // 2}"
        write_trace(tmp_path / f"rank{r}.json", doc)
    a = analyze(str(tmp_path), client=client)
    offsets = a.summary["clock_offset_us"]
    for r, shift in shifts.items():
        assert offsets[str(r)] == pytest.approx(shift / 1e3, abs=2.0), r
    assert set(a.summary["clock_offset_by_host"]) == {"node0", "node1", "node2"}
    assert a.summary["straggler"]["rank"] == 3  # found after the clocks are corrected
    assert (a.collective_instances["last_rank"] == 3).all()


@pytest.mark.integration
def test_merge_align_collectives_lines_up_the_nccl_kernels(client, tmp_path):
    import gzip

    import orjson

    from tracefuse_dask import merge_traces
    from tracefuse_dask.cli import main

    shifts = {0: 0, 1: 3_000_000, 2: -750_000}
    for r, shift in shifts.items():
        doc = make_rank_trace(r, 3, target_bytes=150_000, clock_shift_ns=shift)
        write_trace(tmp_path / "in" / f"rank{r}.json", doc)

    def kernel_ends(path):
        events = orjson.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        ends: dict[int, list[float]] = {}
        for ev in events:
            if ev.get("cat") == "kernel" and ev["name"].startswith("ncclDevKernel"):
                ends.setdefault((ev["pid"] - 2**22) // 64, []).append(ev["ts"] + ev["dur"])
        return {r: sorted(v) for r, v in ends.items()}

    merge_traces(str(tmp_path / "in"), str(tmp_path / "plain.json.gz"), client=client)
    plain = kernel_ends(tmp_path / "plain.json.gz")
    assert plain[1][0] - plain[0][0] == pytest.approx(3000, abs=2)  # µs: the shifted clock shows
    summary = merge_traces(str(tmp_path / "in"), str(tmp_path / "aligned.json.gz"), client=client, align="collectives")
    aligned = kernel_ends(tmp_path / "aligned.json.gz")
    for r in (1, 2):
        assert aligned[r] == pytest.approx(aligned[0], abs=2)
    assert any("rank 1 shifted by -3,000" in w for w in summary.warnings)
    meta = orjson.loads(gzip.decompress((tmp_path / "aligned.json.gz").read_bytes()))["metadata"]["tracefuse"]
    assert meta["options"]["align"] == "collectives" and meta["clock_offsets_ns"]["1"] == pytest.approx(3e6, abs=2e3)
    assert main(["merge", str(tmp_path / "in"), "-o", str(tmp_path / "cli.json.gz"), "--align", "collectives",
                 "--workers", "1", "-q"]) == 0
    assert (tmp_path / "cli.json.gz").read_bytes() == (tmp_path / "aligned.json.gz").read_bytes()
