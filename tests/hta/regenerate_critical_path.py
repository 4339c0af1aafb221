"""Regenerate HolisticTraceAnalysis's critical path on every shared real GPU trace (tests/data/hta_critical_path.json).

Not part of the test suite. HTA 0.5.0's critical path raises under pandas 3 (``DataFrame.drop(axis=1, columns=...)``
in ``_create_event_nodes``), so run it in the pandas 2 scratch venv of ``regenerate_expected.py --kernel-sequences``:

    python3 -m venv /tmp/hta_work/venv-pd2
    /tmp/hta_work/venv-pd2/bin/pip install HolisticTraceAnalysis==0.5.0 pandas==2.2.3 numpy==2.2.6
    cd /work/main && /tmp/hta_work/venv-pd2/bin/python tests/hta/regenerate_critical_path.py

For each job folder under ``../shared/traces/real`` with device work (``TraceAnalysis(include_last_profiler_step=True)``,
as ``regenerate_expected.py`` loads them), each rank, and each host ``ProfilerStep#N``
(the whole trace, ``annotation=""``, for a trace without one): ``TraceAnalysis.critical_path_analysis(rank,
annotation="ProfilerStep", instance_id=i)``, where ``i`` is the step's position among the events HTA matches for
that annotation (the host ``ProfilerStep#N`` and the GPU's ``gpu_user_annotation`` of the same name come in one
list, so the position is looked up, not counted); then the path's total and its time by ``bound_by``
(``get_critical_path_breakdown``), in µs, and the share of the path on the GPU as the tests compare it:
``gpu_compute_bound`` + ``gpu_kernel_kernel_overhead``. HTA gives a blocking runtime call (``cudaDeviceSynchronize``)
zero weight, so its total is shorter than the step where the host waits. A failing call is stored as its error.
Output is deterministic.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
from hta.trace_analysis import TraceAnalysis  # noqa: E402

STEP = re.compile(r"ProfilerStep#(\d+)$")
GPU_BOUND = ("gpu_compute_bound", "gpu_kernel_kernel_overhead")


def _steps(ta: TraceAnalysis, rank: int) -> list[tuple[int, int]]:
    """``(N, instance)`` of each host ``ProfilerStep#N`` of the rank, as HTA's ``critical_path_analysis`` numbers
    the instances of ``annotation="ProfilerStep"``."""
    df = ta.t.get_trace(rank)
    sym = ta.t.symbol_table.get_sym_id_map()
    names = {v: k for k, v in sym.items()}
    ids = [v for k, v in sym.items() if "ProfilerStep" in k]
    rows = df[df["name"].isin(ids)]
    out = []
    for i, (name, stream) in enumerate(zip(rows["name"], rows["stream"])):
        m = STEP.match(names[name])
        if m and stream == -1:
            out.append((int(m.group(1)), i))
    return out


def _one(ta: TraceAnalysis, rank: int, annotation: str, instance: int | None) -> dict:
    try:
        cp, ok = ta.critical_path_analysis(rank=rank, annotation=annotation, instance_id=instance)
        edges = cp.get_critical_path_breakdown()
    except Exception as e:  # noqa: BLE001 - HTA's own failure is a fact worth storing
        return {"error": f"{type(e).__name__}: {e}"}
    by = {k or "dependency": float(v) for k, v in sorted(edges.groupby("bound_by")["duration"].sum().items())}
    total = float(edges["duration"].sum())
    return {"ok": bool(ok), "instance_id": instance, "total_us": total, "by_bound_us": by,
            "gpu_share": round(sum(by.get(k, 0.0) for k in GPU_BOUND) / total, 6) if total else None}


def main() -> None:
    logging.disable(logging.WARNING)
    root = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "real"
    out = {}
    for job in sorted(p for p in root.iterdir() if p.is_dir()):
        ta = TraceAnalysis(trace_dir=str(job), include_last_profiler_step=True)
        ranks = sorted(ta.t.traces)
        if not any((ta.t.get_trace(r)["stream"] >= 0).any() for r in ranks):
            continue  # no device work: nothing on a GPU to compare
        per_rank = {}
        for rank in ranks:
            steps = _steps(ta, rank)
            per_rank[str(rank)] = ({str(n): _one(ta, rank, "ProfilerStep", i) for n, i in steps} if steps
                                   else {"-1": _one(ta, rank, "", None)})
        out[f"real/{job.name}"] = per_rank
        print(job.name, {r: {s: v.get("gpu_share", v.get("error")) for s, v in st.items()}
                         for r, st in per_rank.items()}, file=sys.stderr)
    path = Path(__file__).resolve().parents[1] / "data" / "hta_critical_path.json"
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
