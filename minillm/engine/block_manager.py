"""BlockManager: a fixed pool of KV blocks handed out to sequences. Plain Python, no torch.

A block holds `block_size` tokens' K and V for every layer. The pool is a list of integer
ids; a sequence owns a block table (its blocks in order). Two ways to hand them out:

- contiguous (`contiguous=True`, the engine's `paged=False`): a request gets one run of
  consecutive blocks reserved up front for the longest it may grow (`max_model_len`), the
  way engines did before PagedAttention. The unused tail of every run is waste.
- paged: a request gets blocks as its tokens arrive, from anywhere in the pool; its block
  table maps positions to blocks. The only waste is the unfilled end of its last block.

Every block has a reference count: `allocate`/`grow` hand out blocks at count 1, `share`
adds an owner (a forked or prefix-cached sequence), `free` drops one, and a block returns
to the pool when its count reaches 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockUsage:
    """A snapshot of the pool. `real_tokens` is what the caller knows its sequences hold."""

    num_blocks: int
    used_blocks: int
    block_size: int
    real_tokens: int

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks

    @property
    def reserved_slots(self) -> int:
        """Token slots handed out to sequences (filled or not)."""
        return self.used_blocks * self.block_size

    @property
    def unused_reserved_slots(self) -> int:
        """Slots reserved by a sequence that hold no token: the waste."""
        return self.reserved_slots - self.real_tokens

    @property
    def utilization(self) -> float:
        """Fraction of the reserved KV memory that holds real tokens (1.0 when nothing is reserved)."""
        return self.real_tokens / self.reserved_slots if self.reserved_slots else 1.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, contiguous: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.contiguous = contiguous
        self.ref_count = [0] * num_blocks
        self.is_free = bytearray(b"\x01") * num_blocks   # contiguous runs are found by bytes.find
        # Paged tables take any free block: a queue of them (contiguous runs use is_free instead).
        self.free_ids: deque[int] = deque(() if contiguous else range(num_blocks))
        self.num_free_blocks = num_blocks
        self.peak_used_blocks = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_reserved_tokens(self) -> int:
        return self.num_used_blocks * self.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self, real_tokens: int) -> BlockUsage:
        """Statistics, given how many tokens the sequences holding blocks really have."""
        return BlockUsage(self.num_blocks, self.num_used_blocks, self.block_size, real_tokens)

    # ------------------------------------------------------------------ allocate
    def _find_run(self, count: int) -> int | None:
        """First index of `count` consecutive free blocks, or None."""
        start = self.is_free.find(b"\x01" * count)
        return None if start < 0 else start

    def can_allocate(self, num_tokens: int) -> bool:
        count = self.blocks_for(num_tokens)
        if count > self.num_free_blocks:
            return False
        return not self.contiguous or self._find_run(count) is not None

    def allocate(self, num_tokens: int) -> list[int]:
        """Reserve room for `num_tokens` tokens; returns the block table. Raises when full."""
        count = self.blocks_for(num_tokens)
        if self.contiguous:
            start = self._find_run(count)
            if start is None:
                raise MemoryError(f"no run of {count} free blocks ({self.num_free_blocks} free of {self.num_blocks})")
            return self._take(list(range(start, start + count)))
        if count > self.num_free_blocks:
            raise MemoryError(f"{count} blocks needed, {self.num_free_blocks} free")
        return self._take(self._pop_free(count))

    def _pop_free(self, count: int) -> list[int]:
        """The first `count` blocks of the free queue (paged only)."""
        return [self.free_ids.popleft() for _ in range(count)]

    def _take(self, blocks: list[int]) -> list[int]:
        """Mark `blocks` used at reference count 1 and update the counters; returns them."""
        for block in blocks:
            self.is_free[block] = 0
            self.ref_count[block] = 1
        self.num_free_blocks -= len(blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return blocks

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        """Whether `table` can be extended (paged) to hold `num_tokens` tokens."""
        return self.blocks_for(num_tokens) - len(table) <= self.num_free_blocks

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` (in place) until it holds `num_tokens` tokens."""
        extra = self.blocks_for(num_tokens) - len(table)
        if extra <= 0:
            return
        if self.contiguous:
            raise RuntimeError("a contiguous reservation cannot grow; reserve the full length up front")
        if extra > self.num_free_blocks:
            raise MemoryError(f"{extra} more blocks needed, {self.num_free_blocks} free")
        table.extend(self._take(self._pop_free(extra)))

    # ------------------------------------------------------------------ share / free
    def share(self, table: list[int]) -> list[int]:
        """Another owner for every block of `table` (a fork, or a cached prefix); returns a copy."""
        for block in table:
            if self.ref_count[block] < 1:
                raise RuntimeError(f"block {block} is free and cannot be shared")
        for block in table:
            self.ref_count[block] += 1
        return list(table)

    def free(self, table: list[int]) -> None:
        """Drop one reference to every block of `table`; blocks at count 0 return to the pool."""
        for block in table:
            if self.ref_count[block] < 1:
                raise RuntimeError(f"block {block} freed twice (its reference count is already 0)")
        for block in table:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.is_free[block] = 1
                if not self.contiguous:
                    self.free_ids.append(block)
                self.num_free_blocks += 1

    def slot(self, table: list[int], position: int) -> int:
        """Pool slot of the token at `position` in a sequence with this block table."""
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def check(self) -> None:
        """Raise if the counters disagree with the blocks (used by tests after every operation)."""
        free = sum(self.is_free)
        if free != self.num_free_blocks:
            raise AssertionError(f"{free} blocks marked free, counter says {self.num_free_blocks}")
        if not self.contiguous and sorted(self.free_ids) != [b for b in range(self.num_blocks) if self.is_free[b]]:
            raise AssertionError("the free queue disagrees with the free marks")
        for block, (count, is_free) in enumerate(zip(self.ref_count, self.is_free)):
            if (count == 0) != bool(is_free) or count < 0:
                raise AssertionError(f"block {block}: reference count {count}, marked free={bool(is_free)}")
