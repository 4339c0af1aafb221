"""Regenerate the HolisticTraceAnalysis (HTA) 0.5.0 reference values used by the HTA-agreement tests.

This script is NOT part of the test suite and must NOT run inside the project's venv: it imports HTA,
which is never installed into /work/venv. Run it with HTA 0.5.0 installed in a scratch venv:

    python3 -m venv /work/hta-venv
    /work/hta-venv/bin/pip install HolisticTraceAnalysis==0.5.0
    cd /work/main && /work/hta-venv/bin/python tests/hta/regenerate_expected.py

(HTA 0.5.0 needs no torch; pip pulls jupyterlab/plotly/pandas. The stored values were produced with
the versions recorded under "environment" in the output (pandas 3.1.1); pandas 2.2.3 + numpy 2.2.6 gave a
byte-identical file. The script sets HTA_DISABLE_NS_ROUNDING=1 itself before importing HTA, so no
variable has to be exported. Output is deterministic: rerunning gives an identical hta_expected.json.)

Options: --traces DIR (default: ../shared/traces beside the repository, i.e. /work/shared/traces),
--out FILE (default tests/data/hta_expected.json), --timings FILE (default tests/hta/hta_timings.json),
--only NAME (repeatable; job keys such as real/hta_amd_trace): recompute only those jobs; the others are kept
as the existing --out and --timings files have them.

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
NaN values are stored as JSON null.

Gloo job folders contain a generation_info.json next to the traces; HTA would take it for a trace of
rank 0 (see notes), so those jobs are run on a temporary directory of symlinks to the *.json.gz trace
files only. Nothing is copied into the repository.

Timings (HTA TraceAnalysis() load + get_temporal_breakdown wall time) go to a separate file and are
informative only.
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
    return entry, timing


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--timings", type=Path, default=DEFAULT_TIMINGS)
    ap.add_argument("--only", action="append", default=None)
    args = ap.parse_args()

    _hta_logger.setLevel(logging.ERROR)
    hta_version = getattr(hta, "__version__", None)
    if hta_version is None:
        from importlib.metadata import version

        hta_version = version("HolisticTraceAnalysis")
    if hta_version != EXPECTED_HTA_VERSION:
        sys.exit(f"expected HTA {EXPECTED_HTA_VERSION}, found {hta_version}")

    jobs = {k: v for k, v in JOBS.items() if not args.only or k in args.only}
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

    if args.only:  # the other jobs stay as they were
        for path, new in ((args.out, doc), (args.timings, timings)):
            if path.exists():
                new["jobs"] = {**json.loads(path.read_text())["jobs"], **new["jobs"]}
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
