"""Launches two ranks that write their pids into argv[1] and sleep: the test kills this
process (SIGKILL) and checks that the ranks do not outlive it."""

import sys

from graphpar.distributed.launch import launch
from tests.targets import launch_targets

if __name__ == "__main__":
    launch(launch_targets.write_pid_and_sleep, world_size=2, args=(sys.argv[1],))
