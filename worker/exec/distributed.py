"""A tensor-parallel group's collectives over torch.distributed, and its step channel.

The layers' side of the interface (`Collectives`, `SingleRank`) is `worker/model/parallel.py`;
a tensor-parallel group implements it with `TorchDistributed`, joined with `init_group` from a
`Rendezvous`, plus a
`ByteChannel` that carries the scheduler's steps from rank 0 (TCP streams, with a separate gloo
group for its small collectives).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from worker.model.parallel import Collectives


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet. A group's ranks share a node, so they meet through a
    store file on it (`store_path`, torch's FileStore: no listening socket, where a TCPStore's
    server listens on every interface whatever host it is given), and their collectives and
    step streams use the interface that holds `host` (loopback unless the operator names
    another). Also how long any collective may wait."""

    store_path: str  # a file on the ranks' node that does not exist yet (the last rank to
    # leave the group removes it)
    world_size: int
    host: str = "127.0.0.1"
    timeout_s: float = 60.0  # a rank that is silent this long is dead or hung
    startup_timeout_s: float = 600.0  # process start and weight loading may be slow

    def __post_init__(self) -> None:
        if not self.store_path:
            raise ValueError("store_path must name a file")
        if not self.host:
            raise ValueError("host must be a non-empty address")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @staticmethod
    def new_store_path() -> str:
        """A fresh store file name in this node's temporary directory."""
        return os.path.join(tempfile.gettempdir(), f"pagefleet-rdv-{uuid.uuid4().hex}")


class TorchDistributed(Collectives):
    """Collectives over one torch.distributed process group (NCCL on GPU, gloo on CPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()  # reduced in place: callers use the returned tensor
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self._world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        t = t.contiguous()
        dist.broadcast(t, src=src, group=self.group)
        return t


class ByteChannel:
    """Messages from rank 0 to every other rank, plus a few small collectives on a CPU (gloo)
    group.

    A message is `[u64 length][payload]` on a TCP stream from rank 0 to each other rank (opened
    by `init_group`, found through the gloo group): the sender writes it with one system call
    and the receiver's own thread wakes on its arrival, where a gloo broadcast would pass
    through gloo's I/O and worker threads on both sides (three thread wake-ups, each costly on
    a busy host). Every rank must call `send` (rank 0) or `recv` (the others) in the same order,
    and the other operations (gloo) in the same order as well. A silent peer for `timeout_s`,
    or a closed stream, raises RuntimeError, as a failed collective does.
    """

    def __init__(self, group: dist.ProcessGroup | None, streams: list[socket.socket]) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if len(streams) != (self.world_size - 1 if self.rank == 0 else 1):
            raise ValueError(f"rank {self.rank} needs one stream per peer, got {len(streams)}")
        self._streams = streams  # rank 0: one per other rank; others: the one from rank 0
        self._buf = bytearray(_RECV_CHUNK)  # receive buffer, grown for a long message
        self._view = memoryview(self._buf)

    def send(self, payload: bytes) -> None:
        message = _LENGTH.pack(len(payload)) + payload
        try:
            for stream in self._streams:
                sent = _send_holding_gil(stream, message)
                if sent < len(message):  # the peer's socket buffer is full: wait for room
                    stream.sendall(message[sent:])
        except OSError as e:  # a peer closed its end, or stopped reading for timeout_s
            raise RuntimeError(f"step stream to a peer failed: {e!r}") from e

    def recv(self) -> bytes:
        got = self._read_at_least(0, _HEADER)
        (n,) = _LENGTH.unpack_from(self._buf, 0)
        if _HEADER + n > len(self._buf):
            self._buf.extend(bytes(_HEADER + n - len(self._buf)))
            self._view = memoryview(self._buf)
        self._read_at_least(got, _HEADER + n)
        return bytes(self._view[_HEADER : _HEADER + n])

    def _read_at_least(self, got: int, want: int) -> int:
        """Fill the buffer from byte `got` until it holds `want` bytes (never more: the next
        message stays in the stream); returns `want`."""
        (stream,) = self._streams
        try:
            while got < want:
                k = stream.recv_into(self._view[got:want])
                if k == 0:
                    raise RuntimeError("rank 0 closed the step stream")
                got += k
        except OSError as e:  # silent for timeout_s (socket.timeout), or reset
            raise RuntimeError(f"step stream from rank 0 failed: {e!r}") from e
        return got

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_reduce_min_many(self, values: list[int]) -> list[int]:
        """Element-wise smallest of every rank's `values` (each rank gives as many)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def barrier(self) -> None:
        """A full round trip: returns once every rank has reached it (or the timeout fires)."""
        self.all_reduce_min(0)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """A raw broadcast on this channel's group (for measuring its latency)."""
        dist.broadcast(t, src=src, group=self.group)

    @staticmethod
    def probe_tensor() -> torch.Tensor:
        return torch.zeros(8, dtype=torch.uint8)  # (8,): a "small broadcast"


_LENGTH = struct.Struct("<Q")  # the length prefix of a message
_HEADER = _LENGTH.size
_RECV_CHUNK = 1 << 16  # the receive buffer's starting size (a decode step of 256 is ~1 KiB)


def _send_holding_gil(stream: socket.socket, message: bytes) -> int:
    """Bytes of `message` that one non-blocking send() took, calling libc without releasing the
    GIL: rank 0's engine thread sends while the actor's event loop thread waits for the GIL,
    and one release would hand the GIL over and cost the engine thread up to a switch interval
    to get it back, for a call of a few microseconds that never blocks. 0 where unsupported."""
    if _LIBC_SEND is None:
        return 0
    k = _LIBC_SEND(stream.fileno(), message, len(message), socket.MSG_DONTWAIT)
    if k >= 0:
        return k
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
        return 0
    raise OSError(err, os.strerror(err))


def _libc_send():
    """libc's send(2) through ctypes.PyDLL (calls keep the GIL), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.PyDLL(None, use_errno=True).send
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_ssize_t
    return fn


_LIBC_SEND = _libc_send()


def _open_streams(rendezvous: Rendezvous, rank: int, group: dist.ProcessGroup) -> list[socket.socket]:
    """Rank 0 listens on an ephemeral port of `rendezvous.host` and tells the others the port
    (a gloo broadcast); each other rank connects and names itself; rank 0 returns its streams in
    rank order, the others the stream from rank 0."""
    port = torch.zeros(1, dtype=torch.int64)
    listener = None
    if rank == 0:
        listener = socket.create_server((rendezvous.host, 0), backlog=rendezvous.world_size)
        listener.settimeout(rendezvous.startup_timeout_s)
        port[0] = listener.getsockname()[1]
    dist.broadcast(port, src=0, group=group)
    if rank != 0:
        stream = socket.create_connection((rendezvous.host, int(port.item())), timeout=rendezvous.startup_timeout_s)
        stream.sendall(_LENGTH.pack(rank))
        streams = [stream]
    else:
        by_rank = {}
        with listener:
            for _ in range(rendezvous.world_size - 1):
                stream, _ = listener.accept()
                stream.settimeout(rendezvous.startup_timeout_s)
                (peer,) = _LENGTH.unpack(_recv_exactly(stream, _HEADER))
                by_rank[peer] = stream
        streams = [by_rank[r] for r in range(1, rendezvous.world_size)]
    for stream in streams:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a message goes at once
        stream.settimeout(rendezvous.timeout_s)
    return streams


def _recv_exactly(stream: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.recv(n - len(data))
        if not chunk:
            raise RuntimeError("a peer closed its step stream during start-up")
        data += chunk
    return data


def init_group(rendezvous: Rendezvous, rank: int, device: torch.device) -> tuple[TorchDistributed, ByteChannel]:
    """Join the group. Three process groups: the default one (gloo) only for meeting and the
    start-up barrier, patient enough for slow process starts and weight loading; the model's
    collectives (NCCL on CUDA, gloo on CPU) and a gloo group for the step messages, both
    failing after `rendezvous.timeout_s` of silence. Every socket they open is on the
    interface of `rendezvous.host`."""
    if not 0 <= rank < rendezvous.world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {rendezvous.world_size}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    use_interface(rendezvous.host)
    store = dist.FileStore(rendezvous.store_path, rendezvous.world_size)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=rendezvous.world_size,
        timeout=timedelta(seconds=rendezvous.startup_timeout_s),
    )
    timeout = timedelta(seconds=rendezvous.timeout_s)
    model_group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    step_group = dist.new_group(backend="gloo", timeout=timeout)
    streams = _open_streams(rendezvous, rank, step_group)
    return TorchDistributed(model_group), ByteChannel(step_group, streams)


def use_interface(host: str) -> None:
    """Make gloo and NCCL (their listening sockets, their bootstrap) use the network interface
    that holds `host` in this process; gloo would otherwise take the address the hostname
    resolves to, which is usually not loopback."""
    name = interface_of(host)
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = name


def interface_of(host: str) -> str:
    """The name of this machine's network interface whose IPv4 address is `host`."""
    address = socket.inet_aton(socket.gethostbyname(host))
    siocgifaddr = 0x8915  # ioctl: an interface's IPv4 address (Linux)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), siocgifaddr, request)
            except OSError:  # no IPv4 address on this interface
                continue
            if reply[20:24] == address:
                return name
    raise ValueError(f"no network interface of this machine has the address {host!r}")


def startup_barrier() -> None:
    """Wait (up to the start-up timeout) until every rank has loaded its shard, so that the
    short collective timeout starts counting only once the whole group is up."""
    dist.barrier()


def destroy_group() -> None:
    """Leave the group (no-op when this process is in none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
