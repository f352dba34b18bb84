"""Sharded checkpoints through torch.distributed.checkpoint (sharded.py); see docs/checkpoint.md."""
from graphpar.checkpoint.sharded import (MARKER, CheckpointError, FullCheckpoint, load_checkpoint, load_full_checkpoint,
                                         placement, save_checkpoint)

__all__ = ["CheckpointError", "FullCheckpoint", "save_checkpoint", "load_checkpoint", "load_full_checkpoint",
           "placement", "MARKER"]
