"""What a running job needs from its processes: torch.distributed brought up over MPI (one device per local
rank), errors agreed across ranks so none hangs, host memory prepared."""
