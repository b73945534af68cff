"""LLM: the one class a lab needs — generate(), chat(), stream(). Mirrors vLLM's LLM."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence as Seq
from typing import Any

from .config import DEVICE_DEFAULTS, EngineConfig
from .engine.builder import EngineParts, build_engine
from .engine.engine import validate_cache_salt
from .engine.metrics import RunStats
from .lora import LoRARequest
from .outputs import RequestOutput
from .sampling import SamplingParams

PromptType = str | dict


class LLM:
    """`LLM(model=None, **levers, **parts)`: None loads the default model (SmolLM2-135M-Instruct).

    >>> llm = LLM(kv_cache=True)
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> out[0].outputs[0].text

    Levers are EngineConfig's fields. Parts replace the engine's own (protocols in minillm/seams.py,
    each checked when the engine is built): `attention_backend=` (a lever: "torch", "triton" or an
    object), `block_manager=` (a factory (num_blocks, block_size, contiguous) -> allocator),
    `scheduling_policy=`, `proposer=`, `verifier=` (with speculative=...), `sampler=`, and inside the model
    `quantized_matmul=` (with weight_dtype=...), `lora_delta=` (with enable_lora=True), `moe_router=` and
    `moe_experts=` (a Mixtral-style model); and `sharding=` (with tensor_parallel_size > 1: how every rank cuts
    its shard). An engine's parts are its own: another engine on the same weights (with_levers) runs with its own.
    """

    def __init__(self, model: str | None = None, _share_weights_with: "LLM | None" = None, **levers_and_parts: Any):
        parts = EngineParts(**{name: levers_and_parts.pop(name) for name in EngineParts.names()
                               if name in levers_and_parts})
        self.config = EngineConfig.from_kwargs(model=model, **levers_and_parts)
        # levers left to their defaults (None) that the engine fills in for its device: with_levers leaves them
        # to the new engine's defaults (kv_cache=False turns the default chunked prefill off)
        self._defaulted = tuple(name for name in DEVICE_DEFAULTS if getattr(self.config, name) is None)
        donor = _share_weights_with.engine if _share_weights_with is not None else None
        self.engine = build_engine(self.config, parts, share_weights_with=donor)
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (tensor_parallel_size > 1; also done at interpreter exit).
        Nothing to do on one device. The LLM cannot generate afterwards."""
        self.engine.shutdown()

    def with_levers(self, **changes: Any) -> "LLM":
        """A second engine with some levers (or parts) changed that shares this one's weights (no reload).

        >>> no_cache = llm.with_levers(kv_cache=False)
        >>> mine = llm.with_levers(speculative="ngram", proposer=MyProposer())
        Each engine keeps its own KV pool and scheduler; only the read-only weights are shared. Parts
        not named carry over from this engine (give `part=None` for the engine's own).
        """
        levers = {**self._levers(), **{name: None for name in self._defaulted},
                  **{k: v for k, v in changes.items() if k not in EngineParts.names()}}
        inherited = {name: getattr(self.engine.parts, name) for name in EngineParts.names()}
        if levers["speculative"] is None:      # parts the new levers leave unused are not carried over
            inherited.update(proposer=None, verifier=None)
        if not levers["kv_cache"]:
            inherited.update(block_manager=None)
        if levers["weight_dtype"] != self.config.weight_dtype:   # a matmul is written for one weight format
            inherited.update(quantized_matmul=None)
        if not levers["enable_lora"]:
            inherited.update(lora_delta=None)
        if levers["tensor_parallel_size"] == 1:   # one rank: nothing to cut
            inherited.update(sharding=None)
        return LLM(self.config.model, _share_weights_with=self, **{**levers, **inherited, **changes})

    # ------------------------------------------------------------ inputs
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("the prompt is empty (''); give at least one character")
            if self.tokenizer is None:
                raise ValueError(f"model {self.engine.model_path!r} has no tokenizer; "
                                 "pass prompts as {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
                return prompt.get("prompt"), [int(t) if not isinstance(t, bool) else t for t in ids]
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
        raise TypeError(f"a prompt is a str or a dict with 'prompt_token_ids'; got {type(prompt).__name__}")

    def _requests(self, prompts, sampling_params, lora_request=None) -> list[tuple]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts; give one (or None), "
                                 "or one per prompt")
        else:
            loras = [lora_request] * len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        requests = []
        for prompt, p, lora in zip(prompts, params, loras):
            text, ids = self._tokenize(prompt)
            self.engine.validate_request(ids, p)  # all-or-nothing: validate before queueing any
            self.engine.validate_lora(lora)
            # A dict prompt may carry "cache_salt" (vLLM's field): different salts never share
            # prefix-cached blocks, so tenants cannot time each other's prompts.
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            validate_cache_salt(salt)
            requests.append((text, ids, p, salt, lora))
        return requests

    # ------------------------------------------------------------ generation
    def generate(self, prompts: PromptType | Seq[PromptType], sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = False, lora_request: LoRARequest | list | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        A prompt is a str, or a dict with "prompt_token_ids" (or "prompt") and optionally
        "cache_salt" (a str, as in vLLM): with prefix_caching=True, requests with different salts
        never share cached blocks. `outputs[i].metrics.num_cached_tokens` counts the prompt tokens
        served from the prefix cache. `lora_request` (enable_lora=True): a LoRARequest for every prompt, or a list
        with one per prompt (None: the base model)."""
        requests = self._requests(prompts, sampling_params, lora_request)
        engine = self.engine
        stats = engine.reset_stats()
        t0 = time.perf_counter()
        seqs = [engine.add_request(ids, p, prompt=text, cache_salt=salt, lora_request=lora)
                for text, ids, p, salt, lora in requests]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        try:
            done = 0
            while engine.has_unfinished():
                engine.step()
                if bar is not None:
                    now_done = sum(s.group_finished for s in seqs)
                    bar.update(now_done - done)
                    done = now_done
        finally:
            if bar is not None:
                bar.close()
            for seq in seqs:  # an exception mid-run: nothing stays queued or holds blocks
                engine.abort(seq, "abort", "generate() was interrupted")
        stats.wall_s = time.perf_counter() - t0
        stats.num_prompt_tokens = sum(s.num_prompt_tokens for s in seqs)
        stats.num_output_tokens = sum(c.num_output_tokens for s in seqs for c in s.group)   # n > 1: every continuation
        return [RequestOutput.from_sequence(s, self.tokenizer) for s in seqs]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None) -> Iterator[str]:
        """Yield the answer's text in pieces as tokens decode."""
        (text, ids, p, salt, lora), = self._requests([prompt], sampling_params, lora_request)
        if p.num_sequences > 1:
            raise ValueError(f"stream() yields one text; n={p.n}, best_of={p.best_of} ask for several: use generate()")
        seq = self.engine.add_request(ids, p, prompt=text, cache_salt=salt, lora_request=lora)
        sent = 0
        try:
            while not seq.is_finished:
                self.engine.step()
                if len(seq.output_text) > sent:
                    yield seq.output_text[sent:]
                    sent = len(seq.output_text)
        finally:
            self.engine.abort(seq, "abort", "the stream was closed early")

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False, lora_request: LoRARequest | list | None = None) -> list[RequestOutput]:
        """Apply the model's chat template, then generate. One conversation or a list of them (lora_request: as
        generate's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt": self.apply_chat_template(c), "prompt_token_ids": self.chat_token_ids(c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the model at {self.engine.model_path} has no chat template; use generate()")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        text = self.apply_chat_template(messages)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------ facts
    @property
    def stats(self) -> RunStats:
        """Totals of the last generate() call: tokens/s, peak KV bytes, $ per million tokens."""
        return self.engine.stats

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def weight_bytes(self) -> int:
        return self.engine.weight_bytes

    @property
    def dtype(self):
        """The torch dtype of weights and KV cache (float32 on CPU by default)."""
        return self.engine.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies in the cache, all layers: 2 * layers * kv_heads * head_dim * bytes."""
        return self.engine.kv_bytes_per_token

    @property
    def device(self) -> str:
        return self.engine.device_label

    def set_attention_backend(self, backend) -> None:
        """Plug an attention backend into this engine: "torch", "triton" or an object of one of the
        attention protocols (minillm/seams.py), e.g. a lab's. Refused, and nothing changes, when the
        object misses its layout or a method."""
        EngineConfig.from_kwargs(model=self.config.model, **{**self._levers(), "attention_backend": backend})
        self.engine.runner.set_attention_backend(backend)
        self.config.attention_backend = backend

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block no running request holds, as vLLM's. False: this engine has no
        prefix cache (prefix_caching=False, kv_cache=False or paged=False), so there was nothing to forget."""
        if self.engine.block_manager is None or not (self.config.prefix_caching and self.config.paged):
            return False
        self.engine.block_manager.reset_prefix_cache()
        return True

    def _levers(self) -> dict:
        import dataclasses

        return {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config) if f.name != "model"}
