"""Produce collective_trace logs and CSV exports from a 4-rank gloo job on 127.0.0.1 (rank 2 straggles)."""
import os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OUT = sys.argv[1]

def work(rank, world):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29533"
    from collective_trace import trace_all_collectives
    tracer = trace_all_collectives(trace_file=os.path.join(OUT, "collective_trace.log"), verbose=False)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    for step in range(3):
        if rank == 2:
            time.sleep(0.03)
        t = torch.ones(4096) * rank
        dist.all_reduce(t)
        out = [torch.zeros(16) for _ in range(world)]
        dist.all_gather(out, torch.ones(16))
        b = torch.arange(32, dtype=torch.int64)
        dist.broadcast(b, src=0)
        dist.all_reduce(torch.ones(24), group=evens if rank % 2 == 0 else odds)
        if rank == 2:
            time.sleep(0.01)
        w = dist.all_reduce(torch.ones(40), async_op=True)
        w.wait()
        peer = (rank + 1) % world, (rank - 1) % world
        ops = [dist.P2POp(dist.isend, torch.ones(8), peer[0]), dist.P2POp(dist.irecv, torch.zeros(8), peer[1])]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        dist.barrier()
    tracer.export_to_csv(os.path.join(OUT, f"collective_trace_rank{rank}.csv"))
    if tracer.config.async_logger:
        tracer.config.async_logger.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    mp.spawn(work, args=(4,), nprocs=4)
