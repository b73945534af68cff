"""Engine: the step loop — schedule -> run model -> sample -> update -> finish."""

from __future__ import annotations

import threading
import time

import torch

from dataclasses import dataclass

from ..config import DEFAULT_CPU_HOURLY_USD, DEFAULT_GPU_HOURLY_USD, EngineConfig
from ..hardware import device_name
from ..quant import weight_bytes
from ..sampling import SamplingParams
from ..structured import GrammarBackend, StructuredOutputs
from ..seams import BlockAllocator
from .kv_cache import KVCache, kv_bytes_per_token
from .metrics import RunStats, StepStats
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .speculator import DraftWorker, Speculator
from .thread_policy import ThreadPolicy


def validate_cache_salt(cache_salt) -> None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt={cache_salt!r} must be None or a str (requests with different salts "
                         "never share prefix-cached blocks)")
    if cache_salt is not None and cache_salt.startswith(LORA_SALT):
        raise ValueError(f"cache_salt={cache_salt[:40]!r} starts with {LORA_SALT!r}, which marks LoRA adapters' blocks")


LORA_SALT = "\x00lora="


def prefix_salt(cache_salt: str | None, lora_request) -> str | None:
    """The salt a request's prefix-cache hashes use: its adapter's id enters it, so requests on different adapters
    (or on an adapter and the base model) never share KV blocks, while requests on one adapter do."""
    if lora_request is None:
        return cache_salt
    return f"{LORA_SALT}{lora_request.lora_int_id}\x00{cache_salt or ''}"


@dataclass(eq=False)
class Weights:
    """What engines sharing weights share (LLM.with_levers): read-only after loading."""

    model_path: str
    model_config: object
    model: object                 # LlamaForCausalLM
    tokenizer: object | None      # None for random-weight presets
    format: tuple                 # (weight_dtype, group size, calibration, head dtype): builder.weight_format
    eos_token_ids: set[int]


class Engine:
    """The step loop over parts that minillm.engine.builder.build_engine wires together."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, weights: Weights,
                 max_model_len: int, block_manager: BlockAllocator | None, kv_cache: KVCache | None,
                 scheduler: Scheduler, runner: ModelRunner, parts=None, draft: DraftWorker | None = None,
                 lora_registry=None, tensor_parallel=None, speculator_factory=None):
        """lora_registry: enable_lora=True's LoRARegistry (minillm/lora.py); tensor_parallel: rank 0's
        engine/parallel.TensorParallel (tensor_parallel_size > 1); speculator_factory(stats) -> the Speculator of
        speculative=..., given this engine's counters (its proposers count into them), or None."""
        self.config, self.device, self.dtype = config, device, dtype
        self.weights = weights
        self.model_path, self.model_config = weights.model_path, weights.model_config
        self.model, self.tokenizer, self.eos_token_ids = weights.model, weights.tokenizer, weights.eos_token_ids
        self.max_model_len = max_model_len
        self.block_manager, self.kv_cache = block_manager, kv_cache
        self.scheduler, self.runner = scheduler, runner
        self.parts = parts              # the EngineParts it was built with (with_levers passes them on)
        self.draft = draft
        self.lora_registry, self.tensor_parallel = lora_registry, tensor_parallel
        self.owner_thread: threading.Thread | None = None  # set while a server thread owns the engine
        self.hourly_usd = config.gpu_hourly_usd if config.gpu_hourly_usd is not None else (
            DEFAULT_GPU_HOURLY_USD if device.type == "cuda" else DEFAULT_CPU_HOURLY_USD)
        self.device_label = device_name(device)
        self._rng = torch.Generator().manual_seed(config.seed)
        self.stats = RunStats(self.device_label, self.hourly_usd)
        self.speculator: Speculator | None = speculator_factory(lambda: self.stats.spec) if speculator_factory else None
        self._preemptions_at_reset = 0
        self._prefix_at_reset = (0, 0, 0)
        # CPU threads: "auto" re-decides them from the other processes' load (engine/thread_policy.py);
        # a tensor-parallel engine's ranks keep one thread each.
        self.thread_policy: ThreadPolicy | None = None
        if device.type == "cpu" and config.tensor_parallel_size == 1:
            if config.cpu_threads == "auto":
                self.thread_policy = ThreadPolicy()
            else:
                torch.set_num_threads(config.cpu_threads)

    # ----------------------------------------------------------------- requests
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        vocab = self.model_config.vocab_size
        bad_bias = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary range [0, {vocab - 1}]")
        if params.num_sequences > self.config.max_num_seqs:
            which = f"best_of={params.best_of}" if params.best_of is not None else f"n={params.n}"
            raise ValueError(f"{which} continuations run side by side, but max_num_seqs={self.config.max_num_seqs}; "
                             f"lower {which.split('=')[0]} to at most {self.config.max_num_seqs} or raise max_num_seqs")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens); give at least 1 token")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary range [0, {vocab - 1}]")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; the context (max_model_len) is {self.max_model_len}, "
                f"so a prompt may have at most {self.max_model_len - 1} tokens to leave room for one output token"
            )
        if self.block_manager is not None and not self.block_manager.contiguous:
            need = min(n + params.max_tokens, self.max_model_len)
            if self.block_manager.blocks_for(need) > self.block_manager.num_blocks:
                raise ValueError(
                    f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {need} KV slots; the pool holds "
                    f"{self.block_manager.num_blocks * self.block_manager.block_size}. Lower max_tokens or raise "
                    "kv_cache_bytes."
                )

    def validate_lora(self, lora_request) -> None:
        """A request's adapter: None (the base model), or a LoRARequest whose PEFT directory fits this model (read
        and checked once per id); ValueError naming what is wrong, and nothing changes."""
        if lora_request is None:
            return
        if self.lora_registry is None:
            raise ValueError(f"lora_request={lora_request!r} needs an engine built with enable_lora=True "
                             "(LLM(..., enable_lora=True, max_loras=4, max_lora_rank=16))")
        self.lora_registry.get(lora_request)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, lora_request=None) -> Sequence:
        """Validate and queue one request. A bad request raises here and changes nothing.

        `cache_salt`: requests with different salts never share prefix-cached blocks. With n > 1 (or
        best_of) the request is `params.num_sequences` continuations: the first is returned, `seq.group`
        lists them all. They share the prompt's blocks when the pool is paged (Scheduler._fork); with
        paged=False, kv_cache=False or an allocator that cannot fork, each is queued on its own.
        `lora_request`: a minillm.LoRARequest (enable_lora=True), or None for the base model."""
        self._check_owner("add_request")
        prompt_token_ids = list(prompt_token_ids)
        self.validate_request(prompt_token_ids, params)
        validate_cache_salt(cache_salt)
        self.validate_lora(lora_request)
        structured = params.structured_outputs
        matchers = [self.grammar_matcher(structured) if structured is not None else None
                    for _ in range(params.num_sequences)]   # all compiled before anything is queued
        request_id = request_id or ""
        group: list[Sequence] = []
        now = time.perf_counter()
        for index, grammar in enumerate(matchers):
            seq = Sequence(prompt_token_ids, params, prompt=prompt, request_id=request_id,
                           cache_salt=prefix_salt(cache_salt, lora_request), grammar=grammar, index=index,
                           lora_request=lora_request)
            seq.group = group
            request_id = request_id or seq.request_id   # the continuations share the first one's id
            if not params.greedy:   # continuation i draws with seed + i (vLLM's rule)
                seed = params.seed + index if params.seed is not None else int(
                    torch.randint(0, 2**62, (1,), generator=self._rng))
                seq.generator = torch.Generator(device=self.device).manual_seed(seed)
            seq.arrival_s = now
            group.append(seq)
        first = group[0]
        if len(group) > 1 and self.scheduler.forking and len(prompt_token_ids) > 1:
            first.pending_forks = group[1:]   # forked once the prompt is prefilled
            self.scheduler.add(first)
        else:
            for seq in group:
                self.scheduler.add(seq)
        return first

    def grammar_matcher(self, structured: StructuredOutputs):
        """A fresh matcher for one request (the constraint compiled once per engine and cached); ValueError for a
        malformed schema, regex or grammar."""
        if self.runner.grammars is None:
            self.runner.grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self.runner.grammars.matcher(structured)

    def abort(self, seq: Sequence, reason: str = "abort", error: str | None = None) -> None:
        """Finish a request (every continuation of its group that has not finished) and free its blocks."""
        now = time.perf_counter()
        for member in seq.group:
            if not member.is_finished:
                member.finish_s = now
                self.scheduler.finish(member, reason, error)
            member.pending_forks = []
        if self.speculator is not None:
            self.speculator.release_finished(seq.group)

    def _check_owner(self, what: str) -> None:
        """An engine that a server thread owns (minillm.serve sets owner_thread) is stepped by that thread only."""
        owner = self.owner_thread
        if owner is not None and owner is not threading.current_thread():
            raise RuntimeError(f"{what}() from thread {threading.current_thread().name!r}: this engine is being served "
                               f"by thread {owner.name!r} (minillm serve / serve_in_thread). Send requests to the "
                               "server, stop it first, or build a second engine with llm.with_levers()")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- the loop
    def _check_stop(self, seq: Sequence) -> str | None:
        p = seq.params
        token = seq.token_ids[-1]
        self._detokenize(seq)
        # a stop string is looked for where this token's text could complete one (text before min_tokens is not)
        search_from = max(0, seq.stop_checked_chars - max((len(s) for s in p.stop), default=1) + 1)
        seq.stop_checked_chars = len(seq.output_text)
        if seq.grammar is not None and seq.grammar.is_terminated():   # complete: only EOS was allowed (even
            return "stop"                                                # before min_tokens: nothing can follow)
        if seq.num_output_tokens < p.min_tokens:   # EOS and stop ids are banned by the sampler, stop strings wait
            return "length" if len(seq) >= self.max_model_len else None
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if p.stop:
            found = [i for i in (seq.output_text.find(s, search_from) for s in p.stop) if i != -1]
            if found:   # the earliest match wins; the text is cut before it
                seq.output_text = seq.output_text[:min(found)]
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _detokenize(self, seq: Sequence) -> None:
        if self.tokenizer is None:  # random-weight presets have no tokenizer: token ids only
            return
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        # An incomplete UTF-8 character decodes to U+FFFD: hold it back until it completes.
        seq.output_text = text[:-1] if text.endswith("\ufffd") else text

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a token (finished ones included)."""
        self._check_owner("step")
        if self.thread_policy is not None:
            self.thread_policy.update()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs and self.scheduler.has_unfinished():
            # Preemption may have just emptied the running set; admission gets a second try.
            seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            stuck = list(self.scheduler.waiting)
            for seq in stuck:  # nothing runs and nothing fits: refuse rather than spin
                self.abort(seq, "error", "the KV pool cannot hold this request")
            return stuck
        copies = self.scheduler.take_block_copies()
        if copies:   # copy-on-write: forked continuations get private copies of shared blocks they write into
            self.kv_cache.copy_blocks(copies)
        t0 = time.perf_counter()
        for seq in seqs:
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = t0
        if self.speculator is not None and not is_prefill:
            return self._speculative_step(seqs, t0)
        num_tokens = sum(s.num_scheduled_tokens if self.block_manager else len(s) for s in seqs)
        try:
            tokens = self.runner.run(seqs)
        except Exception as exc:
            self._fail(seqs, exc)
            raise
        now = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = time.perf_counter()
        for seq, token in zip(seqs, tokens):
            if token is None:
                continue
            if seq.first_token_s is None:
                seq.first_token_s = now
            seq.token_times_s.append(now)
        kind = "decode" if not is_prefill else ("mixed" if any(
            len(s) - s.num_cached_tokens == 1 for s in seqs) and self.config.chunked_prefill else "prefill")
        self._record_step(kind, seqs, num_tokens, now - t0)
        self.scheduler.postprocess(seqs, tokens, self._check_stop)
        for seq in seqs:
            if seq.is_finished and seq.finish_s is None:
                seq.finish_s = now
        if self.speculator is not None:   # a recomputed prefill can finish a sequence the draft knows
            self.speculator.release_finished(seqs)
        return seqs

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        """A model pass raised: fail this batch with the reason; its blocks go back to the pool."""
        for seq in seqs:
            self.abort(seq, "error", f"{type(exc).__name__}: {exc}")

    def _speculative_step(self, seqs: list[Sequence], t0: float) -> list[Sequence]:
        """A decode step with speculation: one target pass keeps 1 to k + 1 tokens per sequence."""
        try:
            kept = self.speculator.step(seqs)
        except Exception as exc:
            self._fail(seqs, exc)
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        num_tokens = sum(s.num_scheduled_tokens for s in seqs)
        self._record_step("decode", seqs, num_tokens, now - t0)
        lengths = [len(seq) for seq in seqs]
        self.scheduler.postprocess_many(seqs, kept, self._check_stop)
        for seq, before in zip(seqs, lengths):
            seq.token_times_s.extend([now] * (len(seq) - before))  # the kept tokens arrive together
            if seq.is_finished and seq.finish_s is None:
                seq.finish_s = now
        self.speculator.release_finished(seqs)
        return seqs

    def _record_step(self, kind: str, seqs: list[Sequence], num_tokens: int, duration_s: float) -> None:
        """Called after the model ran and before postprocess: every fed token is in the cache."""
        kv_used = kv_reserved = kv_shared = 0
        if self.kv_cache is not None:
            stepped = set(id(s) for s in seqs)
            held, cached = self.scheduler.kv_token_counts(stepped)
            usage = self.block_manager.usage(cached)
            kv_used = self.kv_cache.bytes_per_token * usage.real_tokens
            kv_reserved = self.kv_cache.bytes_per_token * usage.reserved_slots
            kv_shared = self.kv_cache.bytes_per_token * (held - cached)
        st = self.stats
        running = len(self.scheduler.running)
        st.steps.append(StepStats(len(st.steps), kind, len(seqs), num_tokens, duration_s, kv_used, kv_reserved,
                                  running, expert_tokens=self.runner.pop_expert_tokens()))
        st.peak_kv_bytes = max(st.peak_kv_bytes, kv_used)
        st.peak_kv_reserved_bytes = max(st.peak_kv_reserved_bytes, kv_reserved)
        st.peak_kv_shared_bytes = max(st.peak_kv_shared_bytes, kv_shared)
        st.peak_running = max(st.peak_running, running)
        st.num_preemptions = self.scheduler.num_preemptions - self._preemptions_at_reset
        self._record_prefix_cache()

    def _record_prefix_cache(self) -> None:
        sched, (queries0, hits0, prompt0) = self.scheduler, self._prefix_at_reset
        self.stats.prefix_cache_queries = sched.prefix_queries - queries0
        self.stats.prefix_cache_hits = sched.prefix_hits - hits0
        self.stats.num_cached_prompt_tokens = sched.prefix_cached_prompt_tokens - prompt0

    def reset_stats(self) -> RunStats:
        self.stats = RunStats(self.device_label, self.hourly_usd)
        self.runner.pop_expert_tokens()   # passes outside a step (warm-up, a lab's probe) are not counted
        self._preemptions_at_reset = self.scheduler.num_preemptions
        sched = self.scheduler
        self._prefix_at_reset = (sched.prefix_queries, sched.prefix_hits, sched.prefix_cached_prompt_tokens)
        return self.stats

    def shutdown(self) -> None:
        """Stop this engine's tensor-parallel workers (nothing to do on one device); no step runs afterwards."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()

    # ----------------------------------------------------------------- sizes
    def block_usage(self):
        """The block manager's statistics now (None without a KV cache): blocks in use,
        reserved-but-unused slots, and the fraction of reserved KV memory holding real tokens."""
        if self.block_manager is None:
            return None
        return self.block_manager.usage(self.scheduler.kv_tokens())


    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as stored (quantized matrices with their scales and zeros); with
        tensor_parallel_size N, rank 0's shard (each rank holds about 1/N, the norms whole)."""
        return weight_bytes(self.model)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes per token as the cache stores them (values plus, for int8 / fp8, their scales)."""
        return kv_bytes_per_token(self.model_config, self.dtype, self.config.kv_dtype)
