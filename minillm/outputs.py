"""RequestOutput / CompletionOutput: what generate() returns, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine.metrics import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # "stop" | "length" | "abort" | "error" | None while running
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)

    @classmethod
    def from_sequence(cls, seq) -> "RequestOutput":
        completion = CompletionOutput(0, seq.output_text, list(seq.output_token_ids), seq.finish_reason, seq.error)
        return cls(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion], seq.is_finished,
                   RequestMetrics.from_sequence(seq))
