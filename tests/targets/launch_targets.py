"""Functions run inside graphpar.launch children by tests/multiprocess/distributed/test_launch.py.

They live in an importable module (``tests.targets.launch_targets``) because launch
spawns fresh interpreters that must find the function by name.
"""

import faulthandler
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def rank_and_allreduce():
    ones = torch.ones(3)
    dist.all_reduce(ones)
    return dist.get_rank(), ones


def raise_on_rank1_while_peer_waits():
    if dist.get_rank() == 1:
        explode_on_rank1()
    dist.barrier()  # rank 0 waits here for a rank that will never come
    return "unreachable"


def explode_on_rank1():
    raise ValueError("boom on rank 1")


def exit_abruptly_on_rank1(how):
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(7)
        if how == "crash":
            faulthandler._sigsegv()  # a real segmentation fault, as a bug in native code makes
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def rank1_never_arrives():
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def rank1_never_finishes():
    # Both ranks past the process group's set-up first: without it, rank 0 could return while a
    # slow (loaded) rank 1 was still connecting, and rank 1 would fail to connect instead of hang.
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def echo_args(prefix, scale):
    rank = dist.get_rank()
    return (prefix, rank, scale * (rank + 1), os.environ.get("GRAPHPAR_TEST_MARK"))


def environment(names):
    return {name: os.environ.get(name) for name in names}


def print_rank():
    # one rank at a time: two processes writing to one file at once may interleave their lines
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            print(f"stdout of rank {turn}", flush=True)
            print(f"stderr of rank {turn}", file=sys.stderr, flush=True)
        dist.barrier()


def write_pid_and_sleep(directory):
    with open(os.path.join(directory, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def imported(name):
    return name in __import__("sys").modules
