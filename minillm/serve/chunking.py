"""The server's prefill levers: chunked prefill on, with a token budget per step chosen for the device.

A server without chunked prefill runs a long prompt as one step: every other request, the short ones that
arrived a second later included, waits for the whole prefill (head-of-line blocking). vLLM chunks by default;
so does `minillm serve` (and serve_in_thread), while `LLM()` keeps the engine's own default (off) for the labs.

The budget (`max_num_batched_tokens`) is the largest step the engine runs: smaller chunks let decodes and
short prompts in sooner, but each chunk re-reads the weights and the cached K/V of the chunks before it.
On a CPU a chunk of 512 tokens keeps a long prompt's prefill throughput near whole-prompt prefill (measured
by `python -m minillm.bench.chunking`, docs/PERFORMANCE.md); a GPU takes 2048, as vLLM's
default for an online server on a data-center GPU.
"""

from __future__ import annotations

CPU_CHUNK_TOKENS = 512
GPU_CHUNK_TOKENS = 2048


def default_max_num_batched_tokens(device) -> int:
    """The server's step budget on `device` (a torch.device or its type name)."""
    kind = getattr(device, "type", str(device))
    return CPU_CHUNK_TOKENS if kind == "cpu" else GPU_CHUNK_TOKENS


def server_levers(engine, chunked_prefill: bool | None = True, max_num_batched_tokens: int | None = None) -> dict:
    """The levers a server sets on `engine` for as long as it serves it: {} leaves the engine as built.

    chunked_prefill None: as the engine was built; True (the server's default): on where the engine has a KV
    cache (a chunk attends to the cached earlier chunks). max_num_batched_tokens None: the device's default
    when chunking, else as built."""
    levers = {}
    if chunked_prefill is not None and not (chunked_prefill and not engine.config.kv_cache):
        levers["chunked_prefill"] = bool(chunked_prefill)
    if max_num_batched_tokens is not None:
        levers["max_num_batched_tokens"] = max_num_batched_tokens
    elif levers.get("chunked_prefill") and not engine.config.chunked_prefill:
        levers["max_num_batched_tokens"] = default_max_num_batched_tokens(engine.device)
    if levers.get("chunked_prefill") and not engine.config.long_prefill_token_threshold:
        # half the budget: a long prompt leaves the other half of every step to a request that arrives meanwhile
        levers["long_prefill_token_threshold"] = max(1, levers.get("max_num_batched_tokens",
                                                                   engine.config.max_num_batched_tokens) // 2)
    return levers
