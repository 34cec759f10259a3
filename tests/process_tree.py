"""What a process tree is doing, read from /proc (Linux): its descendants, their states and
the TCP sockets they listen on. For tests that check a server from outside."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, parent pid) of `pid`, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    state, ppid = raw[raw.rindex(")") + 2 :].split()[:2]
    return name, state, int(ppid)


def process_state(pid: int) -> str | None:
    """The one-letter state of `pid` (R, S, D, Z for a zombie, ...), None when it is gone."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of `pid` (children, their children, ...): pid -> name."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[2], []).append((int(entry), stat[0]))
    out, todo = {}, [pid]
    while todo:
        for child, name in children.get(todo.pop(), []):
            if child not in out:
                out[child] = name
                todo.append(child)
    return out


def listening_sockets(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket that one of `pids` listens on."""
    listening = {}  # inode -> (address, port)
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            listening[fields[9]] = (_address(hex_addr, family), int(hex_port, 16))
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and (inode := target[8:-1]) in listening:
                out.append((pid, *listening[inode]))
    return out


def _address(hex_addr: str, family: int) -> str:
    """/proc/net/tcp's address (host-order 32-bit words in hex) as text."""
    raw = bytes.fromhex(hex_addr)
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    packed = b"".join(struct.pack("<I", struct.unpack(">I", w)[0]) for w in words)
    return socket.inet_ntop(family, packed)


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6 (::ffff:127.0.0.1)."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
