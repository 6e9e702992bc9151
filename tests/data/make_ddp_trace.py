"""Make tests/data/ddp-gloo/ (or fsdp-gloo/): PyTorch profiler traces of a small data-parallel run on gloo, as a
user would record them.

    mpirun -n 2 python -m mpi4py tests/data/make_ddp_trace.py tests/data/ddp-gloo
    mpirun -n 2 python -m mpi4py tests/data/make_ddp_trace.py tests/data/fsdp-gloo --fsdp

An MLP under torch.nn.parallel.DistributedDataParallel (or FSDP2's fully_shard, per linear layer and whole),
Adam, 5 iterations: 1 skipped, 1 profiler warm-up, 3 recorded (ProfilerStep#2-#4), each rank's trace written
as rank-N.json.gz.
"""
import gzip
import os
import shutil
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.profiler import ProfilerActivity, profile, schedule

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
out = sys.argv[1]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500 if rank == 0 else 0))
os.environ["MASTER_PORT"] = comm.bcast(os.environ["MASTER_PORT"], root=0)
torch.set_num_threads(1)
torch.manual_seed(0)
dist.init_process_group("gloo", rank=rank, world_size=size)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 512))
if "--fsdp" in sys.argv:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    ddp = fully_shard(model)
else:
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
optimizer = torch.optim.Adam(ddp.parameters())
x = torch.randn(64, 512)


def export(prof):
    path = os.path.join(out, f"rank-{rank}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


os.makedirs(out, exist_ok=True)
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
             on_trace_ready=export) as prof:
    for _ in range(5):
        loss = ddp(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        prof.step()
dist.destroy_process_group()
