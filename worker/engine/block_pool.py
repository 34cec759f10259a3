"""Physical KV blocks: reference counts and the free queue in eviction order. No torch here."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class Block:
    """One block id of the pool. `block_hash` is set while the block is in the prefix cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "tenant")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.tenant = ""  # whose request cached it (its KV quota counts it); set with quotas only
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Unreferenced blocks, front evicted first, as an intrusive doubly linked list.

    Removing a block from the middle (a prefix hit on a free cached block) is O(1) and the
    list allocates nothing per operation, which a deque cannot offer.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels: never handed out
        self._tail = Block(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def peek(self) -> Block | None:
        """The block evicted next, or None when none is free."""
        block = self._head.next_free
        return None if block is self._tail else block

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        """Put `block` last in eviction order (most recently used)."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: Block) -> None:
        """Put `block` first in eviction order (it caches nothing worth keeping)."""
        self._link(block, self._head, self._head.next_free)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[Block]:
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self._len += 1
