"""Write an 8-rank example and merge it through the Python API on an embedded LocalCluster.

Run: python examples/merge_example.py [OUT_DIR]
"""
from __future__ import annotations

import sys

from tracefuse_dask import TraceFuse, merge_traces
from tracefuse_dask.synth import write_example


def main(out_dir: str = "demo") -> None:
    paths = write_example(f"{out_dir}/traces", ranks=8, rank_bytes=1_000_000, straggler=5)
    summary = merge_traces(f"{out_dir}/traces", f"{out_dir}/merged.json.gz", force=True, workers=2)
    print(f"{summary.ranks} ranks, {summary.events_out:,} events -> {summary.output} "
          f"({summary.bytes_out / 1e6:.1f} MB, {summary.seconds:.1f} s)")
    # The TraceLens-compatible call: ranks 0 and 4 only, given as a {rank: path} dict.
    out = TraceFuse({0: paths[0], 4: paths[4]}, max_workers=2).merge_and_save(f"{out_dir}/ranks_0_4.json.gz")
    print(f"ranks 0 and 4 -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
