"""Engine: the step loop — schedule -> run model -> sample -> update -> finish."""

from __future__ import annotations

import threading
import time

import torch

from ..config import DEFAULT_CPU_HOURLY_USD, DEFAULT_GPU_HOURLY_USD, EngineConfig
from ..hardware import device_name, resolve_device, resolve_dtype
from ..models.loader import load_model, load_model_config, load_tokenizer, read_generation_eos, resolve_model_path
from ..models.quantize import head_dtype_for, quantize_for_config
from ..quant import weight_bytes
from ..sampling import SamplingParams
from .block_manager import BlockManager
from .kv_cache import KVCache, kv_bytes_per_token, kv_quantized, pool_bytes
from .metrics import RunStats, StepStats
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import DraftWorker, Speculator


def validate_cache_salt(cache_salt) -> None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt={cache_salt!r} must be None or a str (requests with different salts "
                         "never share prefix-cached blocks)")


class Engine:
    def __init__(self, config: EngineConfig, share_weights_with: "Engine | None" = None):
        self.config = config
        self.owner_thread: threading.Thread | None = None  # set while a server thread owns the engine
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, but this engine runs on {self.device.type!r} "
                             f"(device={config.device!r}); CUDA graphs replay GPU kernel launches. "
                             "Leave cuda_graphs=False on this machine.")
        donor = share_weights_with
        self.model_path = donor.model_path if donor is not None else resolve_model_path(config.model)
        self.model_config = mcfg = load_model_config(self.model_path)
        limit = mcfg.max_position_embeddings
        if mcfg.sliding_window:  # keep every sequence inside the window: full attention is exact there
            limit = min(limit, mcfg.sliding_window)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {limit} tokens")
        self.max_model_len = config.max_model_len or limit
        wd = config.weight_dtype if config.weight_dtype != "auto" else None
        self.weight_format = (wd, config.weight_group_size if wd == "int4" else None,
                              config.weight_calibration if wd else None,
                              head_dtype_for(wd, config.weight_head_dtype) if wd else None)
        compatible = donor is not None and (donor.device, donor.dtype) == (self.device, self.dtype) \
            and donor.max_model_len >= self.max_model_len
        if compatible and donor.weight_format == self.weight_format:
            self.model, self.tokenizer = donor.model, donor.tokenizer  # same weights, own cache and scheduler
        elif compatible and donor.weight_format[0] is None:
            # Quantize the donor's float weights in memory (a shallow copy: the donor keeps its own).
            self.tokenizer = donor.tokenizer
            self.model = quantize_for_config(donor.model, wd, config.weight_group_size, config.weight_calibration,
                                             self.tokenizer, in_place=False, head_dtype=config.weight_head_dtype)
        else:
            self.model = load_model(self.model_path, self.dtype, self.device, self.max_model_len)
            self.tokenizer = load_tokenizer(self.model_path)
            if wd is not None:
                quantize_for_config(self.model, wd, config.weight_group_size, config.weight_calibration,
                                    self.tokenizer, in_place=True, head_dtype=config.weight_head_dtype)
        self.eos_token_ids = set(mcfg.eos_token_ids) | set(read_generation_eos(self.model_path))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        self.kv_cache: KVCache | None = None
        self.block_manager: BlockManager | None = None
        if config.kv_cache:
            size = pool_bytes(mcfg, self.dtype, self.device, config.max_num_seqs, self.max_model_len,
                              config.kv_cache_bytes, config.kv_cache_memory_fraction, config.kv_dtype)
            per_block = self.kv_bytes_per_token * config.block_size
            num_blocks = size // per_block
            if num_blocks < 1:
                raise ValueError(f"the KV pool of {size} bytes holds no block of {per_block} bytes; "
                                 "raise kv_cache_bytes or kv_cache_memory_fraction")
            if not config.paged and num_blocks * config.block_size < self.max_model_len:
                raise ValueError(
                    f"paged=False reserves max_model_len={self.max_model_len} tokens per request, but the KV pool "
                    f"of {size} bytes holds {num_blocks * config.block_size} tokens; lower max_model_len, raise "
                    "kv_cache_bytes, or use paged=True")
            self.block_manager = BlockManager(num_blocks, config.block_size, contiguous=not config.paged)
            self.kv_cache = KVCache(mcfg, num_blocks, config.block_size, self.dtype, self.device, config.kv_dtype)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.runner = ModelRunner(self.model, self.device, self.block_manager, self.kv_cache, config.attention_backend)
        if config.cuda_graphs:
            self.runner.enable_cuda_graphs(config.max_num_seqs, self.max_model_len)
        self.draft = self._load_draft() if config.speculative == "draft" else None
        self.speculator = None if config.speculative is None else Speculator(
            config.speculative, config.num_speculative_tokens, self.runner, self.block_manager, self.max_model_len,
            config.draft_num_layers, self.draft)
        self.hourly_usd = config.gpu_hourly_usd if config.gpu_hourly_usd is not None else (
            DEFAULT_GPU_HOURLY_USD if self.device.type == "cuda" else DEFAULT_CPU_HOURLY_USD)
        self.device_label = device_name(self.device)
        self._rng = torch.Generator().manual_seed(config.seed)
        self.stats = RunStats(self.device_label, self.hourly_usd)
        if self.speculator is not None:
            self.speculator.stats = self.stats.spec
        self._preemptions_at_reset = 0
        self._prefix_at_reset = (0, 0, 0)

    def _load_draft(self) -> DraftWorker:
        """speculative="draft": the second model, on this engine's device and dtype, with a KV pool
        of as many blocks as the target's. It must share the target's tokenizer (same vocabulary:
        a proposal is a token id the target scores) and cover max_model_len positions."""
        config, mcfg = self.config, self.model_config
        path = resolve_model_path(config.draft_model)
        dcfg = load_model_config(path)
        if dcfg.vocab_size != mcfg.vocab_size:
            raise ValueError(f"draft_model={config.draft_model!r} has a vocabulary of {dcfg.vocab_size} tokens, the "
                             f"target {mcfg.vocab_size}: the draft must share the target's tokenizer")
        if dcfg.max_position_embeddings < self.max_model_len:
            raise ValueError(f"draft_model={config.draft_model!r} has a context of {dcfg.max_position_embeddings} "
                             f"tokens, shorter than max_model_len={self.max_model_len}; lower max_model_len")
        if self.tokenizer is not None:
            draft_tokenizer = load_tokenizer(path)
            if draft_tokenizer is not None and draft_tokenizer.get_vocab() != self.tokenizer.get_vocab():
                raise ValueError(f"draft_model={config.draft_model!r} has another tokenizer than the target "
                                 "(same size, different tokens): its proposals would mean other text")
        model = load_model(path, self.dtype, self.device, self.max_model_len)
        return DraftWorker(model, dcfg, self.device, self.dtype, self.block_manager.num_blocks,
                           self.block_manager.block_size, config.attention_backend)

    # ----------------------------------------------------------------- requests
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens); give at least 1 token")
        vocab = self.model_config.vocab_size
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
                    f"{self.block_manager.capacity_tokens}. Lower max_tokens or raise kv_cache_bytes."
                )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> Sequence:
        """Validate and queue one request. A bad request raises here and changes nothing.

        `cache_salt`: requests with different salts never share prefix-cached blocks."""
        self._check_owner("add_request")
        prompt_token_ids = list(prompt_token_ids)
        self.validate_request(prompt_token_ids, params)
        validate_cache_salt(cache_salt)
        seq = Sequence(prompt_token_ids, params, prompt=prompt, request_id=request_id or "", cache_salt=cache_salt)
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        seq.arrival_s = time.perf_counter()
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence, reason: str = "abort", error: str | None = None) -> None:
        if not seq.is_finished:
            seq.finish_s = time.perf_counter()
            self.scheduler.finish(seq, reason, error)
        if self.speculator is not None:
            self.speculator.release_finished([seq])

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
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if p.stop:
            for s in p.stop:
                idx = seq.output_text.find(s)
                if idx != -1:
                    seq.output_text = seq.output_text[:idx]
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
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs and self.scheduler.has_unfinished():
            # Preemption may have just emptied the running set; admission gets a second try.
            seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            stuck = list(self.scheduler.waiting)
            for seq in stuck:  # nothing runs and nothing fits: refuse rather than spin
                self.abort(seq, "error", "the KV pool cannot hold this request")
            return stuck
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
        kv_used = kv_reserved = 0
        if self.kv_cache is not None:
            stepped = set(id(s) for s in seqs)
            cached = self.scheduler.kv_tokens(stepped)
            usage = self.block_manager.usage(cached)
            kv_used = self.kv_cache.bytes_per_token * usage.real_tokens
            kv_reserved = self.kv_cache.bytes_per_token * usage.reserved_slots
        st = self.stats
        running = len(self.scheduler.running)
        st.steps.append(StepStats(len(st.steps), kind, len(seqs), num_tokens, duration_s, kv_used, kv_reserved,
                                  running))
        st.peak_kv_bytes = max(st.peak_kv_bytes, kv_used)
        st.peak_kv_reserved_bytes = max(st.peak_kv_reserved_bytes, kv_reserved)
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
        if self.speculator is not None:
            self.speculator.stats = self.stats.spec
        self._preemptions_at_reset = self.scheduler.num_preemptions
        sched = self.scheduler
        self._prefix_at_reset = (sched.prefix_queries, sched.prefix_hits, sched.prefix_cached_prompt_tokens)
        return self.stats

    # ----------------------------------------------------------------- sizes
    def block_usage(self):
        """The block manager's statistics now (None without a KV cache): blocks in use,
        reserved-but-unused slots, and the fraction of reserved KV memory holding real tokens."""
        if self.block_manager is None:
            return None
        return self.block_manager.usage(self.scheduler.kv_tokens())


    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as stored (quantized matrices with their scales and zeros)."""
        return weight_bytes(self.model)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes per token as the cache stores them (values plus, for int8 / fp8, their scales)."""
        kv_dtype = self.config.kv_dtype if kv_quantized(self.config.kv_dtype) else None
        return kv_bytes_per_token(self.model_config, self.dtype, kv_dtype)
