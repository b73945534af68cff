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
to the pool when its count reaches 0. A sequence about to write into a block it shares (the
partial last block of a forked prompt, n > 1) first gets a private copy: `copy_on_write`
swaps a fresh block into its table and returns (source, copy) for the caller to copy the K/V.

Prefix caching (paged only; the scheduler drives it when `prefix_caching=True`):

- A full block's key is a hash chain: `block_hash(parent key, its token ids, cache_salt)`.
  The default hash is SHA-256 over a fixed byte layout (32-byte parent digest, the token ids
  as signed 64-bit integers, then the salt in UTF-8): stable across processes and Python
  versions, unlike `hash()` of a str salt, which is randomised per process.
- `cache` maps key -> block id. A cached block remembers its token ids, salt and parent
  (the parent's block id and that block's registration generation), and a hit compares all
  three, so a hash collision can never serve another prompt's K/V: a block only matches when
  its tokens are the requester's and its parent is the block the requester matched just before.
- A cached block whose count reaches 0 stays cached and reusable (it counts as free). New
  blocks come from never-cached free blocks first (`free_ids`), then by evicting cached free
  blocks least recently freed first (`evictable`); the blocks of one table are freed tail
  first, so a sequence's tail is evicted before its head (vLLM's order). An evicted block
  leaves `cache`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass


def block_hash(parent: bytes | None, token_ids: Sequence[int], salt: str | None) -> bytes:
    """SHA-256 of (parent key, the block's token ids, cache_salt): a full block's cache key."""
    h = hashlib.sha256(parent if parent is not None else b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    if salt is not None:
        h.update(b"\1" + salt.encode("utf-8"))
    return h.digest()


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


class PoolSizes:
    """Sizes derived from num_blocks, block_size and num_free_blocks (the engine's BlockManager and
    any stand-in with those three attributes, e.g. lab 04's adapter over a learner's allocator)."""

    num_blocks: int
    block_size: int
    num_free_blocks: int

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


class BlockManager(PoolSizes):
    def __init__(self, num_blocks: int, block_size: int, contiguous: bool = True,
                 hash_fn: Callable[[Hashable | None, tuple[int, ...], str | None], Hashable] | None = None):
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
        # Prefix cache (paged only). `hash_fn` is injectable so tests can force collisions.
        self.hash_fn = hash_fn or block_hash
        self.cache: dict[Hashable, int] = {}                  # key -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached free blocks, LRU first
        self.block_key: list[Hashable | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_salt: list[str | None] = [None] * num_blocks
        self.block_parent: list[tuple[int, int] | None] = [None] * num_blocks  # (parent block, its generation)
        self.block_gen = [0] * num_blocks                     # bumped at every registration
        self.num_evictions = 0

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
        """`count` free blocks (paged only): never-cached ones first, then evicted cached ones, LRU first."""
        blocks = []
        for _ in range(count):
            blocks.append(self.free_ids.popleft() if self.free_ids else self._evict())
        return blocks

    def _evict(self) -> int:
        block, _ = self.evictable.popitem(last=False)
        self._forget(block)
        self.num_evictions += 1
        return block

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

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Shrink `table` (in place, paged) to the blocks `num_tokens` tokens need; the tail
        blocks are freed (speculative decoding's rejected positions). Never grows it."""
        keep = self.blocks_for(num_tokens)
        if self.contiguous or keep >= len(table):
            return
        tail = table[keep:]
        del table[keep:]
        self.free(tail)

    # ------------------------------------------------------------------ share / free
    def shared_blocks(self, table: list[int], start: int, end: int) -> int:
        """How many blocks of `table` holding positions [start, end) other owners hold too (each
        needs a copy before the positions are written)."""
        if end <= start:
            return 0
        size = self.block_size
        return sum(1 for i in range(start // size, min(len(table), -(-end // size))) if self.ref_count[table[i]] > 1)

    def copy_on_write(self, table: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Give `table` (in place) a private copy of every shared block holding positions [start, end);
        returns the (source, copy) pairs whose K/V the caller copies before writing. The last owner of a
        block writes in place (its count is 1 by then). Raises MemoryError when the copies do not fit."""
        need = self.shared_blocks(table, start, end)
        if need > self.num_free_blocks:
            raise MemoryError(f"{need} blocks needed for copy-on-write, {self.num_free_blocks} free")
        pairs = []
        size = self.block_size
        for i in range(start // size, min(len(table), -(-end // size)) if end > start else 0):
            old = table[i]
            if self.ref_count[old] > 1:
                new, = self._take(self._pop_free(1))
                self.ref_count[old] -= 1
                table[i] = new
                pairs.append((old, new))
        return pairs

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
        uncached = []
        for block in reversed(table):   # tail first: a cached tail is evicted before its head
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.is_free[block] = 1
                if self.block_key[block] is not None:
                    self.evictable[block] = None   # stays cached until evicted (most recent at the end)
                elif not self.contiguous:
                    uncached.append(block)
                self.num_free_blocks += 1
        self.free_ids.extend(reversed(uncached))

    # ------------------------------------------------------------------ prefix cache
    def hash_block(self, parent: Hashable | None, token_ids: Sequence[int], salt: str | None) -> Hashable:
        return self.hash_fn(parent, tuple(token_ids), salt)

    def _parent_ref(self, parent: int | None) -> tuple[int, int] | None:
        return None if parent is None else (parent, self.block_gen[parent])

    def _link_live(self, block: int) -> bool:
        """Whether a cached block's parent is still the cached block it was registered under."""
        ref = self.block_parent[block]
        return ref is None or (self.block_key[ref[0]] is not None and self.block_gen[ref[0]] == ref[1])

    def match(self, token_ids: Sequence[int], keys: Sequence[Hashable], salt: str | None) -> list[int]:
        """The cached blocks holding the first len(keys) full blocks of `token_ids`, as far as they
        match from the start. Reads only: no reference count changes (see allocate_cached)."""
        size = self.block_size
        blocks: list[int] = []
        prev = None
        for i, key in enumerate(keys):
            block = self.cache.get(key)
            if block is None or self.block_salt[block] != salt \
                    or self.block_parent[block] != self._parent_ref(prev) \
                    or self.block_tokens[block] != tuple(token_ids[i * size:(i + 1) * size]):
                break   # a miss, or a collision: the key matched, the content did not
            blocks.append(block)
            prev = block
        return blocks

    def can_allocate_cached(self, prefix: list[int], num_tokens: int) -> bool:
        """Whether `prefix` (matched cached blocks) plus fresh blocks up to `num_tokens` fit."""
        fresh = self.blocks_for(num_tokens) - len(prefix)
        revived = sum(1 for b in prefix if self.ref_count[b] == 0)
        return fresh + revived <= self.num_free_blocks

    def allocate_cached(self, prefix: list[int], num_tokens: int) -> list[int]:
        """A block table for `num_tokens` tokens that starts with the cached blocks `prefix`
        (one more owner each; free ones leave the eviction queue), then fresh blocks."""
        if self.contiguous:
            raise RuntimeError("prefix caching needs paged blocks (contiguous=False)")
        if not self.can_allocate_cached(prefix, num_tokens):
            raise MemoryError(f"{self.blocks_for(num_tokens) - len(prefix)} fresh blocks needed beside "
                              f"{len(prefix)} cached ones, {self.num_free_blocks} free")
        for block in prefix:
            if self.block_key[block] is None:
                raise RuntimeError(f"block {block} is not cached")
            if self.ref_count[block] == 0:
                del self.evictable[block]
                self.is_free[block] = 0
                self.num_free_blocks -= 1
            self.ref_count[block] += 1
        table = list(prefix)
        table.extend(self._take(self._pop_free(self.blocks_for(num_tokens) - len(prefix))))
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return table

    def register(self, block: int, key: Hashable, token_ids: Sequence[int], salt: str | None,
                 parent: int | None) -> bool:
        """Cache a full block whose K/V are written, under `key`, as the child of cached block
        `parent` (None for a first block). False when it is not cached: the key already holds a
        live block (the same content computed twice, or a collision), or the parent is not cached."""
        if self.ref_count[block] < 1:
            raise RuntimeError(f"block {block} is free; only a block holding K/V can be cached")
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: {len(token_ids)} tokens, block_size={self.block_size}")
        if self.block_key[block] is not None:
            return self.block_key[block] == key
        if parent is not None and self.block_key[parent] is None:
            return False
        holder = self.cache.get(key)
        if holder is not None:
            if self._link_live(holder):
                return False
            self._uncache(holder)   # an orphan (its parent was evicted or reused): replace it
        self.block_gen[block] += 1
        self.block_key[block] = key
        self.block_tokens[block] = tuple(token_ids)
        self.block_salt[block] = salt
        self.block_parent[block] = self._parent_ref(parent)
        self.cache[key] = block
        return True

    def _forget(self, block: int) -> None:
        """Drop a block's cache entry (the block itself stays where it is)."""
        del self.cache[self.block_key[block]]
        self.block_key[block] = self.block_tokens[block] = self.block_salt[block] = self.block_parent[block] = None

    def _uncache(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.evictable[block]
            self.free_ids.append(block)
        self._forget(block)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (held ones stay cached)."""
        for block in list(self.evictable):
            self._uncache(block)

    def slot(self, table: list[int], position: int) -> int:
        """Pool slot of the token at `position` in a sequence with this block table."""
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def check(self) -> None:
        """Raise if the counters disagree with the blocks (used by tests after every operation)."""
        free = sum(self.is_free)
        if free != self.num_free_blocks:
            raise AssertionError(f"{free} blocks marked free, counter says {self.num_free_blocks}")
        if not self.contiguous and sorted(list(self.free_ids) + list(self.evictable)) != \
                [b for b in range(self.num_blocks) if self.is_free[b]]:
            raise AssertionError("the free queue and the eviction queue disagree with the free marks")
        for block in self.free_ids:
            if self.block_key[block] is not None:
                raise AssertionError(f"block {block} is cached but in the never-cached free queue")
        for block in self.evictable:
            if self.block_key[block] is None:
                raise AssertionError(f"block {block} is in the eviction queue but not cached")
        cached = {b: k for b, k in enumerate(self.block_key) if k is not None}
        if {b: k for k, b in self.cache.items()} != cached or len(self.cache) != len(cached):
            raise AssertionError("the hash map disagrees with the blocks' keys")
        for block in cached:
            if self.block_tokens[block] is None or len(self.block_tokens[block]) != self.block_size:
                raise AssertionError(f"cached block {block} has no full token record")
        for block, (count, is_free) in enumerate(zip(self.ref_count, self.is_free)):
            if (count == 0) != bool(is_free) or count < 0:
                raise AssertionError(f"block {block}: reference count {count}, marked free={bool(is_free)}")
