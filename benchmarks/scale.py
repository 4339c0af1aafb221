"""Benchmark tracefuse_dask at scale: memory as the rank count grows, the cost of many small ranks.

Usage: ``python benchmarks/scale.py [--memory-ranks 8,64,512] [--rank-mb 20] [--shape a100] [--small-ranks 10000]
[--small-kb 50]``

On one pre-started cluster, merges to ``.json.gz``: first ``--memory-ranks`` ranks of ``--rank-mb`` MB (hard links
to 8 distinct generated ranks, the rank from the file name; with ``--shape``, 8 ranks that
``../shared/tools/make_dataset.py`` builds from that real trace, given as ``{rank: path}``), with the tree's and
the client's peak memory against
the bound of the performance issue; then ``--small-ranks`` ranks of ``--small-kb`` kB against the same bytes in 8
large ranks (the per-rank overhead), and the same small ranks with each rank's default process group listing every
rank. Last, ``analyze`` of every rank of a generated job of ``--small-ranks`` ranks, its client in a process of
its own. With ``--shape``, the small ranks are copies of one rank of that shape cut to ``--small-kb``
(``small_template``), the 8 large ranks are of that shape too, and the job analysed is the small ranks that list
every rank.

Takes 10-17 minutes on 2 cores with the defaults (most of it the analysis of 10,000 ranks);
``--memory-ranks 8 --rank-mb 1 --small-ranks 100 --small-kb 20`` takes under a minute.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from typing import Any

import orjson
from common import (
    MB,
    REAL_SHAPES,
    TreeRSS,
    at_least_one,
    check_real_shapes,
    cleanup,
    environment,
    in_child,
    make_real,
    make_root,
    make_synthetic,
    measure_one,
    parser,
    warm,
    write_report,
)

from tracefuse_dask.kineto.vocabulary import is_collective_call
from tracefuse_dask.synth import make_rank_trace


def _write_copies(args: tuple[bytes, int, int, int, str, bool]) -> int:
    """Write ranks ``first..last-1`` as copies of one template trace, each with its own rank; with
    ``full_groups`` the default process group lists all ``world_size`` ranks, as a real job's does."""
    template, first, last, world_size, folder, full_groups = args
    doc = orjson.loads(template)
    if full_groups:
        doc["distributedInfo"]["pg_config"][0].update(pg_size=world_size, ranks=list(range(world_size)))
    for r in range(first, last):
        doc["distributedInfo"].update(rank=r, world_size=world_size)
        with open(os.path.join(folder, f"rank{r}.pt.trace.json"), "wb") as f:
            f.write(orjson.dumps(doc))
    return (last - first) * len(orjson.dumps(doc))


def make_small_ranks(pool: Any, root: str, ranks: int, template: bytes, full_groups: bool = False) -> tuple[str, int]:
    """``ranks`` copies of ``template``, each with its own ``distributedInfo.rank``; (folder, bytes)."""
    folder = os.path.join(root, f"in_{ranks}_small{'_groups' if full_groups else ''}")
    os.makedirs(folder)
    step = 500
    jobs = [(template, a, min(a + step, ranks), ranks, folder, full_groups) for a in range(0, ranks, step)]
    return folder, sum(pool.map(_write_copies, jobs, chunksize=1))


def small_template(root: str, rank_kb: float, shape: str | None) -> bytes:
    """One rank of about ``rank_kb`` kB: generated, or with ``shape`` a rank that ``make_dataset.py`` builds from
    that real trace (one source window, about 2 MB) cut to its metadata and its events of a stretch of time from
    its first collective call, as many as fit, in their own order and with their own keys (written compactly by orjson). A rank without a
    default process group gets one, so that the rows that list every rank in it can."""
    if shape is None:
        return orjson.dumps(make_rank_trace(0, 8, target_bytes=int(rank_kb * 1000), seed=0))
    _, paths, _ = make_real(shape, root, 1, 0.05)
    with open(paths[0], "rb") as f:
        doc = orjson.loads(f.read())
    events = doc["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    timed = sorted((e for e in events if e.get("ph") != "M" and "ts" in e), key=lambda e: e["ts"])
    calls = [e["ts"] for e in timed if e.get("ph") == "X" and is_collective_call(e.get("name", ""))]
    timed = [e for e in timed if e["ts"] >= min(calls, default=timed[0]["ts"])]  # from its first collective
    lo, hi = 0, len(timed)
    while lo < hi:  # the most events by time that fit
        mid = (lo + hi + 1) // 2
        doc["traceEvents"] = meta + timed[:mid]
        lo, hi = (mid, hi) if len(orjson.dumps(doc)) <= rank_kb * 1000 else (lo, mid - 1)
    kept = {id(e) for e in timed[:lo]}
    doc["traceEvents"] = meta + [e for e in events if id(e) in kept]
    info = doc.setdefault("distributedInfo", {"backend": "nccl", "rank": 0, "world_size": 1})
    info.setdefault("pg_config", [{"pg_name": "0", "pg_desc": "default_pg", "backend": "nccl", "pg_size": 1,
                                   "ranks": [0]}])
    return orjson.dumps(doc)


def _write_nameless(args: tuple[int, int, str]) -> int:
    rank, rank_bytes, path = args
    doc = make_rank_trace(rank, 8, target_bytes=rank_bytes, seed=0)
    del doc["distributedInfo"]  # the rank comes from the file name, so that copies can stand for other ranks
    data = orjson.dumps(doc)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _analyze_client(address: str, security: Any, folder: str) -> tuple[float, int, int, int]:
    """In a process of its own, a client that analyses ``folder``: (seconds, its peak RSS in bytes, ranks,
    collective calls)."""
    import resource

    from distributed import Client

    from tracefuse_dask import analyze

    with Client(address, security=security) as client:  # the embedded cluster's TLS credentials
        t = time.perf_counter()
        a = analyze(folder, client=client)
        seconds = time.perf_counter() - t
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, len(a.breakdown), len(a.collectives)


def make_linked_ranks(pool: Any, root: str, counts: list[int], rank_mb: float,
                      shape: str | None = None) -> list[tuple[int, Any, int]]:
    """Inputs of ``n`` ranks each: folders of hard links to 8 distinct generated ranks (no disk space per rank), or
    with ``shape`` ``{rank: path}`` dicts over 8 ranks built from that real trace."""
    if shape:
        _, paths, _ = make_real(shape, root, 8, rank_mb)
        sizes = [os.path.getsize(p) for p in paths]
        return [(n, {r: paths[r % 8] for r in range(n)}, sum(sizes[r % 8] for r in range(n))) for n in counts]
    base = os.path.join(root, "distinct")
    os.makedirs(base)
    paths = [os.path.join(base, f"r{r}.json") for r in range(8)]
    sizes = pool.map(_write_nameless, [(r, int(rank_mb * MB), p) for r, p in enumerate(paths)], chunksize=1)
    out = []
    for n in counts:
        folder = os.path.join(root, f"linked_{n}")
        os.makedirs(folder)
        for r in range(n):
            os.link(paths[r % 8], os.path.join(folder, f"rank{r}.pt.trace.json"))
        out.append((n, folder, sum(sizes[r % 8] for r in range(n))))
    return out


def main(argv: list[str] | None = None) -> int:
    """The memory of merges from 8 to many ranks of 20 MB, then the per-rank overhead of many small ranks,
    then the analysis of every rank of a job of that many ranks (its client in a process of its own).

    The memory rows come first: a process keeps the memory it once used, so the client's peak of the
    many-ranks row would hide theirs.
    """
    ap = parser(__doc__)
    ap.add_argument("--memory-ranks", default="8,64,512",
                    help="rank counts of the memory rows, hard links to 8 distinct ranks (default 8,64,512)")
    ap.add_argument("--rank-mb", type=float, default=20,
                    help="uncompressed MB per rank of the memory rows (default 20)")
    ap.add_argument("--shape", choices=sorted(REAL_SHAPES), default=None,
                    help="build the memory rows' 8 distinct ranks from this real trace (default: generated ranks)")
    ap.add_argument("--small-ranks", type=int, default=10_000,
                    help="ranks of the per-rank overhead rows and of the analysed job (default 10000)")
    ap.add_argument("--small-kb", type=float, default=50, help="kB per small rank (default 50)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the cluster (default 2)")
    ap.add_argument("--repeat", type=at_least_one, default=1,
                    help="runs per merge row; its time is its best (default 1)")
    args = ap.parse_args(argv)
    check_real_shapes([args.shape] if args.shape else [])

    from tracefuse_dask import merge_traces
    from tracefuse_dask.cluster import connect

    ctx = multiprocessing.get_context("spawn")
    print(environment() + f"Every merge runs on the embedded cluster (`cluster.connect`), pre-started, of "
          f"{args.workers} single-threaded worker programs and writes .json.gz. RSS = summed over the process "
          "tree, sampled every 25 ms; the client is this process.\n", flush=True)
    root = make_root("tracefuse-scale-", args.tmp_dir)
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    try:
        with ctx.Pool(args.workers) as pool:
            t = time.perf_counter()
            template = small_template(root, args.small_kb, args.shape)
            small, small_bytes = make_small_ranks(pool, root, args.small_ranks, template)
            grouped, grouped_bytes = make_small_ranks(pool, root, args.small_ranks, template, full_groups=True)
            if args.shape:  # the job analysed: the same real-shaped ranks; the same bytes in 8 ranks of the shape
                job, job_bytes = grouped, grouped_bytes
                large, _, large_bytes = make_real(args.shape, root, 8, small_bytes / 8 / MB)
            else:  # every rank of one job: its pg_config lists all the job's ranks (its calls the first 30, as Kineto)
                job, _, job_bytes = make_synthetic(pool, root, args.small_ranks, args.small_kb / 1000)
                large, _, large_bytes = make_synthetic(pool, root, 8, small_bytes / 8 / MB)
            linked = make_linked_ranks(pool, root, [int(x) for x in args.memory_ranks.split(",")], args.rank_mb,
                                       args.shape)
            print(f"generated the datasets in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        with connect(workers=args.workers) as client:
            client.run(warm)

            def merge(folder: Any, name: str) -> tuple[float, TreeRSS, Any]:
                out = os.path.join(root, f"{name}.json.gz")
                seconds, mem, res = measure_one(lambda: merge_traces(folder, out, client=client, force=True),
                                                args.repeat)
                os.remove(out)
                return seconds, mem, res

            bound = (args.workers * 4 * args.rank_mb * MB + 0.5e9) / 2**20
            emit("")
            emit(f"Memory bound of the performance issue: workers × 4 × {args.rank_mb:g} MB + 0.5 GB = "
                 f"{bound:,.0f} MiB (whole tree); the client under 300 MB.")
            emit("")
            emit("| dataset | s | MB/s | peak RSS MiB | Δ peak RSS MiB | client peak RSS MiB | within bound |")
            emit("|---|---|---|---|---|---|---|")
            shape = f" ({args.shape})" if args.shape else ""
            for n, ranks, size in linked:
                s, mem, res = merge(ranks, f"linked_{n}")
                ok = mem.peak / 2**20 <= bound and mem.self_peak < 300e6
                emit(f"| {n} × {args.rank_mb:g} MB{shape} | {s:.2f} | {size / MB / s:.1f} | {mem.peak / 2**20:,.0f} | "
                     f"{(mem.peak - mem.baseline) / 2**20:,.0f} | {mem.self_peak / 2**20:,.0f} | "
                     f"{'yes' if ok else 'NO'} |")
            emit("")
            emit("| dataset | ranks | MB | s | MB/s | per-rank overhead ms | peak RSS MiB | client peak RSS MiB | "
                 "events in → out |")
            emit("|---|---|---|---|---|---|---|---|---|")
            big_s, mem, res = merge(large, "large")
            emit(f"| 8 large ranks, same bytes | 8 | {large_bytes / MB:,.0f} | {big_s:.2f} | "
                 f"{large_bytes / MB / big_s:.1f} | – | {mem.peak / 2**20:,.0f} | {mem.self_peak / 2**20:,.0f} | "
                 f"{res.events_in:,} → {res.events_out:,} |")
            s, mem, res = merge(small, "small")
            over = (s - big_s * small_bytes / large_bytes) / args.small_ranks * 1000
            emit(f"| {args.small_ranks:,} × {args.small_kb:g} kB | {args.small_ranks:,} | {small_bytes / MB:,.0f} | "
                 f"{s:.2f} | {small_bytes / MB / s:.1f} | {over:.2f} | {mem.peak / 2**20:,.0f} | "
                 f"{mem.self_peak / 2**20:,.0f} | {res.events_in:,} → {res.events_out:,} |")
            s, mem, res = merge(grouped, "grouped")
            emit(f"| the same, each rank's default process group listing all {args.small_ranks:,} ranks | "
                 f"{args.small_ranks:,} | {grouped_bytes / MB:,.0f} | {s:.2f} | {grouped_bytes / MB / s:.1f} | – | "
                 f"{mem.peak / 2**20:,.0f} | {mem.self_peak / 2**20:,.0f} | {res.events_in:,} → {res.events_out:,} |")
            emit("")
            emit("| analysis (`analyze`, the client in a process of its own) | ranks | MB | s | per rank ms | "
                 "peak RSS MiB | client peak RSS MiB | collective calls |")
            emit("|---|---|---|---|---|---|---|---|")
            with TreeRSS() as mem:
                s, client_peak, ranks, calls = in_child(ctx, _analyze_client, client.scheduler.address,
                                                               client.cluster.security, job)
            emit(f"| every rank of a {args.small_ranks:,}-rank job, each listing all ranks in its pg_config | "
                 f"{ranks:,} | {job_bytes / MB:,.0f} | {s:.2f} | {s / ranks * 1000:.1f} | {mem.peak / 2**20:,.0f} | "
                 f"{client_peak / 2**20:,.0f} | {calls:,} |")
    finally:
        cleanup(root, args.keep)
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
