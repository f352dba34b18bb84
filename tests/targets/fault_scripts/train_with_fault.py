"""torchrun entry point of tests/multiprocess/distributed/test_faults.py:

    torchrun --standalone --nproc-per-node 2 train_with_fault.py HOW WHERE PP DP

trains tests.targets.fault_targets' tiny GPT and injects the fault HOW (raise, kill, stall) on
rank 1 in step 3, WHERE (forward, before_step). Prints the losses if nothing failed.
"""
import sys
from pathlib import Path

# torchrun puts this script's folder on sys.path, not the repository root that holds tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from graphpar.distributed.launch import run_in_process_group  # noqa: E402
from tests.targets.fault_targets import train_with_fault  # noqa: E402

if __name__ == "__main__":
    how, where, pp, dp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(f"trained: losses {run_in_process_group(train_with_fault, how, where, pp, dp)}")
