"""SamplingParams: how one request picks its tokens, validated with errors that teach."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Mirrors vLLM's SamplingParams. temperature=0 is greedy (argmax)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = -1                 # -1 (or 0): no top-k filter
    top_p: float = 1.0              # 1.0: no nucleus filter
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 (off), 0 (off) or an integer >= 1")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be None or an integer >= 0")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop={self.stop!r}: every stop string must be a non-empty str")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: ids must be integers >= 0")
