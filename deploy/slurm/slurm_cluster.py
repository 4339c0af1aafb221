"""Merge on a Slurm cluster started by dask-jobqueue (pip install dask-jobqueue tracefuse_dask).

Run it on a login node: python deploy/slurm/slurm_cluster.py /shared/job42/traces /shared/job42/merged.json.gz
"""
from __future__ import annotations

import sys

from dask_jobqueue import SLURMCluster
from distributed import Client

from tracefuse_dask import merge_traces


def main(inputs: str, output: str, jobs: int = 4) -> None:
    # The workers keep glibc's malloc trimming, not Dask's MALLOC_TRIM_THRESHOLD_=65536 (~10% per task), and 256 MiB
    # of freed heap for their next task (MALLOC_TOP_PAD_) in one arena (MALLOC_ARENA_MAX).
    environ = "{'MALLOC_TRIM_THRESHOLD_': None, 'MALLOC_TOP_PAD_': 268435456, 'MALLOC_ARENA_MAX': 1}"
    cluster = SLURMCluster(cores=8, processes=8, memory="32GB", walltime="01:00:00", queue="cpu",
                           job_extra_directives=["--exclusive"], job_script_prologue=[
                               f"export DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON=\"{environ}\""])
    cluster.scale(jobs=jobs)  # jobs x 8 single-threaded workers
    with cluster, Client(cluster) as client:
        client.wait_for_workers(8, timeout=600)
        summary = merge_traces(inputs, output, client=client, skip_if_unchanged=True)
        print(summary.to_json())


if __name__ == "__main__":
    main(*sys.argv[1:3])
