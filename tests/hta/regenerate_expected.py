"""Regenerate the HolisticTraceAnalysis (HTA) 0.5.0 reference values used by the HTA-agreement tests.

This script is NOT part of the test suite and must NOT run inside the project's venv: it imports HTA,
which is never installed into /work/venv. Run it with HTA 0.5.0 installed in a scratch venv:

    python3 -m venv /work/hta-venv
    /work/hta-venv/bin/pip install HolisticTraceAnalysis==0.5.0
    cd /work/main && /work/hta-venv/bin/python tests/hta/regenerate_expected.py

then, for the kernel_sequences key only, a second scratch venv with pandas 2 (HTA 0.5.0's call graph, which
get_frequent_cuda_kernel_sequences builds, raises under pandas 3: "TypeError: The axis argument to unique is not
supported for dtype object"):

    python3 -m venv /tmp/hta_work/venv-pd2
    /tmp/hta_work/venv-pd2/bin/pip install HolisticTraceAnalysis==0.5.0 pandas==2.2.3 numpy==2.2.6
    cd /work/main && /tmp/hta_work/venv-pd2/bin/python tests/hta/regenerate_expected.py --kernel-sequences

Which venv writes what: the first run (pandas 3.1.1, numpy 2.4.6, recorded under "environment") writes every
key except jobs[*].kernel_sequences, which it copies unchanged from the existing --out file (and
"kernel_sequences_environment" likewise). --kernel-sequences (refused under pandas >= 3) reads the existing
--out file, replaces only jobs[*].kernel_sequences (of the --only jobs if given) and the top-level
"kernel_sequences_environment" (HTA, pandas 2.2.3, numpy 2.2.6, python versions), and rewrites it with the same
json.dumps settings, so every other value stays byte-identical; it writes no timings.

(HTA 0.5.0 needs no torch; pip pulls jupyterlab/plotly/pandas. The stored values were produced with
the versions recorded under "environment" in the output (pandas 3.1.1, numpy 2.4.6). pandas 2.2.3 + numpy 2.2.6
give the same file apart from "environment", last-bit float differences (hta_mtia_inference's per-kernel
"sum (us)", 45371.19 under pandas 2.2.3 instead of 45371.189999999995, and its mean; the queue_length std
of kineto_2021_resnet50 and hta_negative_queue_length); that is why the first run stays on pandas 3.
The script sets HTA_DISABLE_NS_ROUNDING=1 itself before importing HTA, so no variable has to be exported.
Output is deterministic: rerunning gives an identical hta_expected.json.)

Options: --traces DIR (default: ../shared/traces beside the repository, i.e. /work/shared/traces),
--out FILE (default tests/data/hta_expected.json), --timings FILE (default tests/hta/hta_timings.json),
--only NAME (repeatable; job keys such as real/hta_amd_trace): recompute only those jobs; the others are kept
as the existing --out and --timings files have them. --kernel-sequences: the second run above.

What it writes, per job folder and per rank (see /work/notes/hta_semantics.md for the semantics):
  * temporal_breakdown      get_temporal_breakdown(visualize=False), one row per rank, as returned
  * comm_comp_overlap       get_comm_comp_overlap(visualize=False): comp_comm_overlap_pctg (HTA rounds it
                            to 2 decimals) and, alongside, the same value with HTA's round() neutralised
                            ("comp_comm_overlap_pctg_unrounded", 100 * ratio)
  * gpu_kernel_breakdown    get_gpu_kernel_breakdown(visualize=False) with the defaults
                            (duration_ratio=0.8, num_kernels=10, include_memory_kernels=True) and with
                            num_kernels=10**9, duration_ratio=1.0 (no "others" bucketing), both dataframes.
                            HTA's kernel-type dataframe is summed over ALL ranks of the job; a per-rank
                            version computed with HTA's own private helper
                            BreakdownAnalysis._get_gpu_kernel_type_time (same code path, one rank) is stored
                            as kernel_type_per_rank. HTA has no count column; "count" in per_kernel_full is
                            derived from HTA's loaded DataFrame (rows with stream != -1 grouped by name,
                            exactly the rows HTA aggregates).
  * idle_time_breakdown     get_idle_time_breakdown(ranks=<all ranks>, visualize=False,
                            show_idle_interval_stats=True), defaults otherwise (consecutive_kernel_delay=30)
  * errors                  for CPU-only jobs (and any failing call) the exception as "Type: message".
                            Only the calls above report here; the four keys below keep their own "errors"
                            dict (same "Type: message" form), so this dict is the same as before they existed.
  * launch_stats            get_cuda_kernel_launch_stats(ranks=<all ranks>, runtime_cutoff=50,
                            launch_delay_cutoff=100, include_memory_events=True, visualize=False), per rank:
                            launches (rows of HTA's dataframe), short_kernels (HTA's own definition in
                            visualize_cuda_launch_kernel_info: cpu_duration <= runtime_cutoff and
                            gpu_duration < cpu_duration), runtime_outliers (cpu_duration > runtime_cutoff),
                            launch_delay_outliers (launch_delay > launch_delay_cutoff), and mean / median / max /
                            p95 (numpy, linear interpolation) of launch_delay, cpu_duration, gpu_duration in us,
                            null when the rank has no row. HTA 0.5.0 only pairs cudaLaunchKernel,
                            cudaLaunchKernelExC, MTIA's "runFunction - job_prep_and_submit_for_execution" and
                            (include_memory_events) cudaMemcpyAsync / cudaMemsetAsync with their device event: no
                            hip* and no cuLaunchKernel, so ROCm traces get 0 launches.
  * queue_length            summary: get_queue_length_summary(ranks=<all ranks>) (pandas describe() over the
                            change points of the step function, not time-weighted), per rank and stream: count,
                            mean, std, min, 25%, 50%, 75%, max (null when HTA returns None: no launch/kernel pair).
                            blocked_on_full_queue: rows of get_time_spent_blocked_on_full_queue(
                            get_queue_length_time_series(<all ranks>), max_queue_length=1024), sorted by rank and
                            stream (HTA keeps at most one stream per rank: later streams overwrite earlier ones).
                            time_at_stream_max_queue_length (DERIVED, not an HTA output): per rank and stream,
                            HTA's own get_time_spent_blocked_on_full_queue applied to that stream's time series
                            alone with max_queue_length = that stream's maximum queue length (the time from each
                            change point at the maximum to the next change point; the stream's last point
                            contributes nothing). Durations are in us: HTA's trace dataframe keeps Kineto's us,
                            shifted so the job's earliest event is at 0 (HTA's log line calls them ns, wrongly);
                            relative_* divides by HTA's get_trace_duration(rank) = last minus first event start.
  * memory_bw               get_memory_bw_summary(ranks=<all ranks>): per rank and memory op name (Memcpy HtoD,
                            Memset, ...) the describe() fields count, mean, std, min, 25%, 50%, 75%, max of
                            memory_bw_gbps (GB/s, points > 0 only, as HTA filters), null when HTA returns None.
  * kernel_sequences        (written by --kernel-sequences under pandas 2, see above)
                            get_frequent_cuda_kernel_sequences(operator_name=OP, output_dir=<temp dir>,
                            min_pattern_len=3, rank=<lowest rank>, top_k=5, visualize=False,
                            compress_other_kernels=True). Stored: args (operator_name, rank, min_pattern_len,
                            top_k, compress_other_kernels); operator_selection (how OP was picked, see below;
                            names_containing_operator = the distinct event names on the rank that contain OP,
                            i.e. those HTA takes as candidates); rows = HTA's dataframe as records (pattern,
                            count, GPU kernel duration (us), CPU op duration (us)) in HTA's order (count
                            descending, pattern ascending), [] when HTA returns an empty dataframe (plus a
                            note), null when HTA raises or is not called; calls_in_rows = sum of the counts;
                            note; errors. HTA returns all patterns, top_k only limits the overlaid trace it
                            writes (to the temp dir, discarded).
                            HTA's search (cuda_kernel_analysis.py): candidates are the rank's events whose NAME
                            CONTAINS operator_name; only those at the smallest call-graph "depth" among the
                            candidates are searched, and a call counts if its subtree launched >= min_pattern_len
                            device events (HTA's num_kernels: kernels, memcpy, memset, ...); its pattern is its
                            name then its subtree's device events by ts.
                            OP rule (deterministic, computed here from HTA's own CallGraph(ta.t, [rank]) columns
                            depth and num_kernels): for every distinct name N of a host event (stream == -1) on
                            the rank, calls_searched(N) = the number of calls HTA's search would count for
                            operator_name=N (exactly the rule above, substring matching included). Among names
                            with calls_searched > 0, OP minimises (tier, not unambiguous, -calls_searched, N):
                            tier 1 = "aten::" names of CPU ops (category "cpu_op", or "Operator" in old Kineto
                            traces), tier 2 = other CPU-op names, tier 3 = any other host event (python_function,
                            user_annotation, runtime, ...); unambiguous = N is the only distinct name on the rank
                            containing N. So: the aten:: op with the most searched calls if any has one, an
                            unambiguous name before an ambiguous one, ties to the lexicographically smallest name.
                            Stored: rule (tier), categories, calls_searched, searched_depth,
                            names_containing_operator, unambiguous, names_giving_a_search_by_tier; errors.check is
                            set if the rows' counts do not add up to calls_searched (never the case so far).
                            Fallback, when no name gives a search with a call (ROCm traces: HTA's call graph
                            credits no device event to any host event; traces with < 3 device events) or when
                            CallGraph raises (kineto_2021_resnet50: TypeError in abs() of its string thread ids,
                            under either pandas), the old rule, computed before the call graph: every device event
                            HTA links to a host runtime event (index_correlation > 0) is credited to every CPU op on
                            the runtime event's pid/tid whose [ts, ts + dur] contains the runtime event's; OP is
                            the aten:: name with the most credited device events (else any CPU-op name), ties to
                            the smallest name (operator_selection: device_events_credited,
                            device_events_linked_to_a_launch). When no CPU op encloses any launch (CPU-only jobs,
                            hta_mtia_inference under the old rule), operator_name is null and HTA is not called.
NaN values are stored as JSON null.

Gloo job folders contain a generation_info.json next to the traces; HTA would take it for a trace of
rank 0 (see notes), so those jobs are run on a temporary directory of symlinks to the *.json.gz trace
files only. Nothing is copied into the repository.

Timings (HTA TraceAnalysis() load + get_temporal_breakdown wall time, and launch_queue_membw_s for the calls of
the keys launch_stats .. memory_bw) go to a separate file and are informative only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

# Must be set before HTA parses anything (read at parse time via os.environ; forked parser
# workers inherit it).
os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
INCLUDE_LAST_PROFILER_STEP = True

import logging  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

try:
    import hta  # noqa: E402
    from hta.analyzers import communication_analysis as _hta_comm  # noqa: E402
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis  # noqa: E402
    from hta.common.trace_call_graph import CallGraph  # noqa: E402
    from hta.configs.config import logger as _hta_logger  # noqa: E402
    from hta.trace_analysis import TraceAnalysis  # noqa: E402
    from hta.utils.utils import KernelType, get_kernel_type  # noqa: E402
except ImportError as exc:  # pragma: no cover - run by hand only
    sys.exit(f"HTA is not importable ({exc}); run this with the scratch venv, see the module docstring")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_TRACES = REPO.parent / "shared" / "traces"
DEFAULT_OUT = REPO / "tests" / "data" / "hta_expected.json"
DEFAULT_TIMINGS = HERE / "hta_timings.json"

EXPECTED_HTA_VERSION = "0.5.0"
MAX_JSON_BYTES = 1_000_000
TOP_N_IF_TOO_BIG = 200
FULL_NUM_KERNELS = 10**9

# job key -> (folder relative to --traces, kind)
JOBS: Dict[str, str] = {
    "real/hta_amd_trace": "gpu",
    "real/hta_cuda_event_sync": "gpu",
    "real/hta_trace_filter": "gpu",
    "real/hta_triton_example": "gpu",
    "real/kineto_docs": "gpu",
    "real/tracelens_b200": "gpu",
    "real/tracelens_h100_qwen": "gpu",
    "real/tracelens_vllm_cudagraph": "gpu",
    "real/hta_alexnet": "gpu",
    "real/kineto_2021_resnet50": "gpu",
    "real/hta_mtia_inference": "gpu",
    "real/tracelens_mi300_qwen": "gpu",
    "real/hta_negative_queue_length": "gpu",
    "real/hta_cpu_only": "cpu",
    "real/hta_cpu_only_full": "cpu",
    "gloo_4ranks": "cpu",
    "gloo_2ranks_tb_nostraggler": "cpu",
}


# ----------------------------------------------------------------------------------------------
# JSON helpers
# ----------------------------------------------------------------------------------------------
def jsonable(v: Any) -> Any:
    """numpy/pandas scalars -> python; NaN/inf -> None; containers recursively."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return None if (math.isnan(f) or math.isinf(f)) else f
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if isinstance(v, (int, str, bool)):
        return v
    return str(v)


def df_records(df: Optional[pd.DataFrame], keep_index: Optional[str] = None) -> Optional[List[Dict[str, Any]]]:
    if df is None:
        return None
    d = df.reset_index() if keep_index else df
    if keep_index:
        d = d.rename(columns={d.columns[0]: keep_index})
    return [jsonable(r) for r in d.to_dict("records")]


def err_str(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def call(fn: Callable[[], Any]) -> tuple:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(), None
    except Exception as exc:  # noqa: BLE001 - we record whatever HTA raises
        return None, err_str(exc)


# ----------------------------------------------------------------------------------------------
# Trace dir preparation
# ----------------------------------------------------------------------------------------------
def _is_trace_file(p: Path) -> bool:
    return p.is_file() and (p.name.endswith(".json.gz") or p.name.endswith(".json")) and p.name != "generation_info.json"


def prepare_dir(src: Path, tmp_root: Path) -> tuple:
    """Return (dir to give HTA, note). Symlink farm only when the folder has non-trace *.json files."""
    entries = [p for p in sorted(src.iterdir()) if p.name.endswith(".gz") or p.name.endswith(".json")]
    traces = [p for p in entries if _is_trace_file(p)]
    if len(traces) == len(entries):
        return src, "folder passed to HTA as is"
    dst = tmp_root / src.name
    dst.mkdir(parents=True, exist_ok=True)
    for p in traces:
        (dst / p.name).symlink_to(p)
    skipped = sorted(p.name for p in entries if p not in traces)
    return dst, (
        f"temporary dir of symlinks to the trace files only; skipped {skipped}: HTA's directory scan takes every "
        "*.json/*.gz file, a file without a '\"rank\": N' match becomes rank 0 and replaces (or is replaced by) "
        "the real rank-0 trace depending on os.listdir order"
    )


# ----------------------------------------------------------------------------------------------
# Per-job analysis
# ----------------------------------------------------------------------------------------------
def overlap_unrounded(ta: TraceAnalysis) -> pd.DataFrame:
    """get_comm_comp_overlap with HTA's module-level round() neutralised (value = 100 * ratio)."""
    _hta_comm.round = lambda x, ndigits=None: x  # shadows the builtin inside that module only
    try:
        return ta.get_comm_comp_overlap(visualize=False)
    finally:
        del _hta_comm.round


def kernel_type_per_rank(ta: TraceAnalysis, include_memory_kernels: bool = True) -> Dict[str, Any]:
    """Same code as BreakdownAnalysis.get_gpu_kernel_breakdown lines 79-92/115-123, one rank at a time."""
    sym_table = ta.t.symbol_table.get_sym_table()
    types = [KernelType.COMPUTATION.name, KernelType.COMMUNICATION.name]
    if include_memory_kernels:
        types.append(KernelType.MEMORY.name)
    out: Dict[str, Any] = {}
    for rank, trace_df in ta.t.traces.items():
        gpu_kernels = trace_df[trace_df["stream"].ne(-1)].copy()
        gpu_kernels["kernel_type"] = gpu_kernels[["name"]].apply(lambda x: get_kernel_type(sym_table[x["name"]]), axis=1)
        df = BreakdownAnalysis._get_gpu_kernel_type_time(gpu_kernels, types)
        df = df.groupby(by=["kernel_type"])["sum"].agg(["sum"]).reset_index()
        df = df.sort_values(by=["sum"], ignore_index=True, ascending=False)
        df["percentage"] = (df["sum"] / df["sum"].sum()) * 100
        df = df.round({"percentage": 1})
        out[str(rank)] = df_records(df)
    return out


def kernel_counts(ta: TraceAnalysis) -> Dict[str, Dict[str, int]]:
    """Number of rows per kernel name among the rows HTA aggregates (stream != -1)."""
    sym_table = ta.t.symbol_table.get_sym_table()
    res: Dict[str, Dict[str, int]] = {}
    for rank, trace_df in ta.t.traces.items():
        g = trace_df[trace_df["stream"].ne(-1)]
        vc = g["name"].map(lambda i: sym_table[i]).value_counts()
        res[str(rank)] = {k: int(v) for k, v in vc.items()}
    return res


def per_rank(records: Optional[List[Dict[str, Any]]], rank_key: str = "rank") -> Optional[Dict[str, List[Dict[str, Any]]]]:
    if records is None:
        return None
    out: Dict[str, List[Dict[str, Any]]] = {}
    for r in records:
        out.setdefault(str(r.get(rank_key)), []).append({k: v for k, v in r.items() if k != rank_key})
    return out


# ----------------------------------------------------------------------------------------------
# Launch stats, queue length, memory bandwidth, frequent kernel sequences
# ----------------------------------------------------------------------------------------------
LAUNCH_STATS_ARGS = dict(runtime_cutoff=50, launch_delay_cutoff=100, include_memory_events=True)
MAX_QUEUE_LENGTH = 1024  # HTA's CUDA_MAX_LAUNCH_QUEUE_PER_STREAM, passed explicitly
DESCRIBE_FIELDS = ("count", "mean", "std", "min", "25%", "50%", "75%", "max")
KERNEL_SEQ_ARGS = dict(min_pattern_len=3, top_k=5, compress_other_kernels=True)
CPU_OP_CATEGORIES = ("cpu_op", "Operator")  # "Operator": pre-2022 Kineto traces


def _num_key(k: Any) -> tuple:
    """Sort key for rank/stream keys: numbers numerically, anything else after them as text."""
    try:
        return (0, int(k), "")
    except (TypeError, ValueError):
        return (1, 0, str(k))


def _stats(values: np.ndarray) -> Dict[str, Any]:
    """mean / median / max / p95 (numpy defaults: linear interpolation); null for no value."""
    if len(values) == 0:
        return {"mean": None, "median": None, "max": None, "p95": None}
    return {
        "mean": float(np.mean(values)),
        "median": float(np.median(values)),
        "max": float(np.max(values)),
        "p95": float(np.percentile(values, 95)),
    }


def launch_stats(ta: TraceAnalysis, ranks: List[int]) -> Dict[str, Any]:
    """get_cuda_kernel_launch_stats summarised per rank.

    HTA 0.5.0 (CudaKernelAnalysis.cuda_kernel_launch_stats) only counts host events named cudaLaunchKernel,
    cudaLaunchKernelExC, "runFunction - job_prep_and_submit_for_execution" (MTIA) and, with
    include_memory_events=True, cudaMemcpyAsync and cudaMemsetAsync: no hip* (hipLaunchKernel,
    hipExtModuleLaunchKernel, hipMemcpyAsync, ...) and no cuLaunchKernel, so ROCm traces have no launch rows.
    """
    out: Dict[str, Any] = {
        "args": {"ranks": [int(r) for r in ranks], **LAUNCH_STATS_ARGS},
        "counted_host_events": [
            "cudaLaunchKernel", "cudaLaunchKernelExC", "runFunction - job_prep_and_submit_for_execution",
            "cudaMemcpyAsync", "cudaMemsetAsync",
        ],
        "errors": {},
    }
    res, err = call(lambda: ta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False, **LAUNCH_STATS_ARGS))
    if err:
        out["errors"]["get_cuda_kernel_launch_stats"] = err
        out["per_rank"] = None
        return out
    rc, lc = LAUNCH_STATS_ARGS["runtime_cutoff"], LAUNCH_STATS_ARGS["launch_delay_cutoff"]
    per: Dict[str, Any] = {}
    for rank in sorted(res, key=_num_key):
        df = res[rank]
        cpu = df["cpu_duration"].to_numpy(dtype=float)
        gpu = df["gpu_duration"].to_numpy(dtype=float)
        delay = df["launch_delay"].to_numpy(dtype=float)
        per[str(rank)] = {
            "launches": int(len(df)),
            # the three filters of CudaKernelAnalysis.visualize_cuda_launch_kernel_info
            "short_kernels": int(((cpu <= rc) & (gpu < cpu)).sum()),
            "runtime_outliers": int((cpu > rc).sum()),
            "launch_delay_outliers": int((delay > lc).sum()),
            "launch_delay": _stats(delay),
            "cpu_duration": _stats(cpu),
            "gpu_duration": _stats(gpu),
        }
    out["per_rank"] = per
    return out


def _describe_nested(df: Optional[pd.DataFrame], column: str) -> Optional[Dict[str, Dict[str, Dict[str, Any]]]]:
    """HTA's groupby([rank, X]).describe() frame -> {rank: {X: {count, mean, ..., max}}}, keys sorted."""
    if df is None:
        return None
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for (rank, key), row in df.iterrows():
        out.setdefault(str(rank), {})[str(key)] = {f: jsonable(row[(column, f)]) for f in DESCRIBE_FIELDS}
    return {r: {k: out[r][k] for k in sorted(out[r], key=_num_key)} for r in sorted(out, key=_num_key)}


def queue_length(ta: TraceAnalysis, ranks: List[int]) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "args": {"ranks": [int(r) for r in ranks], "max_queue_length": MAX_QUEUE_LENGTH},
        "time_unit": "us",
        "errors": {},
    }
    summ, err = call(lambda: ta.get_queue_length_summary(ranks=ranks))
    if err:
        out["errors"]["get_queue_length_summary"] = err
    out["summary"] = None if err else _describe_nested(summ, "queue_length")

    series, err = call(lambda: ta.get_queue_length_time_series(ranks))
    if err:
        out["errors"]["get_queue_length_time_series"] = err
        out["blocked_on_full_queue"] = None
        out["time_at_stream_max_queue_length (derived)"] = None
        return out
    blocked, err = call(lambda: ta.get_time_spent_blocked_on_full_queue(series, max_queue_length=MAX_QUEUE_LENGTH))
    if err:
        out["errors"]["get_time_spent_blocked_on_full_queue"] = err
        out["blocked_on_full_queue"] = None
    else:
        rows = df_records(blocked)
        out["blocked_on_full_queue"] = sorted(rows, key=lambda r: (_num_key(r["rank"]), _num_key(r["stream"])))

    def own_max() -> Dict[str, Dict[str, Any]]:
        # Derived: HTA's full-queue computation on one stream with max_queue_length = that stream's maximum.
        res: Dict[str, Dict[str, Any]] = {}
        for rank in sorted(series, key=_num_key):
            ql = series[rank]
            per_stream: Dict[str, Any] = {}
            for stream in sorted(ql["stream"].unique(), key=_num_key):
                one = ql[ql["stream"] == stream].copy()
                smax = int(one["queue_length"].max())
                df = ta.get_time_spent_blocked_on_full_queue({rank: one}, max_queue_length=smax)
                assert len(df) == 1, df
                per_stream[str(int(stream))] = {
                    "max_queue_length": smax,
                    "duration_at_max_queue_length": jsonable(df["duration_at_max_queue_length"].iloc[0]),
                    "relative_duration_at_max_queue_length": jsonable(
                        df["relative_duration_at_max_queue_length"].iloc[0]
                    ),
                }
            res[str(rank)] = per_stream
        return res

    derived, err = call(own_max)
    if err:
        out["errors"]["time_at_stream_max_queue_length (derived)"] = err
    out["time_at_stream_max_queue_length (derived)"] = derived
    return out


def memory_bw(ta: TraceAnalysis, ranks: List[int]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"args": {"ranks": [int(r) for r in ranks]}, "unit": "GB/s", "errors": {}}
    summ, err = call(lambda: ta.get_memory_bw_summary(ranks=ranks))
    if err:
        out["errors"]["get_memory_bw_summary"] = err
    out["summary"] = None if err else _describe_nested(summ, "memory_bw_gbps")
    return out


def pick_operator_old(ta: TraceAnalysis, rank: int) -> tuple:
    """Fallback rule: (name, credited device events, category, device events linked to a launch), see docstring."""
    df = ta.t.traces[rank]
    sym_table = ta.t.symbol_table.get_sym_table()
    sym_id = ta.t.symbol_table.get_sym_id_map()
    dev = df[df["stream"].ne(-1) & df["index_correlation"].gt(0)]
    dev_of_runtime: Dict[int, List[int]] = {}
    for di, ri in zip(dev["index"].tolist(), dev["index_correlation"].tolist()):
        dev_of_runtime.setdefault(int(ri), []).append(int(di))
    runtime = df[df["index"].isin(list(dev_of_runtime))]
    rt_by_thread = {k: g.sort_values(["ts", "index"]) for k, g in runtime.groupby(["pid", "tid"], sort=False)}
    cat_ids = {sym_id[c]: c for c in CPU_OP_CATEGORIES if c in sym_id}
    ops = df[df["cat"].isin(list(cat_ids)) & df["stream"].eq(-1)]
    credited: Dict[int, set] = {}
    op_cat: Dict[int, str] = {}
    for key, og in ops.groupby(["pid", "tid"], sort=False):
        rg = rt_by_thread.get(key)
        if rg is None:
            continue
        r_ts = rg["ts"].to_numpy(dtype=float)
        r_end = r_ts + rg["dur"].to_numpy(dtype=float)
        r_idx = rg["index"].to_numpy()
        for name, cat, ts, dur in og[["name", "cat", "ts", "dur"]].itertuples(index=False):
            end = float(ts) + float(dur)
            lo, hi = np.searchsorted(r_ts, float(ts), "left"), np.searchsorted(r_ts, end, "right")
            if lo >= hi:
                continue
            inside = r_idx[lo:hi][r_end[lo:hi] <= end]
            if len(inside):
                s = credited.setdefault(int(name), set())
                for ri in inside:
                    s.update(dev_of_runtime[int(ri)])
                op_cat[int(name)] = cat_ids[int(cat)]
    counts = {(sym_table[n], op_cat[n]): len(s) for n, s in credited.items()}
    aten = {k: v for k, v in counts.items() if k[0].startswith("aten::")}
    pool = aten or counts
    if not pool:
        return None, 0, None, int(len(dev))
    (name, cat), n = min(pool.items(), key=lambda kv: (-kv[1], kv[0][0]))
    return name, int(n), cat, int(len(dev))


KS_TIERS = {1: "aten:: CPU op", 2: "other CPU op", 3: "other host event"}


def _names_on_rank(ta: TraceAnalysis, rank: int) -> Dict[int, str]:
    sym_table = ta.t.symbol_table.get_sym_table()
    return {int(i): sym_table[int(i)] for i in ta.t.traces[rank]["name"].unique()}


def pick_operator_hta(ta: TraceAnalysis, rank: int, min_len: int) -> Optional[Dict[str, Any]]:
    """Operator rule on HTA's call-graph columns (CallGraph(ta.t, [rank]) must have been built), see docstring.

    For a candidate string N, HTA 0.5.0 searches the events of the rank whose name contains N, at the smallest
    "depth" among them, with num_kernels >= min_len; their number ("calls_searched") is what HTA's rows' counts
    add up to. Returns None when no host-event name gives a search with at least one call.
    """
    df = ta.t.traces[rank]
    sym_id = ta.t.symbol_table.get_sym_id_map()
    names = _names_on_rank(ta, rank)
    min_depth = df.groupby("name")["depth"].min().to_dict()
    deep = df[df["num_kernels"].ge(min_len)].groupby(["name", "depth"]).size().to_dict()
    qual_names = {names[int(n)] for n, _ in deep}
    cat_ids = [sym_id[c] for c in CPU_OP_CATEGORIES if c in sym_id]
    host = df[df["stream"].eq(-1)]
    op_names = {names[int(i)] for i in host.loc[host["cat"].isin(cat_ids), "name"].unique()}
    cats_of: Dict[str, set] = {}
    for n, c in host[["name", "cat"]].drop_duplicates().itertuples(index=False):
        cats_of.setdefault(names[int(n)], set()).add(ta.t.symbol_table.get_sym_table()[int(c)])
    ids_of = {v: k for k, v in names.items()}
    scored = []
    for cand in sorted({names[int(i)] for i in host["name"].unique()}):
        if not any(cand in q for q in qual_names):
            continue
        matched = sorted(m for m in names.values() if cand in m)
        depths = [min_depth[ids_of[m]] for m in matched if not pd.isna(min_depth[ids_of[m]])]
        if not depths:
            continue
        md = min(depths)
        n_calls = sum(deep.get((ids_of[m], md), 0) for m in matched)
        if n_calls == 0:
            continue
        tier = (1 if cand.startswith("aten::") else 2) if cand in op_names else 3
        scored.append((tier, matched != [cand], -n_calls, cand, matched, int(md)))
    if not scored:
        return None
    tier, ambiguous, neg, cand, matched, md = min(scored, key=lambda s: s[:4])
    return {
        "rule": f"tier {tier} ({KS_TIERS[tier]})",
        "operator_name": cand,
        "categories": sorted(cats_of.get(cand, ())),
        "calls_searched": -neg,
        "searched_depth": md,
        "names_containing_operator": matched,
        "unambiguous": not ambiguous,
        "names_giving_a_search_by_tier": {
            KS_TIERS[t]: sum(1 for s in scored if s[0] == t) for t in sorted(KS_TIERS)
        },
    }


def kernel_sequences(ta: TraceAnalysis, rank: int, out_dir: Path) -> Dict[str, Any]:
    """The kernel_sequences key of one job (HTA's call graph needs pandas < 3, see docstring)."""
    min_len = KERNEL_SEQ_ARGS["min_pattern_len"]
    out: Dict[str, Any] = {"errors": {}}
    old, err = call(lambda: pick_operator_old(ta, rank))  # before the call graph adds its columns
    if err:
        out["errors"]["operator_selection (fallback rule)"] = err
        old = (None, 0, None, None)
    _, err = call(lambda: CallGraph(ta.t, ranks=[rank]))
    sel: Optional[Dict[str, Any]] = None
    if err:
        out["errors"]["CallGraph"] = err
    else:
        sel, err = call(lambda: pick_operator_hta(ta, rank, min_len))
        if err:
            out["errors"]["operator_selection"] = err
    if sel is None:
        name, n, cat, linked = old
        why = "CallGraph failed" if "CallGraph" in out["errors"] else (
            f"no host event name gives HTA a call with >= {min_len} device events")
        sel = {
            "rule": f"fallback ({why}): old rule, most device events credited",
            "operator_name": name,
            "categories": [cat] if cat else [],
            "device_events_credited": n,
            "device_events_linked_to_a_launch": linked,
        }
        if name is not None:
            sel["names_containing_operator"] = sorted(m for m in _names_on_rank(ta, rank).values() if name in m)
    name = sel["operator_name"]
    out["args"] = {"operator_name": name, "rank": int(rank), **KERNEL_SEQ_ARGS}
    out["operator_selection"] = sel
    if name is None:
        out["rows"] = None
        out["note"] = "no CPU op encloses a launch of a device event on this rank; HTA not called"
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    res, err = call(
        lambda: ta.get_frequent_cuda_kernel_sequences(
            operator_name=name, output_dir=str(out_dir), rank=rank, visualize=False, **KERNEL_SEQ_ARGS
        )
    )
    if err:
        out["errors"]["get_frequent_cuda_kernel_sequences"] = err
        out["rows"] = None
        return out
    rows = df_records(res)
    out["rows"] = rows
    if not rows:
        out["note"] = f"HTA returned an empty dataframe: no call searched launched >= {min_len} device events"
    total = sum(r["count"] for r in rows)
    out["calls_in_rows"] = total
    if "calls_searched" in sel and total != sel["calls_searched"]:
        out["errors"]["check"] = f"rows' counts add up to {total}, the rule predicted {sel['calls_searched']}"
    return out


def analyse(job: str, kind: str, trace_root: Path, tmp_root: Path) -> tuple:
    src = trace_root / job
    hta_dir, dir_note = prepare_dir(src, tmp_root)
    entry: Dict[str, Any] = {
        "kind": kind,
        "trace_files": sorted(p.name for p in src.iterdir() if _is_trace_file(p)),
        "hta_trace_dir": dir_note,
        "errors": {},
    }
    timing: Dict[str, Any] = {}

    t0 = time.perf_counter()
    ta, err = call(lambda: TraceAnalysis(trace_dir=str(hta_dir), include_last_profiler_step=INCLUDE_LAST_PROFILER_STEP))
    t1 = time.perf_counter()
    timing["load_s"] = round(t1 - t0, 4)
    if err:
        entry["errors"]["TraceAnalysis"] = err
        timing["error"] = err
        return entry, timing

    entry["ranks"] = [int(r) for r in ta.t.get_ranks()]
    entry["rank_to_file"] = {str(r): Path(p).name for r, p in sorted(ta.t.trace_files.items())}
    entry["rows_per_rank"] = {str(r): int(len(df)) for r, df in ta.t.traces.items()}
    entry["gpu_rows_per_rank"] = {str(r): int(df["stream"].ne(-1).sum()) for r, df in ta.t.traces.items()}

    t2 = time.perf_counter()
    tb, err = call(lambda: ta.get_temporal_breakdown(visualize=False))
    t3 = time.perf_counter()
    timing["temporal_breakdown_s"] = round(t3 - t2, 4)
    timing["load_plus_temporal_s"] = round(t3 - t0, 4)
    if err:
        entry["errors"]["get_temporal_breakdown"] = err
    entry["temporal_breakdown"] = per_rank(df_records(tb))
    if entry["temporal_breakdown"]:
        entry["temporal_breakdown"] = {k: v[0] for k, v in entry["temporal_breakdown"].items()}

    ov, err = call(lambda: ta.get_comm_comp_overlap(visualize=False))
    if err:
        entry["errors"]["get_comm_comp_overlap"] = err
    ovu, err2 = call(lambda: overlap_unrounded(ta))
    if ov is not None:
        unr = {} if ovu is None else {str(r["rank"]): r["comp_comm_overlap_pctg"] for r in df_records(ovu)}
        entry["comm_comp_overlap"] = {
            str(r["rank"]): {
                "comp_comm_overlap_pctg": r["comp_comm_overlap_pctg"],
                "comp_comm_overlap_pctg_unrounded": unr.get(str(r["rank"])),
            }
            for r in df_records(ov)
        }

    kb: Dict[str, Any] = {}
    for label, kwargs in (
        ("default", dict(visualize=False)),
        ("full", dict(visualize=False, num_kernels=FULL_NUM_KERNELS, duration_ratio=1.0, include_memory_kernels=True)),
    ):
        res, err = call(lambda kwargs=kwargs: ta.get_gpu_kernel_breakdown(**kwargs))
        if err:
            entry["errors"][f"get_gpu_kernel_breakdown[{label}]"] = err
            continue
        type_df, kern_df = res
        kb[label] = {
            "args": {k: v for k, v in kwargs.items() if k != "visualize"},
            "kernel_type_all_ranks": df_records(type_df),
            "per_kernel": per_rank(df_records(kern_df)),
        }
    if "full" in kb:
        counts = kernel_counts(ta)
        for rank, rows in (kb["full"]["per_kernel"] or {}).items():
            for row in rows:
                row["count"] = counts.get(rank, {}).get(row["name"])
        ktr, err = call(lambda: kernel_type_per_rank(ta))
        if err:
            entry["errors"]["kernel_type_per_rank"] = err
        else:
            kb["full"]["kernel_type_per_rank"] = ktr
    if "default" in kb:
        kb["default"]["args"] = {"duration_ratio": 0.8, "num_kernels": 10, "include_memory_kernels": True}
    entry["gpu_kernel_breakdown"] = kb

    ranks = ta.t.get_ranks()
    idle, err = call(
        lambda: ta.get_idle_time_breakdown(ranks=ranks, visualize=False, show_idle_interval_stats=True)
    )
    if err:
        entry["errors"]["get_idle_time_breakdown"] = err
    else:
        idle_df, stats_df = idle
        entry["idle_time_breakdown"] = {
            "args": {"ranks": [int(r) for r in ranks], "consecutive_kernel_delay": 30, "show_idle_interval_stats": True},
            "breakdown": per_rank(df_records(idle_df)),
            "interval_stats": per_rank(df_records(stats_df, keep_index="idle_category")),
        }

    # New keys, computed after everything above; their errors stay inside each key. kernel_sequences is not
    # computed here but by --kernel-sequences under pandas 2 (see docstring); main() keeps the stored one.
    t4 = time.perf_counter()
    entry["launch_stats"] = errors_last(launch_stats(ta, ranks))
    entry["queue_length"] = errors_last(queue_length(ta, ranks))
    entry["memory_bw"] = errors_last(memory_bw(ta, ranks))
    timing["launch_queue_membw_s"] = round(time.perf_counter() - t4, 4)
    return entry, timing


def errors_last(d: Dict[str, Any]) -> Dict[str, Any]:
    errors = d.pop("errors")
    return {**d, "errors": errors}


def analyse_kernel_sequences(job: str, trace_root: Path, tmp_root: Path) -> Optional[Dict[str, Any]]:
    """The kernel_sequences key of one job, loaded exactly as analyse() loads it; None if HTA cannot load it."""
    hta_dir, _ = prepare_dir(trace_root / job, tmp_root)
    ta, err = call(lambda: TraceAnalysis(trace_dir=str(hta_dir), include_last_profiler_step=INCLUDE_LAST_PROFILER_STEP))
    if err:
        return None
    out_dir = tmp_root / "kernel_sequences" / job.replace("/", "_")
    return errors_last(kernel_sequences(ta, min(ta.t.get_ranks()), out_dir))


def shrink_if_needed(doc: Dict[str, Any]) -> None:
    """Keep the file under MAX_JSON_BYTES: top-N per-kernel rows by sum (+ totals) where needed."""
    def size() -> int:
        return len(json.dumps(doc, allow_nan=False))

    if size() <= MAX_JSON_BYTES:
        return
    for job in doc["jobs"].values():
        full = job.get("gpu_kernel_breakdown", {}).get("full")
        if not full or not full.get("per_kernel"):
            continue
        for rank, rows in full["per_kernel"].items():
            if len(rows) <= TOP_N_IF_TOO_BIG:
                continue
            rows_sorted = sorted(rows, key=lambda r: -(r.get("sum (us)") or 0))
            full.setdefault("truncated", {})[rank] = {
                "n_kernels": len(rows),
                "total_sum (us)": sum(r.get("sum (us)") or 0 for r in rows),
                "total_count": sum(r.get("count") or 0 for r in rows),
                "kept_top_by_sum": TOP_N_IF_TOO_BIG,
            }
            full["per_kernel"][rank] = rows_sorted[:TOP_N_IF_TOO_BIG]
        if size() <= MAX_JSON_BYTES:
            return


KS_ENV_KEY = "kernel_sequences_environment"


def _insert_after(doc: Dict[str, Any], after: str, key: str, value: Any) -> Dict[str, Any]:
    """doc with doc[key] = value, placed right after `after` (order of the other keys kept)."""
    out: Dict[str, Any] = {}
    for k, v in doc.items():
        if k != key:
            out[k] = v
        if k == after:
            out[key] = value
    if key not in out:
        out[key] = value
    return out


def main_kernel_sequences(args: argparse.Namespace, jobs: Dict[str, str], hta_version: str) -> None:
    """--kernel-sequences: replace only jobs[*].kernel_sequences and KS_ENV_KEY in the existing --out file."""
    if int(pd.__version__.split(".")[0]) >= 3:
        sys.exit(f"--kernel-sequences needs pandas < 3 (HTA 0.5.0's call graph raises under pandas {pd.__version__})")
    if not args.out.exists():
        sys.exit(f"{args.out} missing: run the script without --kernel-sequences first")
    doc = json.loads(args.out.read_text())
    with tempfile.TemporaryDirectory(prefix="hta_kernel_sequences_") as tmp:
        for job in jobs:
            if job not in doc["jobs"] or not (args.traces / job).is_dir():
                print(f"skip {job}: not in {args.out} or {args.traces / job} missing", file=sys.stderr)
                continue
            t0 = time.perf_counter()
            ks = analyse_kernel_sequences(job, args.traces, Path(tmp))
            if ks is None:
                print(f"== {job}: HTA cannot load it, no kernel_sequences", file=sys.stderr)
                doc["jobs"][job].pop("kernel_sequences", None)
                continue
            doc["jobs"][job]["kernel_sequences"] = jsonable(ks)
            rows = ks["rows"]
            print(f"== {job}: {ks['args']['operator_name']!r}, "
                  f"{'no' if rows is None else len(rows)} rows, {time.perf_counter() - t0:.1f}s"
                  + (f", errors: {ks['errors']}" if ks["errors"] else ""), file=sys.stderr)
    env = {
        "HolisticTraceAnalysis": hta_version,
        "pandas": pd.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "note": "the jobs' kernel_sequences keys are computed with these versions (--kernel-sequences); "
                "every other key with those under \"environment\"",
    }
    doc = _insert_after(doc, "environment", KS_ENV_KEY, env)
    text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
    if len(text) > MAX_JSON_BYTES:
        sys.exit(f"{len(text)} bytes > {MAX_JSON_BYTES}: not written")
    args.out.write_text(text)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--timings", type=Path, default=DEFAULT_TIMINGS)
    ap.add_argument("--only", action="append", default=None)
    ap.add_argument("--kernel-sequences", action="store_true",
                    help="pandas-2 venv: recompute only the kernel_sequences key in the existing --out file")
    args = ap.parse_args()

    _hta_logger.setLevel(logging.ERROR)
    hta_version = getattr(hta, "__version__", None)
    if hta_version is None:
        from importlib.metadata import version

        hta_version = version("HolisticTraceAnalysis")
    if hta_version != EXPECTED_HTA_VERSION:
        sys.exit(f"expected HTA {EXPECTED_HTA_VERSION}, found {hta_version}")

    jobs = {k: v for k, v in JOBS.items() if not args.only or k in args.only}
    if args.kernel_sequences:
        return main_kernel_sequences(args, jobs, hta_version)
    old = json.loads(args.out.read_text()) if args.out.exists() else {"jobs": {}}
    doc: Dict[str, Any] = {
        "generator": "tests/hta/regenerate_expected.py",
        "environment": {
            "HolisticTraceAnalysis": hta_version,
            "pandas": pd.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "env": {"HTA_DISABLE_NS_ROUNDING": os.environ["HTA_DISABLE_NS_ROUNDING"]},
            "TraceAnalysis_kwargs": {"include_last_profiler_step": INCLUDE_LAST_PROFILER_STEP},
        },
        "units": "all times in microseconds (trace ts/dur units), as HTA reports them; NaN stored as null",
        "jobs": {},
    }
    timings: Dict[str, Any] = {
        "note": "informative only: wall time of HTA TraceAnalysis(trace_dir, include_last_profiler_step=True) "
        "(parse + align/filter) and of get_temporal_breakdown(visualize=False), single run, warm file cache",
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "pandas": pd.__version__,
            "HolisticTraceAnalysis": hta_version,
        },
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "jobs": {},
    }
    with tempfile.TemporaryDirectory(prefix="hta_expected_") as tmp:
        for job, kind in jobs.items():
            if not (args.traces / job).is_dir():
                print(f"skip {job}: {args.traces / job} missing", file=sys.stderr)
                continue
            print(f"== {job}", file=sys.stderr)
            entry, timing = analyse(job, kind, args.traces, Path(tmp))
            doc["jobs"][job] = entry
            timings["jobs"][job] = timing
            if entry["errors"]:
                print(f"   errors: {entry['errors']}", file=sys.stderr)
            for key in ("launch_stats", "queue_length", "memory_bw", "kernel_sequences"):
                if entry.get(key, {}).get("errors"):
                    print(f"   {key} errors: {entry[key]['errors']}", file=sys.stderr)

    if args.only:  # the other jobs stay as they were
        for path, new in ((args.out, doc), (args.timings, timings)):
            if path.exists():
                new["jobs"] = {**json.loads(path.read_text())["jobs"], **new["jobs"]}
    # kernel_sequences is written by --kernel-sequences only (pandas 2): keep the stored one
    missing = []
    for job, entry in doc["jobs"].items():
        if "kernel_sequences" in old["jobs"].get(job, {}):
            entry["kernel_sequences"] = old["jobs"][job]["kernel_sequences"]
        elif "temporal_breakdown" in entry or "launch_stats" in entry:
            missing.append(job)
    if KS_ENV_KEY in old:
        doc = _insert_after(doc, "environment", KS_ENV_KEY, old[KS_ENV_KEY])
    if missing:
        print(f"no stored kernel_sequences for {missing}: run --kernel-sequences with pandas 2", file=sys.stderr)
    doc = jsonable(doc)
    shrink_if_needed(doc)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    args.timings.write_text(json.dumps(jsonable(timings), indent=1, allow_nan=False) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes) and {args.timings}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except Exception:  # pragma: no cover
        traceback.print_exc()
        sys.exit(1)
