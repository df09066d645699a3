"""The ranks' group and the few messages they exchange, all collectives of
mlx.distributed (no side channel): rank 0 broadcasts, every rank gathers.

A collective on a dead peer fails at once ("connection to a peer was lost"); that error
becomes `RankLost`, one line naming the rank when it can be told.
"""

from __future__ import annotations

import json
import re
import socket

import mlx.core as mx

CONTINUE, STOP, ABORT = 1, 2, 3  # rank 0's word after each token


class RankLost(Exception):
    """A peer stopped answering; the message is one line."""


# How mlx.distributed's backends say a peer is gone: their own prefix, or, from the ring's
# send and recv inside a forward, the socket's ("Socket 7 was closed by the peer",
# "Receiving from socket 7 failed with errno 104")
_LOST = re.compile(r"^\s*(\[(ring|mpi)\]|socket \d+ was closed by the peer|(receiving from|sending to) socket)",
                   re.IGNORECASE)


def lost_peer(error: BaseException) -> bool:
    """Whether `error` (a RuntimeError from MLX) says a peer of the group is gone."""
    return bool(_LOST.match(str(error)))


class Group:
    """An mlx.distributed group with each rank's host name."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.host = socket.gethostname()
        self.hosts = [str(h) for h in self.gather(self.host)]

    def where(self, rank: int) -> str:
        return f"rank {rank} on {self.hosts[rank]}"

    def _collect(self, x: mx.array) -> mx.array:
        try:
            out = mx.distributed.all_sum(x, group=self.group)
            mx.eval(out)
        except RuntimeError as e:
            raise self.lost(e) from None
        return out

    def lost(self, error: BaseException) -> RankLost:
        """The error a broken collective becomes: the rank is named when there is only
        one it can be (two ranks)."""
        who = self.where(1 - self.rank) if self.size == 2 else "a rank of " + ", ".join(
            self.where(r) for r in range(self.size) if r != self.rank)
        return RankLost(f"{who} stopped answering ({str(error).strip().splitlines()[0]})")

    def broadcast(self, value=None):
        """Rank 0's `value` (JSON) on every rank."""
        data = json.dumps(value).encode() if self.rank == 0 else b""
        n = int(self._collect(mx.array([len(data)], dtype=mx.int32)).item())
        buf = mx.array(list(data), dtype=mx.int32) if self.rank == 0 else mx.zeros((n,), mx.int32)
        return json.loads(bytes(self._collect(buf).tolist()).decode())

    def gather(self, value) -> list:
        """Every rank's `value` (JSON), in rank order, on every rank."""
        data = json.dumps(value).encode()
        sizes = mx.zeros((self.size,), mx.int32).at[self.rank].add(len(data))
        sizes = self._collect(sizes).tolist()
        start = sum(sizes[: self.rank])
        buf = mx.zeros((sum(sizes),), mx.int32)
        buf[start:start + len(data)] = mx.array(list(data), dtype=mx.int32)
        raw = bytes(self._collect(buf).tolist())
        out, at = [], 0
        for n in sizes:
            out.append(json.loads(raw[at:at + n].decode()))
            at += n
        return out

    def word(self, flag: int = 0) -> int:
        """Rank 0's `flag` on every rank (the others pass 0)."""
        return int(self._collect(mx.array([flag if self.rank == 0 else 0], dtype=mx.int32)).item())


def init(backend: str = "ring") -> Group:
    """This process's rank in the group mlx.launch started (strict: no group is an error)."""
    try:
        return Group(mx.distributed.init(strict=True, backend=backend))
    except RuntimeError as e:
        raise RankLost(f"no {backend} group to join: {str(e).strip().splitlines()[0]}") from None
