"""Speculative decoding benchmark: batch-1 decode speed with and without speculation, on a
workload where the answer repeats its prompt (rewriting and editing a given paragraph), the
case prompt lookup is built for.

Each request is a chat prompt asking the model to reproduce or lightly edit a paragraph of
data/corpus.txt; requests run one after another (batch 1). Decode tokens/s per request is
(output tokens - 1) / (last token time - first token time), as for single-request decode
elsewhere; the ratio is taken over the summed decode time of all requests. Greedy outputs with
speculation must equal those without, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import SamplingParams
from .workloads import Request, shipped_corpus

INSTRUCTIONS = (
    "Repeat the following paragraph exactly, word for word:",
    "Rewrite the following paragraph, keeping every sentence but replacing the word 'the' with 'THE':",
    "Copy the following text, then stop:",
    "Fix any spelling mistakes in the following paragraph and return the whole paragraph:",
)


def repeat_workload(llm, num_requests: int = 4, max_tokens: int = 96, min_words: int = 60) -> list[Request]:
    """Chat prompts that ask for a paragraph of data/corpus.txt back (repeated or lightly edited)."""
    if num_requests < 1 or max_tokens < 2:
        raise ValueError(f"num_requests={num_requests} must be >= 1 and max_tokens={max_tokens} >= 2")
    paragraphs = [p.strip() for p in shipped_corpus().split("\n\n") if len(p.split()) >= min_words]
    out = []
    for i in range(num_requests):
        text = paragraphs[i % len(paragraphs)]
        ids = llm.chat_token_ids([{"role": "user", "content": f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{text}"}])
        out.append(Request({"prompt_token_ids": ids}, SamplingParams(max_tokens=max_tokens)))
    return out


@dataclass
class SpecRun:
    label: str
    decode_s: float = 0.0
    decode_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    passes: int = 0
    emitted: int = 0

    @property
    def decode_tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / self.passes if self.passes else float("nan")


def _run(llm, requests: list[Request], label: str, progress) -> SpecRun:
    run = SpecRun(label)
    for req in requests:   # one after another: batch 1
        out = llm.generate(req.prompt, req.params, use_tqdm=False)[0]
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        if n > 1 and m.tpot_s is not None:
            run.decode_s += m.tpot_s * (n - 1)
            run.decode_tokens += n - 1
        run.outputs.append(out.outputs[0].token_ids)
        spec = llm.stats.spec
        run.proposed += spec.num_proposed
        run.accepted += spec.num_accepted
        run.passes += spec.num_passes
        run.emitted += spec.num_emitted
        progress.update(1)
    return run


def compare_speculative(llm, requests: list[Request], ks: tuple[int, ...] = (2, 4, 6),
                        others: dict[str, dict] | None = None) -> dict:
    """Speculation off, then speculative='ngram' with each k in `ks` (same weights), batch 1;
    `others` adds settings by label, e.g. {"draft k=4": dict(speculative="draft", draft_model=...)}."""
    from tqdm.auto import tqdm

    off = dict(speculative=None, draft_model=None)
    engines = [("off", llm.with_levers(**off) if llm.config.speculative else llm)]
    engines += [(f"ngram k={k}", llm.with_levers(**{**off, "speculative": "ngram", "num_speculative_tokens": k}))
                for k in ks]
    engines += [(label, llm.with_levers(**{**off, **levers})) for label, levers in (others or {}).items()]
    warm = Request({"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=4, ignore_eos=True))
    for _, engine in engines:   # first-call overheads out of the timings
        engine.generate(warm.prompt, warm.params, use_tqdm=False)
    runs = []
    with tqdm(total=len(engines) * len(requests), desc="speculative decoding runs") as progress:
        for label, engine in engines:
            runs.append(_run(engine, requests, label, progress))
    base = runs[0]
    rows = []
    for r in runs:
        rows.append({"label": r.label, "decode_tok_per_s": r.decode_tok_per_s,
                     "speedup": r.decode_tok_per_s / base.decode_tok_per_s if base.decode_tok_per_s else float("nan"),
                     "acceptance_rate": r.acceptance_rate, "tokens_per_pass": r.tokens_per_pass,
                     "identical": sum(a == b for a, b in zip(r.outputs, base.outputs)), "run": r})
    best = max(rows[1:], key=lambda row: row["speedup"]) if len(rows) > 1 else rows[0]
    return {"device": llm.device, "rows": rows, "best": best, "num_requests": len(requests),
            "output_tokens": sum(len(o) for o in base.outputs)}


def format_speculative(result: dict) -> str:
    n = result["num_requests"]
    lines = [f"speculative decoding, batch 1, on {result['device']}: {n} requests that repeat or edit a paragraph "
             f"of data/corpus.txt ({result['output_tokens']} greedy output tokens without speculation)",
             f"{'setting':14}{'decode tok/s':>14}{'speed-up':>10}{'acceptance':>12}{'tokens/pass':>13}{'identical':>11}"]
    for row in result["rows"]:
        acc = "" if row["label"] == "off" else f"{row['acceptance_rate']:.1%}"
        tpp = "1.00" if row["label"] == "off" else f"{row['tokens_per_pass']:.2f}"
        lines.append(f"{row['label']:14}{row['decode_tok_per_s']:>14.1f}{row['speedup']:>9.2f}x{acc:>12}{tpp:>13}"
                     f"{row['identical']:>8}/{n}")
    best = result["best"]
    ok = best["speedup"] >= 1.5
    lines.append(f"best: {best['label']} at {best['speedup']:.2f}x decode tokens/s, acceptance rate "
                 f"{best['acceptance_rate']:.1%}; acceptance >= 1.5x: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)
