"""Launches one rank that says whether argv[1] was already imported when it started: run
with GRAPHPAR_LAUNCH_PRELOAD naming it, the fork server has imported it."""

import sys

from graphpar.distributed.launch import launch
from tests.targets import launch_targets

if __name__ == "__main__":
    print(launch(launch_targets.imported, world_size=1, args=(sys.argv[1],))[0])
