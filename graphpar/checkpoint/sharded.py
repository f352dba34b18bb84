"""Distributed checkpoints: every rank writes its own shards; any strategy reads them back.

A checkpoint is a directory holding one torch.distributed.checkpoint (DCP) checkpoint and a
completion marker::

    <path>/__<r>_0.distcp     the pieces rank r wrote (DCP)
    <path>/.metadata          every entry's full shape and which file holds each piece (DCP)
    <path>/graphpar.json      written last: format, layout, the model's keys, each file's
                              size and sha256, and its own sha256 (the marker, the manifest)

Each tensor is described by where this rank's pieces lie in the full tensor (offsets and
sizes per dim, see :func:`placement`), so DCP stores full-shape entries whatever the
strategy: ranks holding the same piece (dp replicas, tp ranks of a replicated tensor, two
pipeline stages of a tied weight) write it once, and a load under another strategy reads
each of its pieces from whichever saved pieces overlap it. DCP keys::

    model/<name>              a model tensor (name: graphpar's canonical name for it)
    optim/<name>/<entry>      optimizer state (exp_avg, step...), cut like the parameter
    optim_groups              the optimizer's hyperparameters per param group
    optim_class               the optimizer's class (module.qualname)
    rng/pp<p>.tp<t>/<stream>  graphpar's dropout streams (the same on every dp replica)
    rng/torch/rank<r>         torch's global RNG state of rank r
    data, extra               the data position and the user's extra dict (rank 0's)
    lr_scheduler              the LR scheduler's class and state_dict() (lr_scheduler=; the
                              first rank's that passed one: every rank's follows one schedule)
    loss_scaler               the fp16 loss scaler's state (rank 0's; every rank's is the same)

Saves are atomic: everything goes to ``<path>.tmp-<id>``, rank 0 writes the marker last
and renames the directory to ``<path>``. A save killed before that leaves ``<path>`` as
it was; loading refuses a directory without the marker. Loads are all or nothing: the
files are checked against the manifest's checksums and the checkpoint against the module
(model, optimizer, data position) on every rank, and the ranks agree, before anything is
written. See docs/checkpoint.md.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from graphpar.distributed import groups as distributed
from graphpar.ir.layout import Chunk, placement

__all__ = ["CheckpointError", "FullCheckpoint", "save_checkpoint", "load_checkpoint", "load_full_checkpoint",
           "MARKER"]

MARKER = "graphpar.json"
METADATA = ".metadata"  # the name DCP's FileSystemWriter gives its metadata file
FORMAT = 2  # 2: the manifest holds checksums of every file and of itself
# the small pickled entries, read (and checked) before any tensor is loaded
PICKLED = ("optim_class", "optim_groups", "data", "extra", "loss_scaler", "lr_scheduler")

# Test hook: called on rank 0 with the staging directory once every rank has written its
# pieces and before DCP's metadata, the marker and the rename, i.e. in the middle of a save.
_before_metadata: Optional[Callable[[str], None]] = None


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved to or loaded from the given path, or does not fit."""


class _Placed:
    """A rank's tensor and its pieces, in the form DCP plans with (the hooks DTensor
    implements), so that DCP dedups pieces several ranks hold and reshards on load."""

    def __init__(self, local: torch.Tensor, full_shape, chunks: List[Chunk]):
        self.local, self.full_shape, self.chunks = local, torch.Size(full_shape), chunks

    def size(self) -> torch.Size:  # DCP compares it with the saved shape
        return self.full_shape

    def piece(self, chunk: Chunk) -> torch.Tensor:
        if chunk.sizes == tuple(self.local.shape):
            return self.local
        return self.local.narrow(chunk.dim, chunk.local_start, chunk.sizes[chunk.dim])

    def __create_write_items__(self, fqn: str, _obj) -> List[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=_storage_chunk(c), properties=properties,
                                                      size=self.full_shape))
                for c in self.chunks]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [_storage_chunk(c) for c in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for chunk in self.chunks:
            if torch.Size(chunk.offsets) == index.offset:
                return self.piece(chunk)
        raise KeyError(f"{index.fqn}: no piece at offsets {list(index.offset)}")


def _storage_chunk(chunk: Chunk) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))


def _lookup(state_dict: Dict[str, Any], index: MetadataIndex):
    value = state_dict[index.fqn]
    return value.__get_tensor_shard__(index) if isinstance(value, _Placed) else None


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        piece = _lookup(self.state_dict, index)
        return piece if piece is not None else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up rebuilds the dict and replaces values it does not know (_Placed) by None.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        piece = _lookup(self.state_dict, index)
        return piece if piece is not None else super().lookup_tensor(index)


class _Writer(FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote: the rank that wrote a file
    computes its checksum for the manifest."""

    def __init__(self, path: str):
        super().__init__(path)
        self.written: List[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # complete on return: FileSystemWriter writes synchronously
        self.written += sorted({result.storage_data.relative_path for result in future.value()})
        return future

    def finish(self, metadata, results) -> None:
        if _before_metadata is not None:
            _before_metadata(str(self.path))
        super().finish(metadata, results)
        self.written.append(METADATA)


# ---- what a ParallelModule holds ---------------------------------------------------------

def _optimizer_state(pm, gather: bool = True) -> Optional[Tuple[Dict[str, Dict[str, Any]], List[Dict[str, Any]]]]:
    """The optimizer's live per-parameter state by canonical parameter name, and its
    param_groups; None on a rank without an optimizer. The one place that knows where the
    optimizer keeps its state: loading fills these dicts in place. With ZeRO the state is
    sharded over dp: whole copies, gathered (collective over dp) to save, or empty dicts
    that loading fills and _install_optimizer hands back to the shards."""
    if pm.optimizer is None:
        return None
    if pm._placed.shard_steps:
        return pm._placed.sharded_optimizer_states(pm.optimizer, gather), pm.optimizer.param_groups
    # with master weights (host placement, param_dtype) the optimizer steps the fp32 masters;
    # host tables have their own row-wise optimizer, whose state is per row like the table
    stepped = pm._placed.masters() if pm._placed.has_masters else dict(pm.named_parameters())
    states = {name: pm.optimizer.state[p] for name, p in stepped.items()}
    for name, table in pm._placed.owned_tables().items():
        if table.optimizer is not None:
            states[name] = table.optimizer.state[table.table]
    return states, pm.optimizer.param_groups


def _model_tensors(pm) -> Dict[str, _Placed]:
    """This rank's model tensors by canonical name, with their pieces."""
    mesh, shards = pm.mesh, pm._shards()
    full_shapes = {pm._canonical[key]: pm._full_shapes[key] for key in pm._state_keys}
    placed = {}
    for name, local in pm._weights().items():  # fp32 masters where the device copy is lower
        if name in full_shapes:  # the graph's own constants are not model state
            chunks = placement(full_shapes[name], shards.get(name), mesh.tp_rank, mesh.tp)
            placed[name] = _Placed(local.detach(), full_shapes[name], chunks)
    for name, table in pm._placed.owned_tables().items():
        placed[name] = _host_rows(table)
    for key, value in pm._untraced.items():  # never read by the graph: whole on every rank
        placed.setdefault(pm._canonical[key], _Placed(value, value.shape, placement(value.shape, None, 0, 1)))
    return placed


def _host_rows(table) -> _Placed:
    """A host table's rows on this rank: rows [first_row, first_row + n) of the full table."""
    rows, width = table.table.shape
    return _Placed(table.table.detach(), (table.full_rows, width), [Chunk((table.first_row, 0), (rows, width), 0, 0)])


def _layout(pm) -> Dict[str, int]:
    mesh = pm.mesh
    return {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}


def _rng_key(pm, stream: str) -> str:
    return f"rng/pp{pm.mesh.pp_rank}.tp{pm.mesh.tp_rank}/{stream}"


def _entries_to_save(pm, extra: Dict[str, Any], data, lr_scheduler, scheduler_rank: Optional[int]) -> Dict[str, Any]:
    model = _model_tensors(pm)
    entries: Dict[str, Any] = {f"model/{name}": placed for name, placed in model.items()}
    optimizer = _optimizer_state(pm)
    if optimizer is not None:
        states, groups = optimizer
        for name, state in states.items():
            for entry, value in state.items():
                entries[f"optim/{name}/{entry}"] = _like_parameter(value, model[name])
        entries["optim_groups"] = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        entries["optim_class"] = _class_name(pm.optimizer)
    for stream, generator in pm._rng.items():
        entries[_rng_key(pm, stream)] = generator.get_state()
    entries[f"rng/torch/rank{pm.mesh.rank}"] = torch.get_rng_state()
    if pm.mesh.rank == 0:
        entries["extra"] = extra
        if data is not None:
            entries["data"] = data.state_dict()
        if pm.loss_scaler is not None:  # fp16: the same on every rank (they skip steps together)
            entries["loss_scaler"] = dict(vars(pm.loss_scaler))
    if pm.mesh.rank == scheduler_rank:
        entries["lr_scheduler"] = {"class": _class_name(lr_scheduler), "state_dict": lr_scheduler.state_dict()}
    return entries


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _like_parameter(value: Any, param: _Placed) -> Any:
    """A state tensor shaped like the parameter's shard is cut like it; others are whole."""
    if torch.is_tensor(value) and value.shape == param.local.shape:
        return _Placed(value.detach(), param.full_shape, param.chunks)
    return value.detach() if torch.is_tensor(value) else value


# ---- saving ------------------------------------------------------------------------------

def save_checkpoint(pm, path: str, extra: Optional[Dict[str, Any]] = None, data=None, lr_scheduler=None) -> str:
    """Save ``pm``'s model, optimizer, RNG streams, ``data``'s position, ``lr_scheduler``'s
    state (a scheduler built on ``pm.optimizer``) and ``extra`` to the directory ``path``
    (replacing a checkpoint there only once the new one is complete). Collective: call it on
    every rank with the same path. Returns the absolute path."""
    _check_no_expert_shards(pm, "save_checkpoint")
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"save_checkpoint: extra={type(extra).__name__} is not a dict. "
                              f"Fix: pass a dict of picklable values, e.g. extra={{'step': step}}.")
    if data is not None and not callable(getattr(data, "state_dict", None)):
        raise CheckpointError(f"save_checkpoint: data={type(data).__name__} has no state_dict(). Fix: pass "
                              f"the graphpar.tools.data.DistributedBatches the training loop reads from.")
    _check_scheduler(pm, lr_scheduler, "save_checkpoint")
    pm._check_has_weights("save_checkpoint")
    path, token = _agree_on_path(path)
    scheduler_rank = _scheduler_rank(pm, lr_scheduler)
    _check_replaceable(path)
    pm._check_shapes_agree("save_checkpoint")  # each rank's pieces are cut from its tensors
    staging = f"{path}.tmp-{token}"
    writer = _Writer(staging)
    with _single_process_is_intended():
        dcp.save(_entries_to_save(pm, extra or {}, data, lr_scheduler, scheduler_rank), storage_writer=writer,
                 planner=_SavePlanner(), no_dist=not _multi_rank())
    files: Dict[str, Dict[str, Any]] = {}
    for written in _gather({name: _file_digest(os.path.join(staging, name)) for name in writer.written}):
        files.update(written)
    manifest = {"format": FORMAT, "layout": _layout(pm), "world_size": pm.mesh.world_size,
                "keys": {key: pm._canonical[key] for key in pm._state_keys}, "files": files}
    _on_rank_zero(lambda: _commit(staging, path, token, manifest))
    return path


@contextlib.contextmanager
def _single_process_is_intended():
    # DCP warns that it assumes a single process whenever there is no process group; here
    # that is known and meant (a world of one, or reading a checkpoint whole).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _multi_rank() -> bool:
    return distributed.world_size() > 1


def _gather(value: Any) -> List[Any]:
    """Every rank's ``value`` in rank order, on every rank (``[value]`` in a world of one).
    Bounded by the process group's timeout (graphpar.distributed.groups sets it)."""
    if not _multi_rank():
        return [value]
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _file_digest(path: str) -> Dict[str, Any]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _manifest_digest(manifest: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _agree_on_path(path: str) -> Tuple[str, str]:
    """Every rank's absolute path (which must agree) and a staging id chosen by rank 0."""
    everyone = _gather((os.path.abspath(os.fspath(path)), uuid.uuid4().hex[:12]))
    paths = [p for p, _ in everyone]
    if len(set(paths)) > 1:
        listed = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise CheckpointError(f"save_checkpoint: the ranks were given different paths ({listed}). Fix: pass the "
                              f"same path on every rank, on a filesystem every rank sees.")
    return paths[0], everyone[0][1]


def _check_no_expert_shards(pm, caller: str) -> None:
    """Expert weights split over ep ranks have no piece layout here yet (every rank would
    describe its block of experts as the whole tensor); refused on every rank alike."""
    if pm.compiled.expert_shards:
        split = f"ep={pm.strategy.ep}" + (f", expert_tp={pm.strategy.expert_tp}" if pm.strategy.expert_tp > 1 else "")
        raise CheckpointError(f"{caller}: Strategy.{split} splits expert weights over the ep ranks (and tp ranks), "
                              f"which sharded checkpoints do not describe yet. Fix: save pm.full_state_dict() "
                              f"(and load it with pm.load_full_state_dict), or train with ep=1, expert_tp=1.")


def _check_scheduler(pm, lr_scheduler, caller: str) -> None:
    """``lr_scheduler`` must be None or a scheduler of ``pm.optimizer``: it sets the rates that
    optimizer steps with, and its state means nothing for another optimizer."""
    if lr_scheduler is None:
        return
    if not all(callable(getattr(lr_scheduler, m, None)) for m in ("state_dict", "load_state_dict")):
        raise CheckpointError(f"{caller}: lr_scheduler={type(lr_scheduler).__name__} has no state_dict() and "
                              f"load_state_dict(). Fix: pass a torch.optim.lr_scheduler scheduler, e.g. "
                              f"torch.optim.lr_scheduler.LambdaLR(pm.optimizer, fn).")
    if pm.optimizer is None or getattr(lr_scheduler, "optimizer", None) is not pm.optimizer:
        target = "this rank has no optimizer (compile had no optimizer=, or its stage holds no parameters)" \
            if pm.optimizer is None else "it was built on another optimizer"
        raise CheckpointError(f"{caller}: lr_scheduler={type(lr_scheduler).__name__} does not schedule pm.optimizer: "
                              f"{target}. Fix: build the scheduler on the compiled module's optimizer, e.g. "
                              f"{type(lr_scheduler).__name__}(pm.optimizer, ...), and pass it on the ranks that have one.")


def _scheduler_rank(pm, lr_scheduler) -> Optional[int]:
    """The rank whose lr_scheduler the save writes: the first that passed one (every rank's
    follows the same schedule). Every rank with an optimizer must pass its scheduler, or none
    does (collective; every rank sees every rank's answer, so all raise together)."""
    given = _gather((pm.optimizer is not None, lr_scheduler is not None))
    passed = [rank for rank, (_, scheduled) in enumerate(given) if scheduled]
    missing = [rank for rank, (has_optimizer, scheduled) in enumerate(given) if has_optimizer and not scheduled]
    if passed and missing:
        raise CheckpointError(f"save_checkpoint: lr_scheduler= was given on rank(s) {passed} and not on rank(s) "
                              f"{missing}, which also step an optimizer. Fix: pass each rank's own scheduler "
                              f"(built on its pm.optimizer) on every rank.")
    return passed[0] if passed else None


def _check_replaceable(path: str) -> None:
    if os.path.exists(path) and not os.path.exists(os.path.join(path, MARKER)):
        if not os.path.isdir(path) or os.listdir(path):
            raise CheckpointError(f"save_checkpoint: {path} exists and is not a graphpar checkpoint (it has no "
                                  f"{MARKER}), so it is not replaced. Fix: save to a new path, or remove it.")


def _on_rank_zero(action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0; every rank returns once it is done and raises if it failed."""
    distributed = _multi_rank()
    failure: List[Any] = [None]
    if not distributed or dist.get_rank() == 0:
        try:
            action()
        except Exception as error:  # reported to the other ranks, then raised here as it is
            failure[0] = f"{type(error).__name__}: {error}"
            if not distributed:
                raise
            dist.broadcast_object_list(failure, src=0)
            raise
    if distributed:
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise CheckpointError(f"save_checkpoint failed on rank 0: {failure[0]}")


def _commit(staging: str, path: str, token: str, manifest: Dict[str, Any]) -> None:
    """Marker last, then the rename that makes the checkpoint visible at ``path``."""
    marker = os.path.join(staging, MARKER)
    with open(marker, "w") as f:
        json.dump({**manifest, "sha256": _manifest_digest(manifest)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        # Between these renames <path> is missing and <path>.old-<id> is the complete previous
        # checkpoint; load_checkpoint points there if a crash lands in between.
        old = f"{path}.old-{token}"
        os.rename(path, old)
        os.rename(staging, path)
        shutil.rmtree(old)
    else:
        os.rename(staging, path)
    _fsync_directory(os.path.dirname(path))
    for leftover in _leftovers(path, "tmp"):  # stages of saves killed before they finished
        shutil.rmtree(leftover, ignore_errors=True)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _leftovers(path: str, kind: str) -> List[str]:
    return sorted(glob.glob(f"{glob.escape(path)}.{kind}-*"))


# ---- loading -----------------------------------------------------------------------------

def load_checkpoint(pm, path: str, data=None, lr_scheduler=None) -> Dict[str, Any]:
    """Load a checkpoint saved under any strategy into ``pm`` (model, optimizer state and
    hyperparameters; RNG streams when the layout is the same), ``data``'s position and
    ``lr_scheduler``'s state. Collective: call it on every rank. Returns the ``extra`` dict
    given to the save. All or nothing: every check runs, and the ranks agree on it, before
    anything is written."""
    caller = "load_checkpoint"
    _check_no_expert_shards(pm, caller)
    _check_scheduler(pm, lr_scheduler, caller)
    path = os.path.abspath(os.fspath(path))
    manifest = _read_manifest(path, caller)
    # each rank verifies its share of the files (one read of the checkpoint in all), then all agree
    share = sorted(manifest["files"])[distributed.rank()::distributed.world_size()]
    _refuse_together(lambda: _verify_files(path, manifest, share, caller))
    metadata = FileSystemReader(path).read_metadata()
    pickled = _read_pickled(path, metadata.state_dict_metadata)
    _refuse_together(lambda: _check_fit(pm, path, manifest, metadata, pickled, data, lr_scheduler))
    pm._check_shapes_agree("load_checkpoint")  # each rank's pieces are read into its tensors
    targets, install = _load_targets(pm, manifest, metadata)
    with _single_process_is_intended():
        dcp.load(targets, storage_reader=FileSystemReader(path), planner=_LoadPlanner(), no_dist=not _multi_rank())
    install(targets, pickled, data)
    _install_scheduler(pm, path, pickled.get("lr_scheduler"), lr_scheduler)
    pm._uninitialized = False
    return pickled["extra"]


def _refuse_together(check: Callable[[], None]) -> None:
    """Run ``check`` on every rank; if it refused on any rank, raise on every rank (the
    refusals of all, in rank order), so that no rank goes on to load while another refused."""
    try:
        check()
        mine = None
    except ValueError as error:  # CheckpointError, and DistributedBatches refusing a position
        mine = error
    refusals = list(dict.fromkeys(m for m in _gather(None if mine is None else str(mine)) if m is not None))
    if isinstance(mine, CheckpointError) and refusals == [str(mine)]:  # this rank's refusal is everyone's
        raise mine
    if refusals:
        raise CheckpointError("\n".join(refusals)) from mine


def _read_manifest(path: str, caller: str) -> Dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"{caller}: there is no checkpoint at {path}{_missing_reason(path)}")
    marker = os.path.join(path, MARKER)
    if not os.path.exists(marker):
        raise CheckpointError(
            f"{caller}: {path} is not a complete graphpar checkpoint: it has no {MARKER}, which a save writes "
            f"last, so the save that wrote it was interrupted (or the directory is not a checkpoint). "
            f"Fix: load an earlier complete checkpoint, or save again.")
    try:
        with open(marker, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as error:  # not UTF-8, not JSON
        raise _damaged(caller, path, [f"{MARKER} is not readable JSON ({error})"]) from error
    if not isinstance(manifest, dict):
        raise _damaged(caller, path, [f"{MARKER} holds a {type(manifest).__name__}, not the manifest"])
    recorded = manifest.pop("sha256", None)
    if recorded is None and manifest.get("format") != FORMAT:
        raise CheckpointError(f"{caller}: {path} has checkpoint format {manifest.get('format')!r}; this graphpar "
                              f"reads format {FORMAT}. Fix: load it with the graphpar version that saved it.")
    if recorded != _manifest_digest(manifest):
        raise _damaged(caller, path, [f"{MARKER}'s contents differ from what the save wrote (its checksum "
                                      f"does not match)"])
    return manifest


def _verify_files(path: str, manifest: Dict[str, Any], names: List[str], caller: str) -> None:
    """Refuse if one of the files ``names`` is missing or differs from the manifest's record."""
    problems = []
    for name in names:
        try:
            found = _file_digest(os.path.join(path, name))
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        saved = manifest["files"][name]
        if found["bytes"] != saved["bytes"]:
            problems.append(f"{name} has {found['bytes']} bytes, the save wrote {saved['bytes']}")
        elif found["sha256"] != saved["sha256"]:
            problems.append(f"{name}'s contents differ from what the save wrote (sha256 {found['sha256'][:12]}..., "
                            f"recorded {saved['sha256'][:12]}...)")
    if problems:
        raise _damaged(caller, path, problems)


def _damaged(caller: str, path: str, problems: List[str]) -> CheckpointError:
    return CheckpointError(
        f"{caller}: the checkpoint at {path} is damaged: {'; '.join(problems)}. Its files are not what the "
        f"save wrote (a truncated or partial copy, a disk or transfer error, or a file from another "
        f"checkpoint), so nothing was loaded. Fix: load an earlier checkpoint, or copy this one again "
        f"from an intact source.")


def _missing_reason(path: str) -> str:
    previous = [p for p in _leftovers(path, "old") if os.path.exists(os.path.join(p, MARKER))]
    if previous:
        return (f". The save that replaced it was interrupted; the previous, complete checkpoint is at "
                f"{previous[-1]}. Fix: rename {previous[-1]} to {path}.")
    staged = _leftovers(path, "tmp")
    if staged:
        return (f". A save to it was interrupted before it finished and left {', '.join(staged)}, which "
                f"cannot be loaded. Fix: load an earlier complete checkpoint, or save again.")
    return ". Fix: check the path (a save creates it only once the checkpoint is complete)."


def _check_fit(pm, path: str, manifest: Dict[str, Any], metadata, pickled: Dict[str, Any], data,
               lr_scheduler) -> None:
    """Refuse a checkpoint that does not fit ``pm``, ``data`` and ``lr_scheduler``, before
    anything is written."""
    _check_model(pm, path, manifest, metadata)
    _check_optimizer(pm, path, pickled)
    if lr_scheduler is not None:
        _check_saved_scheduler(path, pickled.get("lr_scheduler"), lr_scheduler)
    if data is not None:
        if pickled.get("data") is None:
            raise CheckpointError(f"load_checkpoint: {path} holds no data position (it was saved without "
                                  f"data=). Fix: load it without data=, and position the data yourself.")
        data.check_state_dict(pickled["data"])


def _check_optimizer(pm, path: str, pickled: Dict[str, Any]) -> None:
    saved_class, saved_groups = pickled.get("optim_class"), pickled.get("optim_groups")
    if pm.optimizer is None or saved_class is None:  # nothing saved, or nothing to load into
        return
    if saved_class != _class_name(pm.optimizer):
        raise CheckpointError(
            f"load_checkpoint: the checkpoint at {path} holds the state of a {saved_class} optimizer, and this "
            f"module's optimizer is a {_class_name(pm.optimizer)}; one's state and hyperparameters mean nothing "
            f"to the other. Fix: compile with optimizer= building a {saved_class} (as the run that saved it), "
            f"or load only the weights: pm.load_full_state_dict(load_full_checkpoint(path).model).")
    groups = pm.optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"load_checkpoint: the checkpoint's optimizer has {len(saved_groups)} param "
                              f"group(s), this rank's has {len(groups)}. Fix: build the optimizer the same "
                              f"way as the run that saved it (the same optimizer= factory).")


def _check_saved_scheduler(path: str, saved: Optional[Dict[str, Any]], lr_scheduler) -> None:
    if saved is None:
        raise CheckpointError(f"load_checkpoint: {path} holds no LR scheduler state (it was saved without "
                              f"lr_scheduler=), so lr_scheduler={type(lr_scheduler).__name__} has nothing to resume "
                              f"from. Fix: load without lr_scheduler= and set the scheduler's position yourself, "
                              f"or save with pm.save_checkpoint(path, lr_scheduler=scheduler).")
    if saved["class"] != _class_name(lr_scheduler):
        raise CheckpointError(f"load_checkpoint: the checkpoint at {path} holds the state of a {saved['class']}, "
                              f"and lr_scheduler= is a {_class_name(lr_scheduler)}; one's state means nothing to the "
                              f"other. Fix: build the scheduler the run that saved it used.")


def _install_scheduler(pm, path: str, saved: Optional[Dict[str, Any]], lr_scheduler) -> None:
    """After the optimizer's groups (their lr, initial_lr): the scheduler's position and base
    rates. A saved schedule not asked for is said, since training would go on at a frozen rate."""
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(saved["state_dict"])
    elif saved is not None and pm.optimizer is not None:
        warnings.warn(f"load_checkpoint: the checkpoint at {path} holds a {saved['class']}'s state, which this load "
                      f"does not restore: the optimizer goes on at the rate saved ({_rates(pm.optimizer)}) "
                      f"unless a scheduler sets it. Fix: build the scheduler on pm.optimizer before the load and "
                      f"pass it: pm.load_checkpoint(path, lr_scheduler=scheduler).", UserWarning, stacklevel=4)


def _rates(optimizer) -> str:
    return "lr " + ", ".join(f"{group['lr']:.6g}" for group in optimizer.param_groups)


def _read_pickled(path: str, stored) -> Dict[str, Any]:
    """The small pickled entries (optimizer class and groups, data position, extra, loss
    scaler, LR scheduler), read by each rank alone so that they can be checked before the load."""
    pickled: Dict[str, Any] = {key: None for key in PICKLED if key in stored}
    with _single_process_is_intended():
        dcp.load(pickled, storage_reader=FileSystemReader(path), planner=_LoadPlanner(), no_dist=True)
    return pickled


def _check_model(pm, path: str, manifest: Dict[str, Any], metadata) -> None:
    saved: Dict[str, str] = manifest["keys"]
    expected = pm._state_keys
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in set(expected)]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} key(s): {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} key(s): {_some(unexpected)}")
    shapes = []
    for key in (k for k in expected if k in saved):
        md = metadata.state_dict_metadata[f"model/{saved[key]}"]
        if tuple(md.size) != pm._full_shapes[key] or md.properties.dtype != pm._dtypes[key]:
            shapes.append(f"{key} is {list(md.size)} {md.properties.dtype} in the checkpoint, "
                          f"{list(pm._full_shapes[key])} {pm._dtypes[key]} in the model")
    if shapes:
        problems.append(f"{len(shapes)} shape/dtype mismatch(es): {_some(shapes)}")
    tied = [k for k in expected if k in saved and _tied_with(k, saved) != _tied_with(k, pm._canonical)]
    if tied:
        problems.append(f"weights tied differently: {_some(tied)}")
    if problems:
        raise CheckpointError(f"load_checkpoint: the checkpoint at {path} does not fit the compiled model ("
                              f"{'; '.join(problems)}). Fix: compile the model the checkpoint was saved from "
                              f"(same class and config), or load a checkpoint of this model.")


def _tied_with(key: str, canonical: Dict[str, str]) -> frozenset:
    return frozenset(k for k, c in canonical.items() if c == canonical[key])


def _some(items: List[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _load_targets(pm, manifest, metadata):
    """What this rank reads (model pieces into its tensors in place, the rest into buffers)
    and the function that installs the buffers and the pickled entries once DCP has filled them."""
    saved_name = manifest["keys"]
    stored = metadata.state_dict_metadata
    model = _model_tensors(pm)
    targets: Dict[str, Any] = {f"model/{saved_name[name]}": placed for name, placed in model.items()}
    optimizer = _optimizer_state(pm, gather=False)
    if optimizer is not None:
        for name in optimizer[0]:
            prefix = f"optim/{saved_name[name]}/"
            for key in (k for k in stored if k.startswith(prefix)):
                targets[key] = _buffer_for(stored[key], model[name])
    same_layout = manifest["layout"] == _layout(pm) and manifest["world_size"] == pm.mesh.world_size
    rng_keys = {stream: _rng_key(pm, stream) for stream in pm._rng} if same_layout else {}
    torch_rng = f"rng/torch/rank{pm.mesh.rank}" if same_layout else None
    for key in [*rng_keys.values(), torch_rng]:
        if key is not None:
            targets[key] = torch.empty(stored[key].size, dtype=torch.uint8)

    def install(loaded: Dict[str, Any], pickled: Dict[str, Any], data) -> None:
        if pm.loss_scaler is not None and "loss_scaler" in pickled:
            vars(pm.loss_scaler).update(pickled["loss_scaler"])
        if optimizer is not None:
            _install_optimizer(optimizer, loaded, pickled.get("optim_groups"), saved_name)
            if pm._placed.shard_steps:  # ZeRO: each rank keeps its pieces of the whole states
                pm._placed.install_sharded_optimizer_states(pm.optimizer, optimizer[0])
        if pm._placed.has_masters:  # the masters were loaded: the device copies follow
            pm._placed.refresh_device_copies()
        for stream, key in rng_keys.items():
            pm._rng[stream].set_state(loaded[key])
        if torch_rng is not None:
            torch.set_rng_state(loaded[torch_rng])
        if data is not None:
            data.load_state_dict(pickled["data"])

    return targets, install


def _buffer_for(md, param: _Placed) -> Any:
    """Where an optimizer entry is read to: cut like the parameter if it has the parameter's
    full shape (that is how it was saved), whole otherwise; None for a pickled value."""
    if isinstance(md, BytesStorageMetadata):
        return None
    if tuple(md.size) == tuple(param.full_shape):
        return _Placed(torch.empty(param.local.shape, dtype=md.properties.dtype), param.full_shape, param.chunks)
    return torch.empty(md.size, dtype=md.properties.dtype)


def _install_optimizer(optimizer, loaded: Dict[str, Any], saved_groups, saved_name: Dict[str, str]) -> None:
    """Fill the optimizer's state and hyperparameters (their fit was checked by _check_optimizer)."""
    states, groups = optimizer
    for name, state in states.items():
        prefix = f"optim/{saved_name[name]}/"
        state.clear()
        state.update({key[len(prefix):]: value.local if isinstance(value, _Placed) else value
                      for key, value in loaded.items() if key.startswith(prefix)})
    for group, saved in zip(groups, saved_groups or []):
        group.update(saved)


# ---- reading a checkpoint without a ParallelModule -----------------------------------------

@dataclass
class FullCheckpoint:
    """A checkpoint read whole into one process: full tensors under the original keys."""
    model: Dict[str, torch.Tensor]                 # model.load_state_dict(ck.model) works
    optimizer: Dict[str, Dict[str, Any]]           # per parameter name: exp_avg, step, ...
    optimizer_groups: Optional[List[Dict[str, Any]]]
    extra: Dict[str, Any]
    layout: Dict[str, int]                         # the dp, tp, pp it was saved under
    lr_scheduler: Optional[Dict[str, Any]] = None  # scheduler.load_state_dict(ck.lr_scheduler) works

    def optimizer_state_dict(self, model: torch.nn.Module) -> Dict[str, Any]:
        """The optimizer state in torch's format, for an optimizer built over
        ``model.parameters()`` in one param group: ``opt.load_state_dict(ck.optimizer_state_dict(model))``."""
        if not self.optimizer_groups or len(self.optimizer_groups) != 1:
            raise CheckpointError(f"optimizer_state_dict: the checkpoint has {len(self.optimizer_groups or [])} "
                                  f"optimizer param groups; only one group maps onto model.parameters(). "
                                  f"Fix: rebuild the groups from ck.optimizer (keyed by parameter name).")
        names = [name for name, _ in model.named_parameters()]
        state = {i: dict(self.optimizer[name]) for i, name in enumerate(names) if name in self.optimizer}
        return {"state": state, "param_groups": [{**self.optimizer_groups[0], "params": list(range(len(names)))}]}


def load_full_checkpoint(path: str) -> FullCheckpoint:
    """Read a checkpoint saved under any strategy into full tensors in this process alone
    (no process group needed; every rank that calls it reads everything)."""
    path = os.path.abspath(os.fspath(path))
    manifest = _read_manifest(path, "load_full_checkpoint")
    _verify_files(path, manifest, sorted(manifest["files"]), "load_full_checkpoint")
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    wanted = [k for k in stored if k.startswith(("model/", "optim/")) or k in ("optim_groups", "extra", "lr_scheduler")]
    targets = {k: None if isinstance(stored[k], BytesStorageMetadata)
               else torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in wanted}
    with _single_process_is_intended():
        dcp.load(targets, storage_reader=FileSystemReader(path), planner=_LoadPlanner(), no_dist=True)
    optimizer: Dict[str, Dict[str, Any]] = {}
    for key, value in targets.items():
        if key.startswith("optim/"):
            name, entry = key[len("optim/"):].rsplit("/", 1)
            optimizer.setdefault(name, {})[entry] = value
    model = {key: targets[f"model/{name}"] for key, name in manifest["keys"].items()}
    scheduler = targets.get("lr_scheduler")
    return FullCheckpoint(model, optimizer, targets.get("optim_groups"), targets["extra"], manifest["layout"],
                          scheduler["state_dict"] if scheduler is not None else None)
