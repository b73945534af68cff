"""The server's prefill levers: chunked prefill on, and a long prompt's chunk at most half the step's budget.

A server without chunked prefill runs a long prompt as one step: every other request, the short ones that
arrived a second later included, waits for the whole prefill (head-of-line blocking). vLLM chunks by default,
and so does the engine (`LLM()`: chunked_prefill on with the KV cache, max_num_batched_tokens 512 on a CPU and
2048 on a GPU, config.py's default_max_num_batched_tokens). The server adds vLLM's long_prefill_token_threshold
at half the budget, so a prompt that arrives during a long prefill is admitted beside its next chunk.
"""

from __future__ import annotations

from ..config import CPU_CHUNK_TOKENS, GPU_CHUNK_TOKENS, default_max_num_batched_tokens

__all__ = ["CPU_CHUNK_TOKENS", "GPU_CHUNK_TOKENS", "default_max_num_batched_tokens", "server_levers"]


def server_levers(engine, chunked_prefill: bool | None = True, max_num_batched_tokens: int | None = None) -> dict:
    """The levers a server sets on `engine` for as long as it serves it: {} leaves the engine as built.

    chunked_prefill None: as the engine was built; True (the server's default): on where the engine has a KV
    cache (a chunk attends to the cached earlier chunks), with long_prefill_token_threshold at half the budget
    unless the engine sets one; False: whole-prompt prefill. A change of chunked_prefill without
    max_num_batched_tokens takes that mode's default budget on the engine's device, as `LLM()` would."""
    cfg = engine.config
    levers = {}
    if chunked_prefill is not None:
        on = bool(chunked_prefill) and cfg.kv_cache
        if on != cfg.chunked_prefill:
            levers["chunked_prefill"] = on
            levers["max_num_batched_tokens"] = default_max_num_batched_tokens(engine.device, on)
    if max_num_batched_tokens is not None:
        levers["max_num_batched_tokens"] = max_num_batched_tokens
    if chunked_prefill and levers.get("chunked_prefill", cfg.chunked_prefill) and not cfg.long_prefill_token_threshold:
        # half the budget: a long prompt leaves the other half of every step to a request that arrives meanwhile
        levers["long_prefill_token_threshold"] = max(1, levers.get("max_num_batched_tokens",
                                                                   cfg.max_num_batched_tokens) // 2)
    return levers
