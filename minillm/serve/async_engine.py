"""AsyncEngine: one background thread owns the Engine and steps it; asyncio tasks add, stream and abort.

The Engine is plain synchronous Python: nothing but its own thread may touch it. Requests
arrive from any asyncio task (any event loop) through a thread-safe command queue; the engine
thread admits them between steps, so requests from different HTTP clients join the running
batch (continuous batching does the rest). After every step the thread hands each request its
new text and token ids through that request's own asyncio.Queue, fed with
`loop.call_soon_threadsafe`; the caller reads them through a RequestStream (minillm/serve/stream.py).

    engine = AsyncEngine(llm)
    stream = await engine.add_request(SamplingParams(max_tokens=8), prompt="Hello")  # ValueError: bad input
    async for event in stream:      # StreamEvent(text=..., token_ids=..., finish_reason=None | "stop" | ...)
        print(event.text, end="")
    engine.shutdown()

A bad request is refused to its caller only; an exception inside a step finishes that batch's
requests with finish_reason "error" (Engine._fail) and the thread keeps serving the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from ..outputs import returned_sequences
from ..sampling import SamplingParams
from .metrics import EngineGauges, ServerMetrics, render_prometheus
from .requests import ChoiceState, RequestState, add_to_engine
from .stream import RequestStream, StreamEvent

if TYPE_CHECKING:
    from ..llm import LLM

logger = logging.getLogger("minillm.serve")

_owned_lock = threading.Lock()   # guards Engine.owner_thread: one AsyncEngine thread owns an engine at a time
MAX_KEPT_STEPS = 4096   # Engine.stats keeps one StepStats per step: reset it so a long-lived server stays small
_ids = itertools.count()


class EngineStoppedError(RuntimeError):
    """The engine thread has stopped (shutdown, or it crashed): no new requests."""


class AsyncEngine:
    """Owns `llm.engine` in a background thread until shutdown(); `llm` must not be stepped elsewhere meanwhile."""

    def __init__(self, llm: "LLM", start: bool = True, levers: dict | None = None):
        """`levers`: EngineConfig fields set on the engine while this serves it, and restored at shutdown
        ({"long_prefill_token_threshold": 256}: minillm/serve/chunking.py server_levers)."""
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        with _owned_lock:
            if llm.engine.owner_thread is not None:
                raise RuntimeError("this LLM's engine is already served by another AsyncEngine (one server per "
                                   "engine: close the other, or build a second engine with llm.with_levers())")
            if llm.engine.has_unfinished():
                raise RuntimeError("this LLM's engine has requests in flight; let them finish before serving it")
            # from now on only self._thread may step it: llm.generate() meanwhile raises (Engine._check_owner)
            llm.engine.owner_thread = self._thread
        self._restore = self._set_levers(llm.engine, levers or {})
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.metrics = ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, RequestState] = {}
        self._stopping = False
        self._stopped = threading.Event()
        self._pending_lock = threading.Lock()
        self._num_pending = 0            # requests queued as commands, not yet admitted (waiting, for /metrics)
        self.crash: BaseException | None = None
        if start:
            self._thread.start()

    # ------------------------------------------------------------------ caller side (any event loop)
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def add_request(self, params: SamplingParams, *, prompt: str | None = None,
                          prompt_token_ids: list[int] | None = None, messages: list[dict] | None = None,
                          request_id: str | None = None, fill_context: bool = False,
                          cache_salt: str | None = None, lora_request=None) -> RequestStream:
        """Queue one request (give exactly one of prompt, prompt_token_ids, messages) and wait until
        the engine thread admits it. A bad request raises ValueError / TypeError here with the engine's
        message; nothing was queued. `fill_context=True` replaces params.max_tokens by what the context
        (and the KV pool) leaves after the prompt."""
        given = [name for name, v in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                      ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise TypeError(f"give exactly one of prompt, prompt_token_ids, messages (got {given or 'none'})")
        one = {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "messages": messages}
        return await self.add_requests(params, [{given[0]: one[given[0]]}], request_id=request_id,
                                       fill_context=fill_context, cache_salt=cache_salt, lora_request=lora_request)

    async def add_requests(self, params: SamplingParams, inputs: list[dict], *, request_id: str | None = None,
                           fill_context: bool = False, cache_salt: str | None = None,
                           lora_request=None) -> RequestStream:
        """Queue several prompts (each a dict with one of prompt=, prompt_token_ids=, messages=) as one
        request, all or nothing: if the engine refuses any, none is queued and ValueError / TypeError names it
        ("prompt[2] of 3: ..."). Each prompt is its own engine request (with params.n continuations); the one
        stream carries them all, prompt p's choice j as event.index p * n + j (as vLLM numbers them)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not inputs:
            raise ValueError("inputs is empty: give at least one prompt")
        for i, one in enumerate(inputs):
            if not isinstance(one, dict) or len(one) != 1 or next(iter(one)) not in (
                    "prompt", "prompt_token_ids", "messages"):
                raise TypeError(f"inputs[{i}] must be a dict with one key of prompt, prompt_token_ids, messages; "
                                f"got {one!r:.80}")
        if not self.is_running:
            raise EngineStoppedError(self.stopped_reason())
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(_ids)}"
        ids = [request_id] if len(inputs) == 1 else [f"{request_id}-{p}" for p in range(len(inputs))]
        events, accepted, now = asyncio.Queue(), loop.create_future(), time.perf_counter()
        requests = [RequestState(rid, loop, events, accepted, params, **one, fill_context=fill_context,
                             cache_salt=cache_salt, lora_request=lora_request, arrival_s=now, index_offset=p * params.n)
                    for p, (rid, one) in enumerate(zip(ids, inputs))]
        with self._pending_lock:
            self._num_pending += len(requests)
        self._commands.put(("add", requests))
        try:
            num_prompt_tokens = await accepted
        except asyncio.CancelledError:
            for rid in ids:
                self.abort(rid, "the caller was cancelled before admission")
            raise

        def abort(_request_id: str, reason: str) -> None:
            for rid in ids:
                self.abort(rid, reason)

        return RequestStream(request_id, events, params.n * len(inputs), num_prompt_tokens, abort)

    async def generate(self, params: SamplingParams, **inputs) -> tuple[str, list[int], StreamEvent]:
        """Run one request (n = 1) to the end: (text, token ids, last event)."""
        if params.n != 1:
            raise ValueError(f"generate() returns one text; n={params.n}: iterate add_request()'s stream instead")
        stream = await self.add_request(params, **inputs)
        text, ids = [], []
        async for event in stream:
            text.append(event.text)
            ids.extend(event.token_ids)
            if event.finished:
                return "".join(text), ids, event
        raise AssertionError("a request stream ended without a finished event")

    def abort(self, request_id: str, reason: str = "aborted by the caller") -> None:
        """Thread-safe and idempotent: finish the request with reason "abort"; its KV blocks go back."""
        if not self._stopped.is_set():
            self._commands.put(("abort", (request_id, reason)))

    def render_metrics(self, model_name: str) -> str:
        return render_prometheus(model_name, self.gauges, self.metrics)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight (each stream gets its last event), stop the thread, hand the engine back idle."""
        if not self._thread.is_alive():  # never started (start=False), or already stopped
            self._stopping = True
            self._stopped.set()
            self._release_engine()
            return
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine thread did not stop within {timeout_s} s")

    @staticmethod
    def _set_levers(engine, levers: dict) -> dict:
        """Set EngineConfig fields on an idle engine (validated as EngineConfig does); returns the old values."""
        if not levers:
            return {}
        try:
            dataclasses.replace(engine.config, **levers)   # __post_init__ checks the combination
        except (ValueError, TypeError):
            with _owned_lock:
                engine.owner_thread = None
            raise
        configs = {id(c): c for c in (engine.config, engine.scheduler.config)}.values()
        old = {name: getattr(engine.config, name) for name in levers}
        for config in configs:
            for name, value in levers.items():
                setattr(config, name, value)
        return old

    def _release_engine(self) -> None:
        """Hand the engine back as it was built (its levers restored): any thread may step it again."""
        with _owned_lock:
            for config in {id(c): c for c in (self.engine.config, self.engine.scheduler.config)}.values():
                for name, value in self._restore.items():
                    setattr(config, name, value)
            self._restore = {}
            self.engine.owner_thread = None

    def stopped_reason(self) -> str:
        if self.crash is not None:
            return f"the engine thread crashed: {type(self.crash).__name__}: {self.crash}"
        return "the engine is shut down; start a new server"

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                self._drain(block=not self.engine.has_unfinished())
                if self._stopping:
                    break
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as exc:  # a bug in this loop: keep no caller waiting forever
            self.crash = exc
            logger.exception("minillm engine thread crashed")
        finally:
            self._stopping = True
            reason = self.stopped_reason() if self.crash else "the server is shutting down"
            for request in list(self._active.values()):
                if request.seq is not None:
                    self.engine.abort(request.seq, "abort", reason)
            self._publish()
            self._stopped.set()
            while True:  # whatever arrived meanwhile is refused
                try:
                    kind, payload = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self._settle_pending(payload)
                    self._reply(payload[0], error=EngineStoppedError(reason))
            self._release_engine()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = command
            if kind == "add":
                self._settle_pending(payload)
                self._admit(payload)
            elif kind == "abort":
                self._abort(*payload)
            elif kind == "stop":
                self._stopping = True
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish()  # aborted requests get their last event now

    def _settle_pending(self, requests: list[RequestState]) -> None:
        with self._pending_lock:
            self._num_pending -= len(requests)

    def _admit(self, requests: list[RequestState]) -> None:
        """Admit a request's prompts, all or none: if the engine refuses one, the ones already queued are taken
        back before any step runs (their blocks were never allocated) and the caller gets the refusal."""
        admitted: list[RequestState] = []
        for p, request in enumerate(requests):
            try:
                add_to_engine(self.llm, request)
            except Exception as exc:
                for done in admitted:
                    self.engine.abort(done.seq, "abort", "another prompt of its request was refused")
                self.metrics.rejected += 1
                if not isinstance(exc, (ValueError, TypeError)):   # e.g. a chat template that raises
                    exc = ValueError(f"{type(exc).__name__}: {exc}")
                if len(requests) > 1:
                    exc = type(exc)(f"prompt[{p}] of {len(requests)}: {exc}")
                self._reply(request, error=exc)
                return
            admitted.append(request)
        for request in admitted:
            params = request.seq.params
            request.holdback_chars = max((len(s) for s in params.stop), default=1) - 1
            request.choices = [ChoiceState(s, request.index_offset + s.index) for s in request.seq.group]
            self._active[request.request_id] = request
        self._reply(requests[0], num_prompt_tokens=sum(r.seq.num_prompt_tokens for r in admitted))

    def _abort(self, request_id: str, reason: str) -> None:
        request = self._active.get(request_id)
        if request is not None and request.seq is not None:
            self.engine.abort(request.seq, "abort", reason)

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as exc:  # Engine already finished the batch with "error"; keep serving
            self.metrics.step_errors += 1
            logger.error("minillm engine step failed: %s: %s", type(exc).__name__, exc)
        if len(self.engine.stats.steps) > MAX_KEPT_STEPS:
            self.engine.reset_stats()
        self._publish()

    def _publish(self) -> None:
        """Hand every request what each of its choices got since its last event; retire the finished ones."""
        metrics = self.metrics
        for request_id, request in list(self._active.items()):
            group = request.seq.group
            first_token = min((s.first_token_s for s in group if s.first_token_s is not None), default=None)
            if first_token is not None and not request.counted_first_token:
                request.counted_first_token = True
                metrics.prompt_tokens += request.seq.num_prompt_tokens
                metrics.ttft_s.observe(max(0.0, first_token - request.arrival_s))
            ranked = len(group) > request.params.n   # best_of > n: the returned choices are known at the end
            if ranked and not request.seq.group_finished:
                continue
            if ranked:
                metrics.generation_tokens += sum(s.num_output_tokens for s in group)
                request.choices = [ChoiceState(s, request.index_offset + i)
                                   for i, s in enumerate(returned_sequences(request.seq))]
            for choice in request.choices:
                if not choice.done:
                    self._publish_choice(request, choice, count_tokens=not ranked)
            if all(choice.done for choice in request.choices):
                del self._active[request_id]
                for choice in request.choices:
                    reason = choice.seq.finish_reason
                    metrics.finished[reason] = metrics.finished.get(reason, 0) + 1
                metrics.e2e_s.observe(time.perf_counter() - request.arrival_s)

    def _publish_choice(self, request: RequestState, choice: ChoiceState, count_tokens: bool) -> None:
        seq = choice.seq
        output = seq.token_ids[seq.num_prompt_tokens:]
        new_ids = output[choice.sent_tokens:]
        text = seq.output_text
        finished = seq.is_finished
        upto = len(text) if finished else max(choice.sent_chars, len(text) - request.holdback_chars)
        new_text = text[choice.sent_chars:upto]
        if not (new_ids or new_text or finished):
            return
        new_logprobs = seq.logprobs[choice.sent_tokens:choice.sent_tokens + len(new_ids)]
        choice.sent_tokens += len(new_ids)
        choice.sent_chars = max(choice.sent_chars, upto)
        if count_tokens:
            self.metrics.generation_tokens += len(new_ids)
        prompt_ids = prompt_logprobs = None
        if not choice.sent_prompt and (new_ids or finished):
            choice.sent_prompt = True
            prompt_ids = list(seq.prompt_token_ids)
            if seq.params.prompt_logprobs is not None:
                prompt_logprobs = list(seq.prompt_logprobs)
        event = StreamEvent(request.request_id, new_text, new_ids, seq.num_prompt_tokens, len(output),
                            seq.finish_reason if finished else None, seq.error if finished else None,
                            new_logprobs, prompt_ids, prompt_logprobs, choice.index)
        self._send(request, event)
        choice.done = finished

    @property
    def gauges(self) -> EngineGauges:
        """The scheduler as it is now, read from any thread (lengths and counters, atomic under the GIL), so a
        scrape during a long step sees the request being prefilled as running. Requests sent but not yet
        admitted (the engine thread admits between steps) count as waiting."""
        sched, bm = self.engine.scheduler, self.engine.block_manager
        return EngineGauges(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + max(0, self._num_pending),
            kv_blocks_used=bm.num_used_blocks if bm is not None else 0,
            kv_blocks_total=bm.num_blocks if bm is not None else 0,
            prefix_cache_queries=sched.prefix_queries, prefix_cache_hits=sched.prefix_hits,
            num_preemptions=sched.num_preemptions)

    # ------------------------------------------------------------------ thread -> loop
    @staticmethod
    def _call(request: RequestState, fn, *args) -> None:
        try:
            request.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def _send(self, request: RequestState, event: StreamEvent) -> None:
        self._call(request, request.events.put_nowait, event)

    def _reply(self, request: RequestState, num_prompt_tokens: int | None = None, error: BaseException | None = None):
        def settle() -> None:
            if request.accepted.done():  # the caller was cancelled meanwhile
                return
            if error is not None:
                request.accepted.set_exception(error)
            else:
                request.accepted.set_result(num_prompt_tokens)

        self._call(request, settle)
