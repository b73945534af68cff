"""BlockManager: a fixed pool of KV blocks handed out to sequences. Plain Python, no torch.

A block holds `block_size` tokens' K and V for every layer. The pool is a list of integer
ids; a sequence owns a block table (its blocks in order). With `contiguous=True` a request
gets one run of consecutive blocks reserved up front for its longest possible length, the
way engines did before PagedAttention; paged allocation arrives with lab 04.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, contiguous: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.contiguous = contiguous
        self.is_free = bytearray(b"\x01") * num_blocks
        self.num_free_blocks = num_blocks
        self.num_reserved_tokens = 0   # token slots promised to running sequences
        self.peak_used_blocks = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _find_run(self, count: int) -> int | None:
        """First index of `count` consecutive free blocks, or None."""
        run_start, run_len = 0, 0
        for i, free in enumerate(self.is_free):
            if free:
                if run_len == 0:
                    run_start = i
                run_len += 1
                if run_len == count:
                    return run_start
            else:
                run_len = 0
        return None

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
        return self._take(self._first_free(count))

    def _first_free(self, count: int) -> list[int]:
        return [i for i, free in enumerate(self.is_free) if free][:count]

    def _take(self, blocks: list[int]) -> list[int]:
        """Mark `blocks` used and update the counters; returns them."""
        for block in blocks:
            self.is_free[block] = 0
        self.num_free_blocks -= len(blocks)
        self.num_reserved_tokens += len(blocks) * self.block_size
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
        table.extend(self._take(self._first_free(extra)))

    def free(self, table: list[int]) -> None:
        for block in table:
            if self.is_free[block]:
                raise RuntimeError(f"block {block} freed twice")
            self.is_free[block] = 1
        self.num_free_blocks += len(table)
        self.num_reserved_tokens -= len(table) * self.block_size

    def slot(self, table: list[int], position: int) -> int:
        """Pool slot of the token at `position` in a sequence with this block table."""
        return table[position // self.block_size] * self.block_size + position % self.block_size
