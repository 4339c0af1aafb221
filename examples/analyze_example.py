"""Write an 8-rank example with a straggler, analyse it, and print what a performance engineer looks at first.

Run: python examples/analyze_example.py [OUT_DIR]
"""
from __future__ import annotations

import sys

from tracefuse_dask import analyze
from tracefuse_dask.synth import write_example


def main(out_dir: str = "demo") -> None:
    write_example(f"{out_dir}/traces", ranks=8, rank_bytes=1_000_000, straggler=5)
    a = analyze(f"{out_dir}/traces", f"{out_dir}/report", force=True, workers=2)
    print(a.summary["straggler"]["evidence"])
    print(a.breakdown[["rank", "gpu_span_us", "idle_us", "computation_us", "exposed_comm_us"]].to_string(index=False))
    top = a.kernels.groupby("name")["total_us"].sum().nlargest(3)
    print("top kernels (µs, all ranks):", ", ".join(f"{name[:40]} {us:,.0f}" for name, us in top.items()))
    print(f"report: {out_dir}/report/report.html")


if __name__ == "__main__":
    main(*sys.argv[1:2])
