"""Regenerate HolisticTraceAnalysis's critical path on the single-rank real traces (tests/data/hta_critical_path.json).

Not part of the test suite; run it with HTA 0.5.0 in a scratch venv, as ``regenerate_expected.py``:

    cd /work/main && /work/hta-venv/bin/python tests/hta/regenerate_critical_path.py

For each trace: ``TraceAnalysis.critical_path_analysis(rank=0, annotation, instance_id)`` (``annotation=""`` for a
trace without ``ProfilerStep#N``: the whole trace), then the path's total length and its time by
``bound_by`` (``get_critical_path_breakdown``), in µs.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
from hta.trace_analysis import TraceAnalysis

JOBS = {"real/hta_alexnet": ("", None), "real/hta_cuda_event_sync": ("ProfilerStep", 0)}


def main() -> None:
    logging.disable(logging.WARNING)
    root = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
    out = {}
    for job, (annotation, instance) in JOBS.items():
        cp, ok = TraceAnalysis(trace_dir=str(root / job)).critical_path_analysis(
            rank=0, annotation=annotation, instance_id=instance)
        edges = cp.get_critical_path_breakdown()
        out[job] = {"ok": bool(ok), "annotation": annotation, "instance_id": instance,
                    "total_us": float(edges["duration"].sum()),
                    "by_bound_us": {k or "dependency": float(v)
                                    for k, v in edges.groupby("bound_by")["duration"].sum().items()}}
    path = Path(__file__).resolve().parents[1] / "data" / "hta_critical_path.json"
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
