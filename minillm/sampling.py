"""SamplingParams: how one request picks its tokens, validated with errors that teach."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .structured import StructuredOutputs

MAX_LOGPROBS = 20   # OpenAI's top_logprobs range is 0..20; vLLM's default max_logprobs is 20
MAX_N = 128         # n and best_of: at most this many continuations per request (and at most max_num_seqs)


@dataclass
class SamplingParams:
    """Mirrors vLLM's SamplingParams. temperature=0 is greedy (argmax).

    The sampler applies them in vLLM's order (minillm/layers/sampler.py): logit_bias, the min_tokens ban, the
    repetition / frequency / presence penalties, then (sampled requests) temperature, min_p, top_k, top_p."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = -1                 # -1 (or 0): no top-k filter
    top_p: float = 1.0              # 1.0: no nucleus filter
    min_p: float = 0.0              # 0: off; else drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0   # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # 1: off; a token of the prompt or output: logit / r if > 0, else logit * r
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 bans, +100 forces)
    min_tokens: int = 0             # EOS and stop_token_ids banned, stop strings ignored, until this many tokens
    logprobs: int | None = None     # None: off; N: the sampled token's log-probability and the N most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix-cache hits)
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None  # a JSON schema, JSON object, regex, choice or grammar
    n: int = 1                      # continuations returned for the prompt (prefilled once, its KV blocks shared)
    best_of: int | None = None      # continuations generated (>= n); the n with the best mean logprob are returned

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:   # JSON (the server) gives string keys: "50256": -100
                self.logit_bias = {int(k): v for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias={self.logit_bias!r}: keys must be token ids (integers)") from None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """Continuations the engine runs: best_of, or n when best_of is unset."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def recorded_logprobs(self) -> int | None:
        """Top-N log-probabilities the engine records per output token: `logprobs`; 0 (the sampled token's only)
        when best_of > n ranks the continuations by them; None: nothing recorded."""
        if self.logprobs is not None:
            return self.logprobs
        return 0 if self.num_sequences > self.n else None

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not _number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 (off), 0 (off) or an integer >= 1")
        if not _number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not _number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0 is off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name}={value!r} must be in [-2, 2] (0 is off)")
        if not _number(self.repetition_penalty) or not (0.0 < self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be in (0, 10] (1 is off)")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias token id {token} must be >= 0")
            if not _number(bias) or not (-100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias[{token}]={bias!r} must be in [-100, 100]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not (
                0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not (0 <= self.logprobs <= MAX_LOGPROBS)):
            raise ValueError(f"logprobs={self.logprobs!r} must be None (off) or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not (0 <= self.prompt_logprobs <= MAX_LOGPROBS)):
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs!r} must be None (off) or an integer in "
                             f"[0, {MAX_LOGPROBS}]")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not (1 <= self.n <= MAX_N):
            raise ValueError(f"n={self.n!r} must be an integer in [1, {MAX_N}]")
        if self.best_of is not None and (isinstance(self.best_of, bool) or not isinstance(self.best_of, int)
                                         or not (self.n <= self.best_of <= MAX_N)):
            raise ValueError(f"best_of={self.best_of!r} must be None or an integer in [n={self.n}, {MAX_N}]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be None or an integer >= 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs={self.structured_outputs!r} must be a StructuredOutputs "
                             "(minillm.StructuredOutputs(json=..., regex=..., choice=..., grammar=...))")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop={self.stop!r}: every stop string must be a non-empty str")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: ids must be integers >= 0")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
