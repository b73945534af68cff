"""A request's state on both sides of the AsyncEngine (the caller's loop, the engine thread) and its admission.

`RequestState` is one engine request (one prompt, with its n continuations); `ChoiceState` is what one continuation
has been sent. `add_to_engine` tokenizes the prompt (text, token ids or chat messages) and queues it in the
engine, refusing a max_tokens the context cannot hold as vLLM does.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..engine.sequence import Sequence
    from ..llm import LLM


@dataclass
class ChoiceState:
    """What one continuation has been sent so far."""

    seq: "Sequence"
    index: int
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_prompt: bool = False         # the prompt's ids (and logprobs) went out with an event
    done: bool = False


@dataclass
class RequestState:
    """A request's state on both sides: the caller's loop and queue, the engine thread's Sequence."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    accepted: asyncio.Future
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    fill_context: bool = False       # max_tokens unset: run until EOS or the context is full
    cache_salt: str | None = None
    lora_request: object | None = None   # a LoRARequest (enable_lora=True); None: the base model
    arrival_s: float = 0.0           # time.perf_counter() when the caller asked
    seq: "Sequence | None" = None    # the first continuation (seq.group: all of them)
    choices: list[ChoiceState] = field(default_factory=list)   # what each returned choice was sent
    holdback_chars: int = 0
    counted_first_token: bool = False
    index_offset: int = 0            # a list of prompts: prompt p's choices are numbered from p * n



def add_to_engine(llm: "LLM", request: RequestState) -> None:
    """Tokenize a request's prompt and queue it in llm.engine (request.seq); ValueError / TypeError: refused."""
    engine = llm.engine
    if request.messages is not None:
        text, ids = None, llm.chat_token_ids(request.messages)
    elif request.prompt_token_ids is not None:
        text, ids = llm._tokenize({"prompt_token_ids": request.prompt_token_ids})
    else:
        text, ids = llm._tokenize(request.prompt)
    params = request.params
    room = engine.max_model_len - len(ids)  # output tokens the context leaves (< 1: the engine refuses)
    if request.fill_context:
        limit = engine.max_model_len
        if engine.block_manager is not None and not engine.block_manager.contiguous:
            limit = min(limit, engine.block_manager.capacity_tokens)
        params = dataclasses.replace(params, max_tokens=max(1, limit - len(ids)))
    elif room >= 1 and params.max_tokens > room:  # the engine would cut it at the context; say so (as vLLM)
        raise ValueError(f"max_tokens={params.max_tokens} is too large: the prompt has {len(ids)} tokens and "
                         f"the context (max_model_len) is {engine.max_model_len}, so max_tokens may be at "
                         f"most {room}")
    request.seq = engine.add_request(ids, params, prompt=text, request_id=request.request_id,
                                     cache_salt=request.cache_salt, lora_request=request.lora_request)
