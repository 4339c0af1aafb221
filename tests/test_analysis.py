"""Per-rank analysis: pure rules on hand-built traces, then ``analyze`` end to end on real clusters."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from conftest import make_trace, shared, write_trace
from tracefuse_dask import TraceFormatError, analyze, merge_traces
from tracefuse_dask.analysis import Analysis, rank_stats
from tracefuse_dask.cli import main
from tracefuse_dask.errors import OutputExistsError, RankError
from tracefuse_dask.kineto.vocabulary import kernel_category, kernel_type
from tracefuse_dask.analysis.per_rank.ops import LAUNCHER_COLUMNS, _launchers
from tracefuse_dask.analysis.per_rank.rank import analyze_rank, union_length
from tracefuse_dask.analysis.per_rank.decode import Args
from tracefuse_dask.synth import write_example

import numpy as np

HOST, TID, GPU = 100, 1, 0


def x(name, ts, dur, *, cat="cpu_op", pid=HOST, tid=TID, **args):
    ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = {k.replace("_", " ") if k == "External_id" else k: v for k, v in args.items()}
    return ev


def launch(ts, dur, corr):
    return x("cudaLaunchKernel", ts, dur, cat="cuda_runtime", correlation=corr)


def kernel(name, ts, dur, stream, corr=None, cat="kernel"):
    args = {"stream": stream, "device": 0}
    if corr is not None:
        args["correlation"] = corr
    return {"ph": "X", "cat": cat, "name": name, "pid": GPU, "tid": stream, "ts": ts, "dur": dur, "args": args}


def small_rank() -> list[dict]:
    """One step: a GEMM, an NCCL kernel overlapping it by 5 µs, an elementwise kernel and a memcpy."""
    return [
        x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        x("aten::mm", 10, 20, **{"Input Dims": [[8, 16], [16, 4]], "Input type": ["float", "float"]}),
        launch(12, 2, 1),
        x("record_param_comms", 40, 10),
        launch(41, 2, 2),
        x("aten::add", 60, 10),
        launch(61, 1, 3),
        kernel("gemm_kernel", 20, 30, 7, 1),
        kernel("ncclDevKernel_AllReduce_Sum_f32", 45, 35, 8, 2),
        kernel("vectorized_elementwise_kernel", 85, 5, 7, 3),
        kernel("Memcpy HtoD (Pageable -> Device)", 95, 2, 7, cat="gpu_memcpy"),
    ]


def test_union_length_merges_overlaps_and_touching_intervals():
    s = np.array([5, 0, 20, 10, 30], dtype=np.int64)
    e = np.array([15, 10, 25, 12, 30], dtype=np.int64)
    assert union_length(s, e) == 15 + 5
    assert union_length(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)) == 0


def test_kernel_types_follow_hta_names():
    assert kernel_type("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "COMMUNICATION"
    assert kernel_type("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t") == "COMMUNICATION"
    assert kernel_type("Memcpy DtoD (Device -> Device)") == "MEMORY"
    assert kernel_type("Memset (Device)") == "MEMORY"
    assert kernel_type("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm>") == "COMPUTATION"
    assert kernel_type("cudaStreamSync") == "OTHER"
    assert kernel_category("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "kernel") == "GEMM"
    assert kernel_category("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "kernel") == "attention"
    assert kernel_category("ncclDevKernel_AllReduce_Sum_f32", "kernel") == "communication"
    assert kernel_category("Memcpy HtoD", "memcpy") == "memory"
    assert kernel_category("triton_poi_fused_add_0", "kernel") == "elementwise"
    assert kernel_category("triton_red_fused_sum_1", "kernel") == "reduce"
    assert kernel_category("my_custom_thing", "kernel") == "other"


def test_breakdown_of_a_hand_built_rank():
    rt = analyze_rank(small_rank(), 3, "r3.json")
    b = rt.numbers
    assert b["gpu_span_us"] == 77  # 20 .. 97
    assert b["idle_us"] == 10  # gaps 80-85 and 90-95
    assert b["computation_us"] == 35  # gemm 30 + elementwise 5
    assert b["communication_us"] == 35
    assert b["memcpy_us"] == 2 and b["memset_us"] == 0
    assert b["exposed_comm_us"] == 30  # 45-50 overlaps the GEMM
    assert b["comm_comp_overlap_pct"] == pytest.approx(100 * 5 / 35)
    assert b["non_compute_us"] == 77 - 35 - 10
    assert b["kernel_count"] == 4
    step = rt.tables["breakdown_by_step"]
    assert step["step"].tolist() == [1] and step["step_us"].tolist() == [100]
    assert step["idle_us"].tolist() == [10]
    assert rt.steps == [1]


def test_gpu_time_goes_to_ops_and_launchers_through_the_tree():
    rt = analyze_rank(small_rank(), 0, "r0.json")
    ops = rt.tables["ops"].set_index("name")
    assert "ProfilerStep#1" not in ops.index
    assert ops.loc["record_param_comms", "gpu_time_us"] == 35
    assert ops.loc["aten::mm", "gpu_time_us"] == 30
    assert ops.loc["aten::mm", "top_kernels"] == "gemm_kernel"
    assert ops.loc["aten::add", "kernel_count"] == 1
    assert ops.loc["aten::mm", "gpu_pct"] == pytest.approx(100 * 30 / 72)
    launchers = rt.tables["kernel_launchers"].set_index("name")
    assert launchers.loc["aten::mm", "input_dims"] == "[[8,16],[16,4]]"
    assert launchers.loc["aten::mm", "input_types"] == '["float","float"]'
    kernels = rt.tables["kernels"].set_index("name")
    assert kernels.loc["gemm_kernel", "pct"] == pytest.approx(100 * 30 / 72)
    assert kernels.loc["gemm_kernel", "category"] == "GEMM"


def test_launchers_group_leaf_ops_by_json_text_and_rank_kernels_as_a_loop_would_meet_them():
    """Kernels per (leaf op, input shapes, types): two spellings of one JSON value, or null and absent, are one
    group; groups come in the order of their first kernel, and ties among a group's kernels go to the one met first,
    leaf by leaf."""
    from msgspec import Raw

    names = np.array(["aten::mm", "aten::add", "k_a", "k_b", "k_c", "k_d"], dtype=object)
    code_at = np.array([1, 0, 0, 0, 1])  # each position's name code
    order = np.array([10, 11, 12, 13, 14])  # each position's event
    args = [Args()] * 10 + [Args(input_dims=Raw(b"[[8],[8]]")), Args(input_dims=Raw(b"[[8, 16]]")),
                             Args(input_dims=Raw(b"[[8,16]]"), input_types=Raw(b"null")),
                             Args(input_dims=Raw(b"[ [8,16] ]")), Args(input_dims=Raw(b"[[8],[8]]"))]
    # per kernel launched: its leaf's position, name code and ns; position 1's kernels come first, then 0's
    leaf = np.array([1, -1, 0, 1, 2, 0, 4, 3, 3])
    kernel = np.array([3, 2, 4, 3, 5, 2, 2, 5, 3])
    ns = np.array([5, 100, 7, 5, 4, 1, 6, 2, 2])
    got = _launchers(leaf, kernel, ns, order, code_at, names, args)
    assert got.columns.tolist() == LAUNCHER_COLUMNS
    assert got["name"].tolist() == ["aten::mm", "aten::add"]
    assert got["input_dims"].tolist() == ["[[8,16]]", "[[8],[8]]"] and got["input_types"].tolist() == ["", ""]
    assert got["count"].tolist() == [3, 2] and got["kernel_count"].tolist() == [5, 3]
    assert got["gpu_time_us"].tolist() == [18 / 1e3, 14 / 1e3]
    # aten::add: k_c 7 and k_a 1 + 6 tie; k_c was met first (a code order would put k_a first)
    assert got["top_kernels"].tolist() == ["k_b | k_d", "k_c | k_a"]
    empty = _launchers(np.array([-1]), np.array([2]), np.array([3]), order, code_at, names, args)
    assert empty.columns.tolist() == LAUNCHER_COLUMNS and empty.empty


def test_idle_breakdown_follows_hta():
    idle = analyze_rank(small_rank(), 0, "r0.json").tables["idle"].set_index("stream")
    # stream 7: gap 50->85 while the launch came at 61 > 50 (host wait); 90->95 is under 30 µs (kernel wait)
    assert idle.loc[7, "host_wait_us"] == 35 and idle.loc[7, "kernel_wait_us"] == 5 and idle.loc[7, "other_us"] == 0
    assert idle.loc[7, "host_wait_pct"] == pytest.approx(100 * 35 / 40)
    assert idle.loc[8, "idle_us"] == 0
    # launched early, but the kernel starts 40 µs after the previous one ended: waiting on something else
    events = [launch(0, 1, 1), launch(0.5, 1, 2), kernel("k1", 10, 5, 7, 1), kernel("k2", 55, 5, 7, 2),
              kernel("Stream Sync", 70, 5, 7, cat="cuda_sync")]
    idle = analyze_rank(events, 0, "r.json").tables["idle"].set_index("stream")
    assert idle.loc[7, "other_us"] == 40 and idle.loc[7, "idle_us"] == 40  # the sync is not a kernel here


def test_call_tree_handles_equal_times_zero_durations_and_deep_nesting():
    n = 20_000  # far beyond Python's recursion limit
    events = [x(f"op{i}", i, 2 * n - 2 * i) for i in range(n)]
    events += [launch(n, 0.5, 1), kernel("deep_kernel", 3 * n, 7, 7, 1)]
    ops = analyze_rank(events, 0, "deep.json").tables["ops"].set_index("name")
    assert (ops["gpu_time_us"] == 7).all() and len(ops) == n
    same = [x("outer", 0, 10), x("inner", 0, 10), x("zero", 5, 0), x("after", 10, 2), launch(5, 0, 9),
            kernel("k", 20, 3, 7, 9)]
    ops = analyze_rank(same, 0, "same.json").tables["ops"].set_index("name")
    assert ops.loc["outer", "gpu_time_us"] == 3 and ops.loc["inner", "gpu_time_us"] == 3
    assert ops.loc["after", "gpu_time_us"] == 0


def test_kernels_without_correlation_link_through_ac2g_flows():
    events = [x("aten::mm", 0, 10), x("cudaLaunchKernel", 2, 1, cat="cuda_runtime"), kernel("k", 20, 4, 7)]
    events += [{"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 5, "pid": HOST, "tid": TID, "ts": 2},
               {"ph": "f", "bp": "e", "cat": "ac2g", "name": "ac2g", "id": 5, "pid": GPU, "tid": 7, "ts": 20}]
    ops = analyze_rank(events, 0, "r.json").tables["ops"].set_index("name")
    assert ops.loc["aten::mm", "gpu_time_us"] == 4


def test_bad_events_name_the_file_and_rank():
    with pytest.raises(TraceFormatError, match=r"r\.json \(rank 4\): event #1 has ts='x'"):
        analyze_rank([x("a", 0, 1), x("b", "x", 1)], 4, "r.json")


def test_rank_stats_flags_ranks_3_mads_and_10_percent_away():
    bd = pd.DataFrame({"rank": [0, 1, 2, 3], "idle_us": [10.0, 11.0, 10.5, 30.0], "kernel_count": [5, 5, 5, 5],
                       "memset_us": [100.0, 100.0, 100.0, 105.0]})
    stats = rank_stats(bd, pd.DataFrame(), pd.DataFrame(), pd.DataFrame()).set_index("metric")
    assert stats.loc["idle_us", "outlier_ranks"] == [3]
    assert stats.loc["idle_us", "note"] == "rank 3's idle_us is 2.8× the median (30.0 vs 10.8)"
    assert stats.loc["idle_us", "max_rank"] == 3 and stats.loc["idle_us", "min_rank"] == 0
    assert stats.loc["memset_us", "outlier_ranks"] == []  # 5% away: not an outlier, whatever the MAD
    assert stats.loc["kernel_count", "outlier_ranks"] == []


# ---- end to end -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("example")
    write_example(str(d), ranks=4, rank_bytes=300_000, straggler=2)
    return d


@pytest.mark.integration
def test_a_subset_of_numpy_ranks_or_a_generator_is_committed_as_plain_ranks(client, example, tmp_path):
    """The report's commit records the ranks asked for as ints, however they were given, so that
    --skip-if-unchanged compares like with like."""
    import numpy as np

    for name, ranks in (("numpy", np.arange(2)), ("generator", (r for r in (1, 0)))):
        analyze(str(example), str(tmp_path / name), client=client, ranks=ranks)
        commit = json.loads((tmp_path / name / "commit.json").read_text())
        assert commit["made_from"]["options"]["ranks"] == [0, 1], name
        assert sorted(json.loads((tmp_path / name / "summary.json").read_text())["ranks"]) == [0, 1]


@pytest.mark.integration
def test_analyze_writes_the_report_folder(client, example, tmp_path):
    out = tmp_path / "report"
    a = analyze(str(example), str(out), client=client)
    names = {p.name for p in out.iterdir()}
    tables = ["breakdown", "breakdown_by_step", "kernels", "kernel_categories", "ops", "kernel_launchers", "op_perf",
              "idle", "collectives", "rank_stats", "collective_instances", "collective_waits", "collective_summary",
              "straggler_ranks", "critical_path", "op_perf_by_category", "gpu_speed", "launch_stats", "launch_worst",
              "queue_length", "memory_bw"]
    # no such logs here, and no --kernel-sequences
    empty = ["collective_trace_calls", "collective_trace_summary", "collective_trace_hints", "kernel_sequences"]
    assert names == {f"{t}.parquet" for t in tables + empty} | {"summary.json", "report.html", "commit.json"}
    assert all(pd.read_parquet(out / f"{t}.parquet").empty for t in empty)
    for t in tables:
        df = pd.read_parquet(out / f"{t}.parquet")
        assert len(df) == len(getattr(a, t)) > 0, t
        if t in ("breakdown", "breakdown_by_step", "kernels", "kernel_categories", "ops", "kernel_launchers", "idle",
                 "collectives", "collective_waits", "straggler_ranks", "op_perf", "op_perf_by_category", "gpu_speed",
                 "launch_stats", "launch_worst", "queue_length", "memory_bw"):
            assert sorted(df["rank"].unique()) == [0, 1, 2, 3], t
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"] == [0, 1, 2, 3] and summary["gpu"] is True
    assert summary["steps"] == sorted(a.breakdown_by_step["step"].unique().tolist())
    assert set(summary["per_rank"]["2"]) >= {"gpu_span_us", "idle_us", "computation_us", "communication_us",
                                              "memcpy_us", "memset_us", "exposed_comm_us", "comm_comp_overlap_pct"}
    assert summary["per_rank"]["2"]["idle_us"] == a.breakdown.set_index("rank").loc[2, "idle_us"]
    # the example's GEMMs have shapes and a model; its rank 2 is late for host work, and its GPU is not slow
    gemm = a.op_perf[(a.op_perf["category"] == "GEMM") & a.op_perf["gflop"].notna()]
    assert set(gemm["name"]) == {"aten::addmm", "aten::mm"} and (gemm["roofline_pct"] > 0).all()
    assert summary["devices"]["ranks"] == {"B200": [0, 1, 2, 3]} and summary["roofline"]["categories"]["GEMM"]
    assert summary["slow_gpu"] == {"rank": None, "text": "no GPU is slower than the others at equal shapes: rank 2 "
                                                         "is late for what the critical path shows, not for its kernels"}
    assert not list(tmp_path.glob("*tracefuse-tmp*"))


@pytest.mark.integration
def test_a_merged_trace_is_analysed_per_rank_with_the_same_numbers(client, example, tmp_path):
    merged = tmp_path / "merged.json.gz"
    merge_traces(str(example), str(merged), client=client)
    per_file = analyze(str(example), client=client)
    from_merged = analyze(str(merged), client=client)
    for name in ("breakdown", "breakdown_by_step", "kernels", "ops", "kernel_launchers", "op_perf", "idle"):
        pd.testing.assert_frame_equal(getattr(per_file, name), getattr(from_merged, name), check_dtype=False)
    # written into the folder of the ranks it merged (as a new user did), it is passed over, as merge and info
    # pass it over, instead of each rank appearing twice
    job = tmp_path / "job"
    shutil.copytree(example, job)
    shutil.copy(merged, job / "merged.json.gz")
    beside = analyze(str(job), client=client)
    pd.testing.assert_frame_equal(beside.breakdown, per_file.breakdown)
    assert [i for i in beside.summary["ignored"] if "merged.json.gz: a trace merged by tracefuse" in i]
    with pytest.raises(RankError, match="name it on its own"):
        analyze(str(job / "merged*.json.gz"), client=client)


@pytest.mark.integration
def test_ranks_steps_csv_and_force(client, example, tmp_path):
    out = tmp_path / "r"
    a = analyze(str(example), str(out), client=client, ranks="1-2", steps="11-11", format="csv")
    assert a.breakdown["rank"].tolist() == [1, 2]
    assert a.breakdown_by_step["step"].unique().tolist() == [11]
    assert (out / "kernels.csv").is_file() and not list(out.glob("*.parquet"))
    with pytest.raises(OutputExistsError, match="pass force=True to replace it"):
        analyze(str(example), str(out), client=client)
    analyze(str(example), str(out), client=client, force=True)
    assert (out / "kernels.parquet").is_file() and not (out / "kernels.csv").exists()


@pytest.mark.integration
def test_cpu_only_gloo_trace_gets_ops_and_steps(client, tmp_path):
    a = analyze(str(shared("gloo_4ranks")), str(tmp_path / "r"), client=client)
    assert a.summary["gpu"] is False and "CPU-only" in a.summary["why_no_gpu"]
    assert a.kernels.empty and a.idle.empty
    assert a.breakdown["kernel_count"].eq(0).all() and a.breakdown["idle_us"].isna().all()
    assert {"gloo:all_reduce", "c10d::allreduce_"} <= set(a.ops["name"])
    assert sorted(a.breakdown_by_step["rank"].unique()) == [0, 1, 2, 3]
    assert any("generation_info.json" in p for p in a.summary["ignored"])
    assert "step_us_mean" in set(a.rank_stats["metric"])


@pytest.mark.integration
def test_duplicate_ranks_and_bad_files_are_clear_errors(client, tmp_path):
    write_trace(tmp_path / "in" / "a.json", make_trace(0, [x("a", 0, 1)]))
    write_trace(tmp_path / "in" / "b.json", make_trace(0, [x("b", 0, 1)]))
    with pytest.raises(RankError, match=r"rank 0 appears twice: .*a\.json and .*b\.json"):
        analyze(str(tmp_path / "in"), client=client)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "rank0.json").write_bytes(b'{"traceEvents": [{"ph": "X", "ts": 1, ')
    with pytest.raises(TraceFormatError,
                       match=r"rank0\.json \(rank 0\): not valid JSON: the file ends early.*--repair"):
        analyze(str(tmp_path / "bad"), str(tmp_path / "out"), client=client)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*tracefuse-tmp*"))


@pytest.mark.integration
def test_cli_analyze(example, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["analyze", str(example), "-o", str(out), "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "analysed 4 ranks" in err and f"wrote {out}/report.html" in err
    assert main(["analyze", str(example), "-o", str(out), "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "exists; pass --force" in err and "Traceback" not in err


@pytest.mark.integration
def test_analyze_from_s3_to_s3(client, s3, example, bucket_name):
    bucket = s3.bucket(bucket_name)
    fs = s3.fs()
    for p in sorted(example.iterdir()):
        fs.put(str(p), f"{bucket}/in/{p.name}")
    a = analyze(f"s3://{bucket}/in/", f"s3://{bucket}/report", client=client, storage_options=s3.options)
    assert a.breakdown["rank"].tolist() == [0, 1, 2, 3]
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/report"))
    assert "summary.json" in names and "report.html" in names and "ops.parquet" in names
    assert not fs.exists(f"{bucket}/report.tracefuse-tmp")


@pytest.mark.integration
def test_1024_ranks_run_in_batches_and_reduce_to_small_tables(client, tmp_path, monkeypatch):
    """Small files share tasks as the merge's do, each counted ``FILE_COST`` bytes more: 4 files of a few kB a task,
    so that both workers have work. Over ``_COMBINE`` tasks (64), the per-rank tables are joined on the cluster:
    1,024 files make 4 reduce tasks; one file a task (the batches patched in this client, which builds the graph)
    with ``_COMBINE`` 8, 128 files make 16. Under it, the client joins them, and the tables are the same."""
    from distributed import get_task_stream

    import tracefuse_dask.analysis.run
    from tracefuse_dask.analysis import FILE_COST
    from tracefuse_dask.cluster import batches

    for n in (1024, 128):
        for r in range(n):
            events = [x("ProfilerStep#1", 0, 100, cat="user_annotation"), x("aten::mm", 10, 20), launch(12, 2, 1),
                      kernel("gemm_kernel", 20, 30 + (200 if r == 17 else 0), 7, 1)]
            write_trace(tmp_path / str(n) / f"rank{r}.json", make_trace(r, events, world_size=n))

    def run(n: int) -> tuple[dict[str, int], Analysis]:
        with get_task_stream(client) as ts:
            a = analyze(str(tmp_path / str(n)), client=client)
        keys: dict[str, set] = {}
        for t in ts.data:
            keys.setdefault(str(t["key"]).split("-")[0], set()).add(t["key"])
        assert a.breakdown["rank"].tolist() == list(range(n))
        assert a.rank_stats.set_index("metric").loc["gpu_span_us", "outlier_ranks"] == [17]
        return {k: len(v) for k, v in keys.items()}, a

    costs = [p.stat().st_size + FILE_COST for p in (tmp_path / "1024").iterdir()]
    assert [len(b) for b in batches(costs)] == [4] * 256
    assert run(1024)[0] == {"analyze_files": 256, "combine": 4, "without_segments": 4, "segments_in": 4}
    tasks, batched = run(128)
    assert tasks == {"analyze_files": 32}  # up to 64 tasks, the client joins their results itself
    monkeypatch.setattr(tracefuse_dask.analysis.run, "batches", lambda s: [range(i, i + 1) for i in range(len(s))])
    monkeypatch.setattr(tracefuse_dask.analysis.run, "_COMBINE", 8)
    tasks, one_a_task = run(128)
    # the client gets 16 results, not 128, without the critical path's segments, and then those of the path's walks
    assert tasks == {"analyze_files": 128, "combine": 16, "without_segments": 16, "segments_in": 16}
    # the same tables and summary either way, though reduce tasks send the client their text coded
    for name, table in batched.tables().items():
        pd.testing.assert_frame_equal(one_a_task.tables()[name], table)
    assert {**one_a_task.summary, "seconds": 0} == {**batched.summary, "seconds": 0}


@pytest.mark.integration
def test_many_small_ranks_start_worker_programs_and_few_run_in_this_process(tmp_path, monkeypatch):
    """Each file counts ``FILE_COST`` more in the choice of threads or worker programs: 64 ranks of a few kB
    (64 MiB with that cost) start worker programs, 8 run in threads of this process."""
    import tracefuse_dask.cluster

    started = []
    embedded = tracefuse_dask.cluster._embedded
    monkeypatch.setattr(tracefuse_dask.cluster, "_embedded", lambda n, in_process: started.append(in_process)
                        or embedded(n, in_process))
    for n in (8, 64):
        for r in range(n):
            events = [x("ProfilerStep#1", 0, 100, cat="user_annotation"), x("aten::mm", 10, 20), launch(12, 2, 1),
                      kernel("gemm_kernel", 20, 30, 7, 1)]
            write_trace(tmp_path / str(n) / f"rank{r}.json", make_trace(r, events, world_size=n))
        assert analyze(str(tmp_path / str(n))).breakdown["rank"].tolist() == list(range(n))
    assert started == [True, False]


@pytest.mark.integration
def test_an_analysis_lets_its_own_worker_programs_go_before_its_reduce_and_keeps_a_callers(tmp_path, monkeypatch):
    """Once the map's results are in, the worker programs of the cluster ``analyze`` started are asked to stop, and
    exit while the client reduces; a cluster the caller gives (diff's, for its other run) keeps its workers, and so
    does its own when the reduce still needs it (over ``_COMBINE`` tasks: the segments stay on the cluster)."""
    import time

    import distributed

    import tracefuse_dask.analysis.run
    from tracefuse_dask.cluster import connect

    for r in range(2):
        events = [x("ProfilerStep#1", 0, 100, cat="user_annotation"), x("aten::mm", 10, 20), launch(12, 2, 1),
                  kernel("gemm_kernel", 20, 30, 7, 1)]
        write_trace(tmp_path / f"rank{r}.json", make_trace(r, events, world_size=2))
    at_reduce = []
    reduce_ranks = tracefuse_dask.analysis.run.reduce_ranks

    def reduce_once_they_are_gone(*args, **kwargs):
        c, deadline = distributed.default_client(), time.monotonic() + 30
        while c.scheduler_info()["workers"] and time.monotonic() < deadline:
            time.sleep(0.05)
        at_reduce.append(len(c.scheduler_info()["workers"]))
        return reduce_ranks(*args, **kwargs)

    monkeypatch.setattr(tracefuse_dask.analysis.run, "reduce_ranks", reduce_once_they_are_gone)
    assert len(analyze(str(tmp_path), workers=2).breakdown) == 2 and at_reduce == [0]
    monkeypatch.setattr(tracefuse_dask.analysis.run, "reduce_ranks", reduce_ranks)
    with connect(workers=2) as c:
        for _ in range(2):
            assert len(analyze(str(tmp_path), client=c).breakdown) == 2
            assert not any(w.asked_to_stop for w in c.cluster.workers.values())
    let_go = []
    monkeypatch.setattr(tracefuse_dask.analysis.run, "let_go", let_go.append)
    monkeypatch.setattr(tracefuse_dask.analysis.run, "_COMBINE", 1)
    monkeypatch.setattr(tracefuse_dask.analysis.run, "batches", lambda s: [range(i, i + 1) for i in range(len(s))])
    a = analyze(str(tmp_path), workers=2)
    assert len(a.breakdown) == 2 and a.summary["critical_path"] and let_go == []


def test_a_reduce_task_without_ranks_gives_no_segments(client, tmp_path, monkeypatch):
    """65 tasks, one a file: the second reduce task holds only a JSON file without traceEvents (ignored), so its
    critical path segments have no rows, nor any column but ``rank``; the path's walks come from the first."""
    import tracefuse_dask.analysis.run
    from tracefuse_dask.analysis.cross_rank.critical_path import walks_in

    d = tmp_path / "many"
    for r in range(64):
        events = [x("ProfilerStep#1", 0, 100, cat="user_annotation"), x("aten::mm", 10, 20), launch(12, 2, 1),
                  kernel("gemm_kernel", 20, 30, 7, 1)]
        write_trace(d / f"rank{r:02d}.json", make_trace(r, events, world_size=64))
    (d / "zz_notes.json").write_text('{"notes": "not a trace"}')
    monkeypatch.setattr(tracefuse_dask.analysis.run, "batches", lambda s: [range(i, i + 1) for i in range(len(s))])
    a = analyze(str(d), client=client)
    assert a.summary["ignored"] == [f"{d / 'zz_notes.json'}: a JSON file without traceEvents, not a trace"]
    assert len(a.breakdown) == 64 and len(a.critical_path) and a.summary["critical_path"]
    no_ranks = pd.DataFrame({"rank": pd.Series([], dtype="int64")})
    assert walks_in(no_ranks, [(0, 1)]) is no_ranks


def test_an_unknown_phase_or_category_decodes_the_same_values():
    """Phases and categories decode as shared strings where known; a trace with another one decodes as plain strings."""
    import orjson
    from msgspec.structs import asdict

    from tracefuse_dask.analysis.per_rank.decode import decode_trace

    known = decode_trace(orjson.dumps({"traceEvents": small_rank()})).traceEvents
    for extra in (x("a", 1, 1, cat="my_category"), {"ph": "Z", "name": "z", "pid": HOST, "tid": TID, "ts": 1}):
        odd = decode_trace(orjson.dumps({"traceEvents": small_rank() + [extra]})).traceEvents
        assert type(odd[0]) is not type(known[0])
        assert [asdict(e) for e in odd[:-1]] == [asdict(e) for e in known]
        assert (odd[-1].ph, odd[-1].cat) == (extra["ph"], extra.get("cat", ""))


def test_steps_select_the_union_of_their_spans():
    """``--steps`` keeps a host event whose start, and GPU work whose launch, lies in a chosen step, also
    where steps overlap."""
    import orjson
    from hypothesis import given, strategies as st

    from tracefuse_dask.analysis.per_rank.rank import _in_steps
    from tracefuse_dask.analysis.per_rank.decode import decode_trace

    @given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 30)), min_size=1, max_size=6),
           st.lists(st.integers(0, 100), max_size=20), st.lists(st.integers(0, 100), max_size=10),
           st.integers(0, 5), st.integers(0, 5))
    def check(spans, times, launches, lo, hi):
        events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "pid": 1, "tid": 1, "ts": s,
                   "dur": d} for k, (s, d) in enumerate(spans)]
        events += [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": t, "dur": 1} for t in times]
        for c, t in enumerate(launches):  # each kernel runs at 200 µs, after every step: its launch decides
            events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t,
                        "dur": 1, "args": {"correlation": c}},
                       {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 200, "dur": 1,
                        "args": {"correlation": c, "stream": 7}}]
        trace = decode_trace(orjson.dumps({"traceEvents": events}))
        xs = [e for e in trace.traceEvents if e.name in ("op", "k")]
        chosen = [(s, s + d) for k, (s, d) in enumerate(spans) if lo <= k <= hi]
        start = [e.ts if e.name == "op" else launches[e.args.correlation] for e in xs]
        want = [e for e, t in zip(xs, start) if any(a <= t < b for a, b in chosen)]
        assert _in_steps(trace.traceEvents, xs, (lo, hi)) == want

    check()


@pytest.mark.parametrize("text", [None, "string"])  # pandas' default text type, and its nullable one
def test_tables_travel_with_their_texts_as_categories_and_come_back_the_same(text):
    """Reduce tasks' text columns travel as categoricals (``as_categories``); joined over parts with other categories,
    missing values, a part where the column holds no text, an empty part, one part, or parts whose columns
    differ, they come back as the table a plain join gives, pandas's text in its Python storage, where equal
    texts are one string."""
    from tracefuse_dask.analysis.transport import as_categories, as_text, in_rank_order, join_parts

    def frame(rank, names, **more):
        return pd.DataFrame({"rank": [rank] * len(names), "name": pd.array(names, dtype=text),
                             "us": [1.0] * len(names), **more})

    def python_storage(table):
        return table.astype({c: pd.StringDtype("python") if t.na_value is pd.NA else pd.StringDtype(
            "python", na_value=t.na_value) for c, t in table.dtypes.items() if isinstance(t, pd.StringDtype)})

    a, b = frame(0, ["aten::mm", None]), frame(1, ["nccl:all_reduce"])
    no_text = pd.DataFrame({"rank": [2], "name": [None], "us": [4.0]}).astype({"name": object})
    other = frame(3, ["aten::add"], extra=[1])
    for parts in ([a, b], [a, b, no_text], [a, a.iloc[:0], b], [b], [a, other]):
        coded = [as_categories(p) for p in parts]
        if isinstance(a["name"].dtype, pd.StringDtype):  # pandas 2's default text is object: not coded
            assert isinstance(coded[0]["name"].dtype, pd.CategoricalDtype)
        expected = python_storage(pd.concat([p for p in parts if len(p)], ignore_index=True))
        pd.testing.assert_frame_equal(as_text(join_parts(coded)), expected)
    assert join_parts([a.iloc[:0], b.iloc[:0].assign(extra=0)]).columns.tolist() == ["rank", "name", "us", "extra"]
    parts = [as_categories(b), as_categories(a)]  # out of rank order: sorted, each rank's rows in their order
    pd.testing.assert_frame_equal(as_text(in_rank_order(parts)), python_storage(pd.concat([a, b], ignore_index=True)))
    assert parts == []
    if isinstance(a["name"].dtype, pd.StringDtype):
        joined = as_text(join_parts([as_categories(frame(0, ["aten::mm"] * 3)), as_categories(frame(1, ["aten::mm", "x"]))]))
        assert len({id(t) for t in joined["name"].to_numpy(dtype=object)[:4]}) == 1


def test_a_paused_collector_comes_back_as_the_caller_left_it():
    import gc

    from tracefuse_dask.kineto.document import paused_gc

    was = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            with paused_gc(), paused_gc():
                assert not gc.isenabled()
            assert gc.isenabled() is before
    finally:
        (gc.enable if was else gc.disable)()


def test_the_summary_shape_check_names_each_stray_key():
    """``shape_problems``, which holds real summaries to ``schema.Summary`` in the tests that analyse the shared
    traces, names an undeclared key, a missing one and a value of another type."""
    from conftest import shape_problems

    from tracefuse_dask.analysis.schema import Summary

    got = shape_problems({"tool": 1, "extra": 2, "straggler": {"rank": "2"}}, Summary)
    assert "summary.extra: not declared in Summary" in got and "summary.tool: 1 is not str" in got
    assert "summary.ranks: missing" in got and "summary.straggler.evidence: missing" in got
    assert "summary.straggler.rank: '2' is not int" in got


def test_the_pass_that_pairs_b_and_e_events_runs_only_for_a_rank_that_has_them(monkeypatch):
    """Pairing ``B``/``E`` events into slices (``decode.durations``) reads every event of a rank: 1-2 % of an A100
    rank's task, whose Kineto events are all complete (``X``). It runs only where the rank has such events outside
    ``python_function`` (which the decoder keeps and the analysis leaves out), and the tables and the account are
    what they are when it runs."""
    import orjson

    from tracefuse_dask.analysis.per_rank import rank
    from tracefuse_dask.analysis.per_rank.decode import decode_trace

    calls = []
    pairing, model = rank.durations, rank.rank_model
    monkeypatch.setattr(rank, "durations", lambda events: calls.append(len(events)) or pairing(events))

    def analysed(extra: list[dict]):
        window = {"ph": "i", "cat": "cpu_instant_event", "name": "Iteration Start: PyTorch Profiler", "pid": HOST,
                  "tid": TID, "ts": 5, "s": "t"}
        doc = orjson.dumps({"traceEvents": [*small_rank(), *extra, window]})
        return rank.analyze_events(decode_trace(doc).traceEvents, 0, "r0.json")

    pyfunc = [{"ph": ph, "cat": "python_function", "name": "f", "pid": HOST, "tid": TID, "ts": ts}
              for ph, ts in (("B", 1), ("E", 2), ("E", 3))]
    skipped = analysed(pyfunc)
    assert calls == [] and skipped.account["left_out"] == {"python_function": 3, "not_slices": 1}
    monkeypatch.setattr(rank, "rank_model", lambda *a, pairs=True, **k: model(*a, pairs=True, **k))
    forced = analysed(pyfunc)
    assert calls == [len(small_rank()) + 4]
    assert forced.account == skipped.account and forced.begin_end == skipped.begin_end
    for name, table in skipped.tables.items():
        pd.testing.assert_frame_equal(table, forced.tables[name], obj=name)
    monkeypatch.setattr(rank, "rank_model", model)
    paired = analysed([{**e, "cat": "user_annotation"} for e in pyfunc])  # a slice, and an E that closes nothing
    assert calls[1:] == [len(small_rank()) + 4] and paired.begin_end == (1, 0, 1)
    assert paired.account["left_out"] == {"not_slices": 1, "unopened_end": 1}


@pytest.mark.parametrize("steps", [None, (11, 11)], ids=["all steps", "--steps 11"])
def test_a_rank_s_text_is_let_go_before_its_critical_path_walks(tmp_path, monkeypatch, steps):
    """The decoder leaves each op's list arguments (``Input Dims``, ``Input type``, ``Concrete Inputs``) as views
    into the file's whole text, which they keep in memory (50 MB of an A100 rank). Once the op tables and the
    collectives have read them, the analysis lets them go, so that the critical path's walks, the peak of a rank's
    analysis, run without the text (49 MiB less at an A100 rank's peak; the tables are the same:
    ``test_output_hashes``)."""
    import sys

    import orjson

    from tracefuse_dask.analysis import tasks
    from tracefuse_dask.analysis.per_rank import rank
    from tracefuse_dask.analysis.schema import AnalyzeRequest
    from tracefuse_dask.model import InputFile
    from tracefuse_dask.synth import make_rank_trace

    path = tmp_path / "rank0.json"
    path.write_bytes(orjson.dumps(make_rank_trace(0, 2, target_bytes=300_000)))
    read, decode, pieces = tasks.read_bytes, tasks.decode_trace, rank.rank_pieces
    held: dict[str, bytes] = {}
    refs: dict[str, int] = {}

    def read_bytes(*args, **kwargs):
        held["text"], cut = read(*args, **kwargs)
        return held["text"], cut

    def decode_trace(data):
        trace = decode(data)
        refs["decoded"] = sys.getrefcount(held["text"])
        return trace

    def rank_pieces(*args, **kwargs):
        refs["walks"] = sys.getrefcount(held["text"])
        return pieces(*args, **kwargs)

    monkeypatch.setattr(tasks, "read_bytes", read_bytes)
    monkeypatch.setattr(tasks, "decode_trace", decode_trace)
    monkeypatch.setattr(rank, "rank_pieces", rank_pieces)
    got = tasks.analyze_files([InputFile(str(path), path.stat().st_size, rank_hint=0, hint_source="order")],
                              AnalyzeRequest(steps=steps))
    own = sys.getrefcount(held["text"])  # the test's own references, counted as at the walks
    assert refs["decoded"] > 100 and refs["walks"] == own
    launchers = got["tables"]["kernel_launchers"]  # read before they were let go
    assert len(launchers) and launchers["input_dims"].str.startswith("[[").all()
