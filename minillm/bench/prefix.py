"""Shared-prefix benchmark: ten questions about one long document, prefix caching off vs on.

Each request is the same document (the first `prefix_tokens` tokens of data/corpus.txt) followed
by one question from data/prompts.txt. Requests go one after another, so a request's TTFT is the
time to read its prompt: without prefix caching every question re-reads the whole document; with
it, the first question reads it once and later ones read only their question (the document's full
blocks come from the cache). Greedy outputs must be identical either way.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from .workloads import Request, shipped_corpus, shipped_prompts


def shared_prefix_workload(tokenizer, prefix_tokens: int = 2000, num_questions: int = 10,
                           max_tokens: int = 16) -> list[Request]:
    """`num_questions` requests: the same `prefix_tokens`-token document, then a different question.

    Token ids, so the document is exactly the same tokens in every prompt (tokenizing the joined
    text could merge the document's last token with the question's first)."""
    if prefix_tokens < 1 or num_questions < 1:
        raise ValueError(f"prefix_tokens={prefix_tokens} and num_questions={num_questions} must be >= 1")
    doc = tokenizer.encode(shipped_corpus(), add_special_tokens=False)
    if len(doc) < prefix_tokens:
        raise ValueError(f"prefix_tokens={prefix_tokens}: the corpus has only {len(doc)} tokens")
    doc = doc[:prefix_tokens]
    questions = shipped_prompts()
    out = []
    for i in range(num_questions):
        q = questions[i % len(questions)]
        tail = tokenizer.encode(f"\n\nQuestion {i + 1}: {q}\nAnswer:", add_special_tokens=False)
        out.append(Request({"prompt_token_ids": doc + tail}, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return out


@dataclass
class PrefixRun:
    label: str
    ttft_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    prompt_tokens: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(self.ttft_s)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _run(llm, requests: list[Request], label: str) -> PrefixRun:
    run = PrefixRun(label)
    for req in requests:   # one after another: TTFT is the reading time, no queueing
        out = llm.generate(req.prompt, req.params)[0]
        run.ttft_s.append(out.metrics.ttft_s)
        run.cached_tokens.append(out.metrics.num_cached_tokens)
        run.outputs.append(out.outputs[0].token_ids)
        run.prompt_tokens += len(out.prompt_token_ids)
        run.queries += llm.stats.prefix_cache_queries
        run.hits += llm.stats.prefix_cache_hits
    return run


def compare_prefix_caching(llm, requests: list[Request]) -> dict:
    """Run `requests` on `llm` with prefix_caching off, then on (same weights, fresh KV pools)."""
    off = llm.with_levers(prefix_caching=False) if llm.config.prefix_caching else llm
    on = llm.with_levers(prefix_caching=True)
    warm = Request({"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=2, ignore_eos=True))
    for engine in (off, on):   # first-call overheads (allocator, lazy imports) out of the timings
        engine.generate(warm.prompt, warm.params)
    on.engine.block_manager.reset_prefix_cache()
    r_off = _run(off, requests, "prefix_caching=False")
    r_on = _run(on, requests, "prefix_caching=True")
    identical = sum(a == b for a, b in zip(r_off.outputs, r_on.outputs))
    return {"device": llm.device, "off": r_off, "on": r_on, "ratio": r_on.mean_ttft_s / r_off.mean_ttft_s,
            "identical": identical, "num_requests": len(requests),
            "block_size": on.config.block_size}


def format_prefix(result: dict, prefix_tokens: int) -> str:
    off, on = result["off"], result["on"]
    n = result["num_requests"]
    lines = [
        f"shared-prefix workload on {result['device']}: {n} questions after one {prefix_tokens}-token document, "
        f"sent one after another ({off.prompt_tokens} prompt tokens in all, block_size={result['block_size']})",
        f"{'':22}{'mean TTFT':>11}{'first':>9}{'later mean':>12}{'cached tokens':>15}",
    ]
    for r in (off, on):
        later = statistics.fmean(r.ttft_s[1:]) if len(r.ttft_s) > 1 else float("nan")
        lines.append(f"{r.label:22}{r.mean_ttft_s:>10.3f}s{r.ttft_s[0]:>8.3f}s{later:>11.3f}s{sum(r.cached_tokens):>15}")
    ok = result["ratio"] <= 0.2
    lines += [
        f"mean TTFT on / off: {result['ratio']:.3f} ({1 / result['ratio']:.1f}x faster); "
        f"acceptance <= 0.2: {'PASS' if ok else 'FAIL'}",
        f"prefix cache hit rate: {on.hit_rate:.1%} ({on.hits} of {on.queries} prompt tokens served from the cache)",
        f"greedy outputs identical: {result['identical']}/{n}",
    ]
    return "\n".join(lines)
