"""graphpar's intermediate representation: a torch.fx graph plus one frozen record per node.

The record API lives in node_record.py and is re-exported here, so pass authors write
``import graphpar.ir as ir; ir.record(node)`` (docs/writing-a-pass.md). Beside it: the
invariants every pass must keep (validate.py), the readable dump of a graph (printer.py) and
how a tensor-parallel Shard spec lays a tensor out over ranks (layout.py).
"""
from graphpar.ir.node_record import (META_KEY, PHASE_LAUNCH, PHASE_STEP, PHASE_WRITE, PHASES, PLACEMENTS, NodeRecord, Partial,
                                     Replicate, SequenceShard, Shard, ShardSpec, TensorMeta, Value, canonical_keys,
                                     copy_record, describe_kind, describe_value, fetch_attr, first_keys, has_record, last_reader,
                                     parameter_readers, record, set_record, stamp, tensor_meta,
                                     value_from_example)

__all__ = ["META_KEY", "PHASE_LAUNCH", "PHASE_STEP", "PHASE_WRITE", "PHASES", "PLACEMENTS", "NodeRecord", "Partial", "Replicate",
           "SequenceShard", "Shard", "ShardSpec", "TensorMeta", "Value", "canonical_keys", "copy_record",
           "describe_kind", "describe_value", "fetch_attr", "first_keys", "has_record", "last_reader", "parameter_readers", "record",
           "set_record",
           "stamp", "tensor_meta", "value_from_example"]
