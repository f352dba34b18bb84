"""Pipeline messages between the ranks of one host through shared memory instead of gloo
(opt-in: GRAPHPAR_PIPELINE_TRANSPORT=shm).

Why: with gloo, messages are moved by gloo's own transport threads, which have to find a
core while the ranks compute. On the pipeline benchmark's 2-core machine, posting took 29-153 ms of wall time per rank and step
against 3-6 ms of CPU time (gpipe / zbv / interleaved at pp=2, load 16-22; benchmarks/README.md),
idle time on the critical path of a schedule without slack. With this transport the pipeline
benchmark's v=2 schedules lost half as much or less idle time beyond their simulated replay
(zbv 5.5% measured against 2.6%, interleaved 9.8% against 6.5%; over gloo 7.6 / 2.4% and
14.8 / 7.1%), and on a quiet machine their steps took 0.95-0.97 of gloo's, gpipe's 1.00
(benchmarks/README.md). Opt-in until it is tested beyond pp=2.

How: everything runs on the rank's own thread. A send copies the tensor into an anonymous
shared-memory file of its own (`memfd_create`) and hands its descriptor, with the message's
tag and size, to the receiving rank over a Unix-domain SOCK_SEQPACKET connection
(SCM_RIGHTS); it never waits for the receiver. A receive blocks in the kernel (`recvmsg`
with the timeout left; no spinning) until the message with its tag has come, keeps the ones
that came first by tag, reads the file into the receive buffer and closes it, which frees
the memory. Each message carries the number of the step that sent it, so what a failed step
left behind is dropped, never taken for a later step's message. Nothing outlives the
processes: an anonymous file and a socket belong to the processes holding them.

Setup (`connect`, collective over the pipeline's ranks, at an executor's first step): each
rank listens on an abstract Unix address of its own (random), the ranks all_gather (host,
address, willing) over the pp group; when all of them are on one host and willing (CPU
tensors, Linux's memfd, GRAPHPAR_PIPELINE_TRANSPORT=shm), each connects to each rank holding
a neighbour stage and accepts a connection from each; else the executor keeps gloo.
"""
from __future__ import annotations

import array
import os
import secrets
import socket
import struct
import time
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

TRANSPORT_ENV = "GRAPHPAR_PIPELINE_TRANSPORT"
TRANSPORTS = ("gloo", "shm")
_HEADER = struct.Struct("<qqq")        # step, tag, bytes
_HELLO = struct.Struct("<q")           # the connecting rank's global rank
_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)


def transport_from_env() -> str:
    """GRAPHPAR_PIPELINE_TRANSPORT: "gloo" (the default: the process group's point-to-point)
    or "shm" (shared memory where all the pipeline's ranks share a host, gloo otherwise)."""
    value = os.environ.get(TRANSPORT_ENV, "").strip() or "gloo"
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={value!r} is invalid: the pipeline's transport must be one of "
                         f"{', '.join(map(repr, TRANSPORTS))}. Fix: set {TRANSPORT_ENV}=gloo (the default) or "
                         f"{TRANSPORT_ENV}=shm (shared memory between ranks of one host), or unset it")
    return value


class SharedMemoryChannels:
    """This rank's connections to the ranks of its neighbour stages, by global rank."""

    def __init__(self, rank: int, outgoing: Dict[int, socket.socket], incoming: Dict[int, socket.socket],
                 timeout_s: float):
        self.rank = rank
        self.outgoing, self.incoming = outgoing, incoming
        self.timeout_s = timeout_s
        self.step = 0
        self._arrived: Dict[int, Dict[int, Tuple[int, int]]] = {peer: {} for peer in incoming}  # tag -> (fd, bytes)

    def begin_step(self) -> None:
        """A new step: what an earlier (failed) step left unreceived is dropped."""
        self.step += 1
        for arrived in self._arrived.values():
            for fd, _ in arrived.values():
                os.close(fd)
            arrived.clear()

    def send(self, peer: int, tag: int, tensor: torch.Tensor) -> None:
        data = _bytes_of(tensor)
        fd = os.memfd_create("graphpar-pp", os.MFD_CLOEXEC)
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            self.outgoing[peer].sendmsg([_HEADER.pack(self.step, tag, len(data))],
                                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        finally:
            os.close(fd)   # the receiver holds its own descriptor of the file now

    def receive(self, peer: int, tag: int, buffer: torch.Tensor, what: str) -> None:
        """Fill `buffer` with the message `tag` from `peer`, waiting for it at most the timeout."""
        arrived = self._arrived[peer]
        deadline = time.monotonic() + self.timeout_s
        while tag not in arrived:
            self._take_one(peer, arrived, deadline, what)
        fd, size = arrived.pop(tag)
        try:
            target = _bytes_of(buffer)
            if size != len(target):
                raise RuntimeError(f"pipeline rank {self.rank}: {what} from rank {peer} has {size} bytes, the "
                                   f"receive expects {len(target)} (shape {tuple(buffer.shape)}, {buffer.dtype}); "
                                   f"the two ranks run different programs. Fix: compile the same model and "
                                   f"strategy on every rank")
            done = 0
            while done < size:
                done += os.preadv(fd, [target[done:]], done)
        finally:
            os.close(fd)

    def _take_one(self, peer: int, arrived: Dict[int, Tuple[int, int]], deadline: float, what: str) -> None:
        """Wait for the next message from `peer` (blocking, with the time left) and keep it by tag."""
        connection = self.incoming[peer]
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise socket.timeout
            connection.settimeout(left)
            message, ancillary, _, _ = connection.recvmsg(_HEADER.size, _FD_SPACE)
        except socket.timeout:
            raise TimeoutError(f"pipeline rank {self.rank}: {what} from rank {peer} did not come within "
                               f"{self.timeout_s:g} s (shared-memory transport); that rank failed or stopped "
                               f"sending. Fix: look at rank {peer}'s error; if it is only slow, raise the timeout "
                               f"(GRAPHPAR_TIMEOUT_S)") from None
        if not message:
            raise ConnectionError(f"pipeline rank {self.rank}: rank {peer} closed its connection while {what} "
                                  f"was awaited; it exited or failed. Fix: look at rank {peer}'s error")
        step, tag, size = _HEADER.unpack(message)
        fd = array.array("i", ancillary[0][2][:array.array("i").itemsize])[0]
        if step != self.step:   # left by a step that failed before taking it
            os.close(fd)
            return
        arrived[tag] = (fd, size)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype (bf16 has no numpy type: viewed as bytes)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def connect(mesh, neighbours: Iterable[int], cpu: bool, timeout_s: float) -> Optional[SharedMemoryChannels]:
    """Channels to the `neighbours` (global ranks), or None where gloo must carry the messages.
    Collective over the pp group: every rank of the pipeline calls it once per executor."""
    neighbours = sorted(set(neighbours))
    willing = cpu and hasattr(os, "memfd_create") and transport_from_env() == "shm"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) if willing else None
    address = None
    if listener is not None:
        address = b"\0graphpar-pp-" + secrets.token_hex(12).encode()   # abstract: no file to clean up
        listener.bind(address)
        listener.listen(max(len(neighbours), 1))
    everyone = [None] * dist.get_world_size(mesh.group("pp"))
    dist.all_gather_object(everyone, (dist.get_rank(), socket.gethostname(), address), group=mesh.group("pp"))
    addresses = {rank: addr for rank, _, addr in everyone}
    if listener is None or len({host for _, host, _ in everyone}) > 1 or None in addresses.values():
        if listener is not None:
            listener.close()
        return None
    outgoing = {}
    for peer in neighbours:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.settimeout(timeout_s)
        connection.connect(addresses[peer])
        connection.sendall(_HELLO.pack(dist.get_rank()))
        outgoing[peer] = connection
    incoming = {}
    listener.settimeout(timeout_s)
    try:
        while len(incoming) < len(neighbours):
            connection, _ = listener.accept()
            connection.settimeout(timeout_s)
            incoming[_HELLO.unpack(connection.recv(_HELLO.size))[0]] = connection
    except socket.timeout:
        raise TimeoutError(f"pipeline rank {dist.get_rank()}: ranks {sorted(set(neighbours) - set(incoming))} did "
                           f"not connect within {timeout_s:g} s to set up the shared-memory transport. Fix: look "
                           f"at those ranks' errors; or unset {TRANSPORT_ENV} (gloo) on every rank") from None
    finally:
        listener.close()
    if set(incoming) != set(neighbours):
        raise RuntimeError(f"pipeline rank {dist.get_rank()}: ranks {sorted(incoming)} connected, expected the "
                           f"neighbour stages' ranks {neighbours}; the ranks disagree on the stage layout. Fix: "
                           f"compile the same model and strategy on every rank")
    return SharedMemoryChannels(dist.get_rank(), outgoing, incoming, timeout_s)


__all__ = ["SharedMemoryChannels", "connect", "transport_from_env", "TRANSPORT_ENV"]
