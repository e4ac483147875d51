#!/usr/bin/env python3
"""torch.distributed.all_reduce (gloo, SUM, float32) timed the way `ddpjob bench allreduce`
times its own: per size, one warm-up, then N iterations from fresh inputs, a barrier before
each, the slowest rank's mean time. Prints one JSON array (rank 0), same fields as ddpjob's.

    torchrun --standalone --nproc-per-node=2 bench/gloo_allreduce.py --sizes 1M,10M,100M
"""
import argparse
import json
import time

import torch
import torch.distributed as dist


def parse(s):
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}
    out = []
    for p in s.split(","):
        p = p.strip()
        out.append(int(round(float(p[:-1]) * scale[p[-1].upper()])) if p[-1].upper() in scale else int(p))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1M,10M,100M")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for n in parse(args.sizes):
        iters = max(5, min(200, 200_000_000 // max(n, 1)))  # as ddpjob's bench
        buf = torch.empty(n, dtype=torch.float32)
        elapsed = 0.0
        for i in range(iters + 1):
            buf.fill_(rank + 1)
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            if i > 0:
                elapsed += time.perf_counter() - t
        assert bool((buf == world * (world + 1) / 2).all()), "wrong sum"
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        secs = slowest.item() / iters
        algbw = n * 4 / secs / 1e9
        rows.append({"floats": n, "bytes": n * 4, "iters": iters, "time_ms": secs * 1e3,
                     "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (world - 1) / world})
    if rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
