"""A request's stream, the caller's side: StreamEvent (what it got since the last one) and RequestStream.

    stream = await engine.add_request(SamplingParams(max_tokens=8), prompt="Hello")   # an AsyncEngine
    async for event in stream:      # StreamEvent(text=..., token_ids=..., finish_reason=None | "stop" | ...)
        print(event.text, end="")

The engine thread puts the events on the request's asyncio.Queue; the stream reads them in the
caller's event loop and, if the caller leaves early, asks the engine to abort the request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class StreamEvent:
    """What one request got since its previous event. The last one has `finished=True`."""

    request_id: str
    text: str                    # new text (held back while it could still become a stop string)
    token_ids: list[int]         # new token ids
    num_prompt_tokens: int
    num_output_tokens: int       # output tokens so far
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" on the last event
    error: str | None = None
    # logprobs=N: per new token (token, logprob, rank, [(token, logprob)] of the top N), as Sequence.logprobs
    logprobs: list = field(default_factory=list)
    # on the first event after the prefill: the prompt's ids, and its logprobs with prompt_logprobs=N
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    index: int = 0               # n > 1: which choice (continuation) this event belongs to

    @property
    def finished(self) -> bool:
        """This choice has finished (with n > 1 the request ends when every choice has)."""
        return self.finish_reason is not None


class RequestStream:
    """The caller's side of one admitted request: async-iterate its StreamEvents.

    With n > 1 the events of the n choices interleave (`event.index`); the stream ends after every choice's
    finished event. best_of > n: each returned choice comes in one finished event once all have finished.
    Leaving early (break, cancellation, close()) aborts the request; its KV blocks go back."""

    def __init__(self, request_id: str, events: asyncio.Queue, num_choices: int, num_prompt_tokens: int,
                 abort: Callable[[str, str], None]):
        self._events = events            # fed by the engine thread (loop.call_soon_threadsafe)
        self._abort = abort              # AsyncEngine.abort: thread-safe, idempotent
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_choices = num_choices
        self._open = self.num_choices    # choices whose finished event has not come yet
        self.finished = False

    async def get(self, timeout: float | None = None) -> StreamEvent:
        """The next event; asyncio.TimeoutError after `timeout` seconds without one."""
        if self.finished:
            raise StopAsyncIteration
        if timeout is None:
            event = await self._events.get()
        else:
            event = await asyncio.wait_for(self._events.get(), timeout)
        if event.finished:
            self._open -= 1
            self.finished = self._open <= 0
        return event

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamEvent:
        try:
            return await self.get()
        except BaseException:
            if not self.finished:
                self.abort()
            raise

    def abort(self, reason: str = "the client went away") -> None:
        if not self.finished:
            self._abort(self.request_id, reason)

    close = abort
