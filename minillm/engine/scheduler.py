"""Scheduler: decides which sequences run in the next step, and applies each step's result.

`schedule()` returns *what* to run (sequences, and whether it is a prefill step); the
model runner decides *how*. `postprocess()` is the one place where sequence state changes.

Prefix caching (`prefix_caching=True`, paged): at admission the longest cached run of the
sequence's full blocks is shared instead of allocated and those tokens are not fed again
(never the whole sequence: its last token is always computed, so there are logits). After
each step, blocks that became full are offered to the cache (prompt and generated tokens).

Parallel sampling (n > 1, paged, a Forking allocator): the request's first continuation is admitted
carrying the others (`pending_forks`) and prefills all of its prompt but the last token. Then the
others fork: each shares its block table (one more reference per block) and the prefill position,
and every continuation feeds the last prompt token itself as its first decode step, so each draws
its own first token. A continuation about to write into a block it still shares (the partial last
block) gets a private copy first: `block_copies` lists the (source, copy) pairs the engine copies
before the step runs (vLLM's copy-on-write).
"""

from __future__ import annotations

from collections import deque

from ..config import EngineConfig
from ..lora import LoRASlots
from ..seams import BlockAllocator, Forking, SchedulingPolicy, conforms
from .sequence import Sequence, SequenceStatus


class ContinuousBatching:
    """Admit waiting requests whenever a slot is free; preempt the most recently admitted request."""

    def may_admit(self, running) -> bool:
        return True

    def preemption_victim(self, running, keep):
        for seq in reversed(running):
            if seq not in keep:
                return seq
        raise RuntimeError("no running sequence left to preempt")


class StaticBatching(ContinuousBatching):
    """Hold the batch until its longest member finishes, then admit the next one."""

    def may_admit(self, running) -> bool:
        return not running


POLICIES = {"continuous": ContinuousBatching, "static": StaticBatching}


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockAllocator | None, max_model_len: int,
                 policy: SchedulingPolicy | None = None):
        self.config = config
        self.policy = policy if policy is not None else POLICIES[config.batching]()
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_caching = bool(config.prefix_caching) and block_manager is not None \
            and not block_manager.contiguous
        # Prefix-cache counters, in tokens (vLLM's queries / hits), over the scheduler's life.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefix_cached_prompt_tokens = 0   # first admissions only: prompt tokens not prefilled
        # n > 1 continuations share their prompt's blocks (else each is queued on its own by the engine)
        self.forking = block_manager is not None and not block_manager.contiguous and conforms(block_manager, Forking)
        self.block_copies: list[tuple[int, int]] = []   # (source, copy) blocks to copy before the next step
        self.num_forks = 0
        # enable_lora: which adapter occupies each of max_loras slots (a request on an adapter waits for a slot)
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs of the last schedule(), for the engine to copy (and forget)."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_tokens(self, fed: set[int] = frozenset()) -> int:
        """Tokens whose K/V the running sequences hold in the pool (`fed`: ids of sequences whose
        scheduled tokens were just written). A shared block (prefix cache, n > 1 forks) counts once."""
        return self.kv_token_counts(fed)[1]

    def kv_token_counts(self, fed: set[int] = frozenset()) -> tuple[int, int]:
        """(tokens the running sequences hold, counting a shared block once per holder; the same counting
        it once): their difference is what sharing saves."""
        def held(s: Sequence) -> int:
            return s.num_cached_tokens + (s.num_scheduled_tokens if id(s) in fed else 0)

        total = sum(held(s) for s in self.running)
        if not self.prefix_caching and not (self.forking and any(len(s.group) > 1 for s in self.running)):
            return total, total
        size, filled = self.block_manager.block_size, {}
        for s in self.running:
            n = held(s)
            for j, block in enumerate(s.block_table[:-(-n // size)]):
                filled[block] = max(filled.get(block, 0), min(size, n - j * size))
        return total, sum(filled.values())

    def _reservation(self, seq: Sequence, num_tokens: int, start: int = 0) -> int:
        """Token slots to hold at admission: the longest any request may grow (contiguous), or the
        `num_tokens` it is about to feed after `start` cached ones (paged; more blocks come as it grows)."""
        if self.block_manager.contiguous:
            return self.max_model_len
        return start + num_tokens

    def _match(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the start of a waiting sequence (prefix caching; reads only).
        At most (prefill_target - 1) // block_size blocks: the last token prefilled is always computed."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:   # cached tokens have no logits
            return []
        bm = self.block_manager
        num = (seq.prefill_target - 1) // bm.block_size
        self._extend_keys(seq, num)
        return bm.match(seq.token_ids, seq.block_keys[:num], seq.cache_salt)

    def _extend_keys(self, seq: Sequence, num_blocks: int) -> None:
        """Hash-chain keys of the first `num_blocks` full blocks (tokens never change: computed once)."""
        bm, keys = self.block_manager, seq.block_keys
        size = bm.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            keys.append(bm.hash_block(keys[-1] if i else None, seq.token_ids[i * size:(i + 1) * size],
                                      seq.cache_salt))

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks that became full (their K/V are written) to the prefix cache."""
        bm = self.block_manager
        full = min(seq.num_cached_tokens // bm.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        self._extend_keys(seq, full)
        size, table = bm.block_size, seq.block_table
        for i in range(seq.num_registered_blocks, full):
            bm.register(table[i], seq.block_keys[i], seq.token_ids[i * size:(i + 1) * size], seq.cache_salt,
                        table[i - 1] if i else None)
        seq.num_registered_blocks = full

    def _fits(self, seq: Sequence) -> bool:
        """Room in the running batch for this request and the continuations it carries."""
        return len(self.running) + 1 + len(seq.pending_forks) <= self.config.max_num_seqs

    def _fork(self, seq: Sequence) -> None:
        """Its prompt but the last token is cached: the continuations it carries share its blocks."""
        bm = self.block_manager
        for child in seq.pending_forks:
            child.block_table = bm.share(seq.block_table)
            child.num_cached_tokens = seq.num_cached_tokens
            child.block_keys = list(seq.block_keys)
            child.num_registered_blocks = seq.num_registered_blocks
            child.prefix_hit_tokens = seq.prefix_hit_tokens
            child.prompt_logprobs = list(seq.prompt_logprobs)
            child.first_scheduled_s = seq.first_scheduled_s
            self._acquire_lora(child)   # the parent's adapter is resident: this only counts one more user
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            self.num_forks += 1
        seq.pending_forks = []

    def _admit(self, seq: Sequence, num_tokens: int, prefix: list[int] | None = None) -> bool:
        """Move the head of the waiting queue to running if its blocks fit; False leaves it waiting.
        `prefix`: cached blocks holding its first tokens (shared, not fed again)."""
        bm = self.block_manager
        hit = len(prefix) * bm.block_size if prefix else 0
        if not self._acquire_lora(seq):
            return False  # every adapter slot is held by running requests: wait for one
        if bm is not None:
            need = self._reservation(seq, num_tokens, hit)
            if prefix:
                if not bm.can_allocate_cached(prefix, need):
                    self._release_lora(seq)
                    return False
                seq.block_table = bm.allocate_cached(prefix, need)
            else:
                if not bm.can_allocate(need):
                    self._release_lora(seq)
                    return False  # wait for running requests to free their blocks
                seq.block_table = bm.allocate(need)
        if self.prefix_caching:
            seq.num_cached_tokens = hit
            seq.num_registered_blocks = len(prefix or ())
            self.prefix_queries += len(seq)
            self.prefix_hits += hit
            if seq.prefix_hit_tokens is None:
                seq.prefix_hit_tokens = hit
                self.prefix_cached_prompt_tokens += hit
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        seq.num_scheduled_tokens = num_tokens
        return True

    def _acquire_lora(self, seq: Sequence) -> bool:
        """A slot for the request's adapter, held while it runs; False when every slot is held by other
        adapters' running requests (LRU eviction takes only a slot no running request uses)."""
        if seq.lora_request is None or seq.lora_slot:
            return True
        slot = self.lora_slots.acquire(seq.lora_request.lora_int_id)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = 0

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Admit waiting requests (prefill) if any fit, else decode every running one.

        Sets `seq.num_scheduled_tokens` (tokens to feed this step) on every returned sequence.
        """
        if self.config.chunked_prefill:
            return self._schedule_chunked()
        seqs, is_prefill = self._schedule_whole()
        for seq in seqs:
            seq.num_scheduled_tokens = seq.prefill_target - seq.num_cached_tokens
        return seqs, is_prefill

    def _schedule_whole(self) -> tuple[list[Sequence], bool]:
        cfg = self.config
        batch: list[Sequence] = []
        admit = self.policy.may_admit(self.running)
        num_tokens = 0
        while admit and self.waiting and self._fits(self.waiting[0]):
            seq = self.waiting[0]
            prefix = self._match(seq)
            new_tokens = seq.prefill_target - len(prefix) * (self.block_manager.block_size if prefix else 0)
            if batch and num_tokens + new_tokens > cfg.max_num_batched_tokens:
                break
            if not self._admit(seq, new_tokens, prefix):
                break
            batch.append(seq)
            num_tokens += new_tokens
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _schedule_decode(self, limit: int | None = None) -> list[Sequence]:
        """Every running sequence that has finished its prefill decodes (at most `limit`).

        With paged blocks, one that needs a new block and finds none preempts the policy's victim
        (the most recently admitted sequence by default; its K/V are recomputed later), possibly itself.
        A forked sequence's first write into a block it shares takes a private copy (copy-on-write).
        """
        bm = self.block_manager
        decoding = [s for s in self.running if bm is None or (len(s) - s.num_cached_tokens <= 1 and not s.pending_forks)]
        if bm is None or bm.contiguous:
            return decoding[:limit]
        queue = list(decoding)
        scheduled: list[Sequence] = []
        while queue and (limit is None or len(scheduled) < limit):
            seq = queue.pop(0)
            while not self._can_write(seq, len(seq)):
                victim = self.policy.preemption_victim(self.running, scheduled)
                if victim in queue:
                    queue.remove(victim)
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self._make_writable(seq, len(seq))
                scheduled.append(seq)
        return scheduled

    def _can_write(self, seq: Sequence, end: int) -> bool:
        """Whether its table can hold `end` tokens, with private copies of shared blocks it writes into."""
        bm = self.block_manager
        if not self.forking or len(seq.group) == 1:
            return bm.can_grow(seq.block_table, end)
        extra = max(0, bm.blocks_for(end) - len(seq.block_table))
        return extra + bm.shared_blocks(seq.block_table, seq.num_cached_tokens, end) <= bm.num_free_blocks

    def _make_writable(self, seq: Sequence, end: int) -> None:
        """Grow its table to `end` tokens; copy-on-write the shared blocks that positions from
        num_cached_tokens on will be written into (the pairs go to block_copies)."""
        bm = self.block_manager
        if self.forking and len(seq.group) > 1:
            self.block_copies.extend(bm.copy_on_write(seq.block_table, seq.num_cached_tokens, end))
        bm.grow(seq.block_table, end)

    def _schedule_chunked(self) -> tuple[list[Sequence], bool]:
        """Chunked prefill: one token budget per step, shared by decodes and prompt chunks.

        Decodes go first (one token each), then the unfinished prompts of running requests,
        then newly admitted ones, each taking as many prompt tokens as the budget has left, and at most
        long_prefill_token_threshold (when set): a long prompt then leaves room in every step, so a short
        request is admitted beside its chunks instead of waiting for its whole prefill (vLLM's cap).
        """
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        decodes = self._schedule_decode(limit=budget)
        for seq in decodes:
            seq.num_scheduled_tokens = 1
        budget -= len(decodes)
        cap = cfg.long_prefill_token_threshold or budget
        chunks: list[Sequence] = []
        for seq in list(self.running):
            remaining = seq.prefill_target - seq.num_cached_tokens
            if budget <= 0 or seq in decodes or remaining < 1 or (remaining == 1 and not seq.pending_forks):
                continue   # (remaining 1 without forks: a decode the budget left out)
            n = min(remaining, budget, cap)
            if bm is not None and not bm.contiguous:
                if not self._can_write(seq, seq.num_cached_tokens + n):
                    break  # wait for blocks; decodes keep going
                self._make_writable(seq, seq.num_cached_tokens + n)
            seq.num_scheduled_tokens = n
            chunks.append(seq)
            budget -= n
        admit = self.policy.may_admit(self.running)
        while admit and budget > 0 and self.waiting and self._fits(self.waiting[0]):
            seq = self.waiting[0]
            prefix = self._match(seq)
            n = min(seq.prefill_target - len(prefix) * (bm.block_size if prefix else 0), budget, cap)
            if not self._admit(seq, n, prefix):
                break
            chunks.append(seq)
            budget -= n
        return decodes + chunks, bool(chunks)

    def preempt(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back; it waits at the front and is prefilled again."""
        if seq.block_table:
            self.block_manager.free(seq.block_table)
            seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        self._release_lora(seq)
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self._release_lora(seq)
        if seq.block_table and self.block_manager is not None:
            self.block_manager.free(seq.block_table)
            seq.block_table = []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], check_stop) -> None:
        """Append each sampled token; finish sequences that hit a stop condition.

        `check_stop(seq) -> reason | None` is the engine's rule (EOS, stop strings, length).
        """
        for seq, token in zip(seqs, token_ids):
            if token is None:  # a prompt chunk that does not reach the prompt's end yet
                seq.num_cached_tokens += seq.num_scheduled_tokens
                if self.prefix_caching:
                    self._cache_full_blocks(seq)
                if seq.pending_forks and seq.num_cached_tokens == seq.prefill_target:
                    self._fork(seq)
                continue
            self._append(seq, token, check_stop)

    def _append(self, seq: Sequence, token: int, check_stop) -> bool:
        """Append one sampled token after the tokens before it are in the cache; True if it stops."""
        seq.num_cached_tokens = len(seq)   # every token fed so far is now in the cache
        if self.prefix_caching:
            self._cache_full_blocks(seq)
        seq.token_ids.append(token)
        reason = check_stop(seq)
        if reason is not None:
            self.finish(seq, reason)
        return reason is not None

    def postprocess_many(self, seqs: list[Sequence], token_lists: list[list[int]], check_stop) -> None:
        """Speculative decoding's postprocess: each sequence fed its last token and its proposals,
        and keeps 1 to k + 1 tokens. The cache holds valid K/V for every kept token but the last
        (as after a plain decode step); blocks past the new length are freed. A stop condition
        met inside the kept tokens ends the sequence there."""
        bm = self.block_manager
        for seq, tokens in zip(seqs, token_lists):
            for token in tokens:
                if self._append(seq, token, check_stop):
                    break
            if not seq.is_finished and bm is not None:
                bm.truncate(seq.block_table, len(seq))

