"""Sequence: one request's state — its tokens, where its K/V live, its status and timings."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from ..sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_cached_tokens: int = 0      # tokens whose K/V are already in the cache
    num_scheduled_tokens: int = 0   # tokens fed to the model in the current step
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    generator: object | None = None  # torch.Generator for sampled requests
    output_text: str = ""
    stop_checked_chars: int = 0       # output_text already searched for stop strings
    # logprobs=N: per output token (token, its log-probability, its rank, [(token, logprob)] of the top N)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # prompt_logprobs=N: per prompt token after the first, the same tuple (the first token has none)
    prompt_logprobs: list = field(default_factory=list)
    grammar: object | None = None     # structured output: its xgrammar matcher (accepts each sampled token)
    num_preemptions: int = 0          # times its blocks were taken back (recomputed later)
    # n > 1 / best_of: the request's continuations, in index order (this one included; [self] for n = 1)
    index: int = 0                    # this continuation's place in `group`
    group: list = field(default_factory=list, repr=False)
    # the first continuation carries the others until its prompt (all but the last token) is prefilled; then
    # the scheduler forks them: they share its blocks (Scheduler._fork)
    pending_forks: list = field(default_factory=list, repr=False)
    # prefix caching (prefix_caching=True)
    cache_salt: str | None = None     # requests with different salts never share cached blocks
    # LoRA (enable_lora=True): the request's adapter (a minillm.LoRARequest; None: the base model) and the slot
    # its weights sit in while it runs (0: none; the scheduler acquires it at admission, releases it at the end)
    lora_request: object | None = None
    lora_slot: int = 0
    block_keys: list = field(default_factory=list)  # hash-chain key of each full block of token_ids
    num_registered_blocks: int = 0    # full blocks already offered to the prefix cache
    prefix_hit_tokens: int | None = None  # tokens served from the prefix cache at first admission
    # timings (time.perf_counter seconds)
    arrival_s: float = 0.0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.request_id:
            self.request_id = str(self.seq_id)
        if not self.group:
            self.group = [self]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def group_finished(self) -> bool:
        """Every continuation of this request has finished."""
        return all(s.is_finished for s in self.group)

    @property
    def prefill_target(self) -> int:
        """Tokens to cache before sampling: all of them, or, while it carries forks, all but the last (each
        continuation feeds the last prompt token itself, so each gets its own first draw)."""
        return len(self.token_ids) - 1 if self.pending_forks else len(self.token_ids)
