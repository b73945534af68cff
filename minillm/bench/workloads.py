"""Workloads: lists of (prompt, SamplingParams) built from text shipped with minillm."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from ..sampling import SamplingParams


@dataclass
class Request:
    prompt: str | dict
    params: SamplingParams


def shipped_prompts() -> list[str]:
    text = resources.files("minillm").joinpath("data/prompts.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def chat_workload(num_requests: int = 8, max_tokens: int = 64, tokenizer=None) -> list[Request]:
    """Questions from data/prompts.txt, wrapped in the chat template when a tokenizer is given.

    ignore_eos keeps every request at exactly `max_tokens`, so runs are comparable.
    """
    prompts = shipped_prompts()
    out = []
    for i in range(num_requests):
        text = prompts[i % len(prompts)]
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
            prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        else:
            prompt = text
        out.append(Request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return out


def fixed_length_workload(num_requests: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int = 0) -> list[Request]:
    """Synthetic token ids of exact lengths, for sweeps where only the shape matters."""
    import random

    rng = random.Random(seed)
    return [
        Request({"prompt_token_ids": [rng.randrange(100, vocab_size) for _ in range(prompt_len)]},
                SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for _ in range(num_requests)
    ]


def shipped_corpus() -> str:
    """data/corpus.txt: original prose shipped with minillm (workloads, perplexity, calibration)."""
    return resources.files("minillm").joinpath("data/corpus.txt").read_text()


def mixed_workload(tokenizer, num_requests: int = 256, min_len: int = 100, max_len: int = 1024,
                   scale: float = 1.0, seed: int = 0) -> list[Request]:
    """nano-vllm's benchmark shape on real text: prompt and output lengths each uniform in
    [min_len, max_len] (times `scale`, so a CPU can run it), prompts cut from data/corpus.txt
    at random places, outputs held to their length with ignore_eos."""
    import random

    if not 0 < scale <= 1:
        raise ValueError(f"scale={scale} must be in (0, 1]")
    lo, hi = max(1, round(min_len * scale)), max(1, round(max_len * scale))
    if lo > hi:
        raise ValueError(f"min_len={min_len} > max_len={max_len}")
    ids = tokenizer.encode(shipped_corpus(), add_special_tokens=False)
    if len(ids) < hi + 1:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than the longest prompt ({hi})")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in, n_out = rng.randint(lo, hi), rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - n_in)
        out.append(Request({"prompt_token_ids": ids[start:start + n_in]},
                           SamplingParams(max_tokens=n_out, ignore_eos=True)))
    return out
