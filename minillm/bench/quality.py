"""Quality harness: what a setting (quantization, dtype, ...) costs in quality, beside what it saves.

For every setting, in one run and against the first (reference) setting:

- perplexity on data/corpus.txt (original prose shipped with minillm): the text is cut into
  windows of `window` tokens every `stride` tokens; each window's full-sequence logits (fp32)
  score the tokens no earlier window scored, so every token after the first is scored once,
  with at least `window - stride` tokens of context (transformers' strided recipe);
- corpus top-1 agreement: the share of those scored positions where the setting's most likely
  next token equals the reference's (a finer signal than perplexity alone);
- top-1 next-token agreement on 24 chat-templated prompts from data/prompts.txt, through the
  engine itself (greedy, one token): x/24, the number the course's sources quote;
- greedy generations through the engine (its KV cache included, so kv_dtype shows here and in
  the next-token agreement, not in perplexity): "gen same" x/24, the prompts whose `gen_same_tokens`
  (32) greedy tokens all equal the reference's, and "same for", how many tokens they stay equal
  on average (one early divergence sets a prompt apart in the first count but not in this one);
- weight bytes, KV bytes per token, and decode tokens/s at batch 1, measured side by side
  (settings interleaved, median of repeats);
- greedy generations side by side for a few prompts.

The scoring path runs the engine's own model on one sequence at a time, without the KV cache
(the metadata the model runner builds for kv_cache=False), with torch attention.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..layers.attention import AttentionMetadata
from ..sampling import SamplingParams
from .workloads import chat_workload, shipped_corpus

# Named settings for the command line: label -> levers.
KNOWN_SETTINGS: dict[str, dict] = {
    "baseline": {},
    "bf16": {"dtype": "bfloat16"},
    "fp16": {"dtype": "float16"},
    "int8": {"weight_dtype": "int8"},                       # head int8 too
    # int4 settings: decoder matrices int4, lm_head int8 per-channel (models/quantize.py head_dtype_for;
    # the table's "head" column says what each row's head is).
    "int4": {"weight_dtype": "int4"},                       # group 128, round-to-nearest
    "int4-awq": {"weight_dtype": "int4", "weight_calibration": "awq"},  # group 128, AWQ scales + clipping
    "int4-gptq": {"weight_dtype": "int4", "weight_calibration": "gptq"},  # group 128, AWQ scales + GPTQ
    "int4-gptq-tuned": {"weight_dtype": "int4", "weight_calibration": "gptq-tuned"},  # gptq, then tuned end to end
    "int4-autoround": {"weight_dtype": "int4", "weight_calibration": "autoround"},  # group 128, AWQ + learned rounding
    "int4-g64": {"weight_dtype": "int4", "weight_group_size": 64},
    "int4-g32": {"weight_dtype": "int4", "weight_group_size": 32},  # aligned to the GGUF's Q4_1 blocks
    "int4-head4": {"weight_dtype": "int4", "weight_head_dtype": "int4"},  # group 128 RTN, the head int4 g32 too
    "int4-gptq-head4": {"weight_dtype": "int4", "weight_calibration": "gptq", "weight_head_dtype": "int4"},
    "int4-gptq-tuned-head4": {"weight_dtype": "int4", "weight_calibration": "gptq-tuned", "weight_head_dtype": "int4"},
    "int4-autoround-head4": {"weight_dtype": "int4", "weight_calibration": "autoround", "weight_head_dtype": "int4"},
    "fp8": {"weight_dtype": "fp8"},                         # head fp8 too
    # KV cache settings (weights untouched): one byte per K/V value plus an fp32 scale per token and head.
    "kv-int8": {"kv_dtype": "int8"},
    "kv-fp8": {"kv_dtype": "fp8"},
}
DEFAULT_SETTINGS = ("baseline", "bf16", "int8", "int4")
NOT_AVAILABLE = "not available yet"


# ------------------------------------------------------------------ full-sequence logits
@torch.inference_mode()
def sequence_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] in fp32 for every position of one sequence.

    Runs the engine's model through its runner (its ops and parts) with kv_cache-free metadata (one
    sequence, nothing cached), the way ModelRunner.prepare lays out a kv_cache=False step; a block-table
    backend (Triton or CPU kernels, which read the KV pool) attends through torch for such a pass
    (layers/attention.py).
    """
    engine = llm.engine
    n = len(token_ids)
    ids = torch.tensor(token_ids, dtype=torch.long, device=engine.device)
    positions = torch.arange(n, dtype=torch.long, device=engine.device)
    meta = AttentionMetadata(query_lens=[n], num_cached=[0], slot_mapping=None, use_cache=False)
    return engine.runner.compute_logits(engine.runner.forward(ids, positions, meta)).float()


# ------------------------------------------------------------------ perplexity
def corpus_token_ids(tokenizer, text: str | None = None) -> list[int]:
    """data/corpus.txt (or `text`) as token ids, no special tokens."""
    return tokenizer.encode(shipped_corpus() if text is None else text, add_special_tokens=False)


def windows(num_tokens: int, window: int = 512, stride: int = 256, max_windows: int | None = None
            ) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored): window [begin, end) scores targets at positions first_scored..end-1.

    With stride < window, every position 1..num_tokens-1 is scored exactly once (all windows,
    no max_windows), each with at least window - stride tokens of context. With stride == window
    (non-overlapping windows) each window's first token has no context and is not scored.
    """
    if not 0 < stride <= window:
        raise ValueError(f"stride={stride} must be in (0, window={window}]")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    out, prev_end = [], 1
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        if end <= prev_end:
            break
        out.append((begin, end, max(prev_end, begin + 1)))  # a window cannot score its own first token
        prev_end = end
        if end == num_tokens or (max_windows is not None and len(out) >= max_windows):
            break
    return out


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_tokens: int                 # scored tokens
    num_windows: int
    argmax: list[torch.Tensor] = field(default_factory=list, repr=False)  # per window: top-1 at scored positions

    def agreement_with(self, ref: "PerplexityResult") -> float:
        """Share of scored positions whose top-1 token equals the reference's."""
        same = sum(int((a == b).sum()) for a, b in zip(self.argmax, ref.argmax))
        total = sum(a.numel() for a in ref.argmax)
        return same / total if total else float("nan")


def perplexity(llm=None, token_ids: list[int] | None = None, window: int = 512, stride: int = 256,
               max_windows: int | None = None, logits_fn: Callable[[list[int]], torch.Tensor] | None = None,
               progress: bool = True, desc: str = "perplexity") -> PerplexityResult:
    """exp(mean NLL) over the corpus windows. `logits_fn(ids) -> [len(ids), vocab]` scores instead
    of `llm` (e.g. transformers, for checking); token_ids default to data/corpus.txt."""
    from tqdm.auto import tqdm

    if logits_fn is None:
        if llm is None:
            raise ValueError("give an LLM or a logits_fn")
        logits_fn = lambda ids: sequence_logits(llm, ids)  # noqa: E731
    if token_ids is None:
        token_ids = corpus_token_ids(llm.tokenizer)
    spans = windows(len(token_ids), window, stride, max_windows)
    total_nll, count, argmax = 0.0, 0, []
    for begin, end, first in tqdm(spans, desc=desc, unit="window", disable=not progress, leave=False):
        logits = logits_fn(token_ids[begin:end]).float()
        # logits row j predicts token begin + j + 1: rows first-1-begin .. end-2-begin score first..end-1.
        rows = logits[first - 1 - begin:end - 1 - begin]
        targets = torch.tensor(token_ids[first:end], dtype=torch.long, device=rows.device)
        nll = torch.nn.functional.cross_entropy(rows, targets, reduction="sum")
        total_nll += float(nll.double())
        count += end - first
        argmax.append(rows.argmax(-1).cpu())
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, count, len(spans), argmax)


# ------------------------------------------------------------------ prompts, agreement, speed
def agreement_prompts(tokenizer, num_prompts: int = 24) -> list[dict]:
    """data/prompts.txt, chat-templated, as {'prompt', 'prompt_token_ids'} dicts."""
    return [r.prompt if isinstance(r.prompt, dict) else {"prompt_token_ids": tokenizer.encode(r.prompt)}
            for r in chat_workload(num_prompts, 1, tokenizer)]


def greedy_tokens(llm, prompts: list[dict], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share before the first that differs."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def decode_rate_once(llm, prompt: dict, new_tokens: int) -> float:
    """Batch-1 decode tokens/s of one request: 1 / its mean time per output token after the first."""
    out = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))[0]
    return 1.0 / out.metrics.tpot_s


# ------------------------------------------------------------------ evaluate
@dataclass
class QualityRow:
    label: str
    levers: dict
    status: str = "ok"              # "ok" or NOT_AVAILABLE
    message: str = ""               # why a setting is not available
    weight_bytes: int = 0
    head: str = ""                  # how the lm_head is stored: its weight dtype, or the model dtype
    kv_bytes_per_token: int = 0
    perplexity: float = float("nan")
    mean_nll: float = float("nan")
    corpus_top1: float = float("nan")   # share of corpus positions with the reference's top-1 token
    top1_agree: int = 0             # prompts whose next token equals the reference's
    top1_of: int = 0
    gen_same: int = 0               # prompts whose gen_same_tokens greedy tokens equal the reference's
    gen_of: int = 0
    gen_prefix: float = float("nan")  # greedy tokens equal to the reference's before the first that differs, mean
    decode_tok_per_s: float = float("nan")

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def build_settings(settings: dict[str, Any], base=None, model: str | None = None, **base_levers):
    """label -> levers dict (or a ready LLM) -> label -> LLM, or the NotImplementedError it raised.

    A setting with no levers is the base engine itself; the others come from
    base.with_levers(**levers) (weights shared where device and dtype allow)."""
    built: dict[str, Any] = {}
    for label, levers in settings.items():
        if not isinstance(levers, dict):  # an LLM built by the caller
            built[label] = levers
            continue
        if base is None:
            from ..llm import LLM

            base = LLM(model, **base_levers)
        try:
            built[label] = base if not levers else base.with_levers(**levers)
        except NotImplementedError as exc:
            built[label] = exc
    return built


def evaluate(settings: dict[str, Any], base=None, model: str | None = None, window: int = 512, stride: int = 256,
             max_windows: int | None = None, num_prompts: int = 24, decode_tokens: int = 32, decode_repeats: int = 3,
             num_generations: int = 3, generation_tokens: int = 24, progress: bool = True,
             gen_same_tokens: int = 32, **base_levers) -> dict:
    """Quality, memory and speed of every setting against the first one (the reference).

    settings: label -> levers for `base.with_levers(**levers)` (or an LLM). A setting the engine
    refuses with NotImplementedError becomes a row with status "not available yet".
    decode_tokens=0 skips the speed measurement; gen_same_tokens=0 skips the greedy-generation
    agreement (num_prompts generations of gen_same_tokens tokens through the engine). Returns {'rows', 'generations', ...}.
    """
    if not settings:
        raise ValueError("give at least one setting")
    built = build_settings(settings, base=base, model=model, **base_levers)
    rows: list[QualityRow] = []
    live: dict[str, Any] = {}
    for label, llm in built.items():
        levers = settings[label] if isinstance(settings[label], dict) else {}
        if isinstance(llm, Exception):
            rows.append(QualityRow(label, levers, status=NOT_AVAILABLE, message=str(llm)))
            continue
        live[label] = llm
        qhead = getattr(llm.engine.model, "quantized_head", None)
        head = qhead.weight_dtype if qhead is not None else str(llm.engine.dtype).replace("torch.", "")
        rows.append(QualityRow(label, levers, weight_bytes=llm.weight_bytes, head=head,
                               kv_bytes_per_token=llm.kv_bytes_per_token if llm.config.kv_cache else 0))
    if not live:
        raise ValueError("no setting could be built: " + "; ".join(r.message for r in rows))
    by_label = {r.label: r for r in rows}
    ref_label = next(iter(live))
    ref_llm = live[ref_label]
    tokenizer = ref_llm.tokenizer
    corpus = corpus_token_ids(tokenizer)
    prompts = agreement_prompts(tokenizer, num_prompts)
    gen_prompts = prompts[:num_generations]

    ppl: dict[str, PerplexityResult] = {}
    first_tokens: dict[str, list[int]] = {}
    generations: dict[str, list[list[int]]] = {}
    long_tokens: dict[str, list[list[int]]] = {}
    for label, llm in live.items():
        ppl[label] = perplexity(llm, corpus, window, stride, max_windows, progress=progress,
                                desc=f"perplexity {label}")
        first_tokens[label] = [t[0] for t in greedy_tokens(llm, prompts, 1)]
        if gen_prompts:
            generations[label] = greedy_tokens(llm, gen_prompts, generation_tokens)
        if gen_same_tokens > 0:
            long_tokens[label] = greedy_tokens(llm, prompts, gen_same_tokens)
    for label in live:
        row = by_label[label]
        row.perplexity, row.mean_nll = ppl[label].perplexity, ppl[label].mean_nll
        row.corpus_top1 = ppl[label].agreement_with(ppl[ref_label])
        row.top1_agree = sum(a == b for a, b in zip(first_tokens[label], first_tokens[ref_label]))
        row.top1_of = len(prompts)
        if gen_same_tokens > 0:
            pairs = list(zip(long_tokens[label], long_tokens[ref_label]))
            row.gen_same = sum(a == b for a, b in pairs)
            row.gen_of = len(prompts)
            row.gen_prefix = statistics.mean(common_prefix(a, b) for a, b in pairs)

    if decode_tokens > 1:
        from tqdm.auto import tqdm

        speed_prompt = prompts[0]
        for llm in live.values():  # warm-up: first calls pay for allocations
            llm.generate([speed_prompt], SamplingParams(max_tokens=2, ignore_eos=True))
        rates: dict[str, list[float]] = {label: [] for label in live}
        steps = [(r, label) for r in range(decode_repeats) for label in live]  # interleaved: side by side
        for _, label in tqdm(steps, desc="decode tok/s (batch 1)", disable=not progress, leave=False):
            rates[label].append(decode_rate_once(live[label], speed_prompt, decode_tokens))
        for label in live:
            by_label[label].decode_tok_per_s = statistics.median(rates[label])

    texts = {}
    for label, outs in generations.items():
        texts[label] = [tokenizer.decode(t, skip_special_tokens=True) if tokenizer is not None else str(t)
                        for t in outs]
    spans = windows(len(corpus), window, stride, max_windows)
    return {
        "device": ref_llm.device,
        "reference": ref_label,
        "corpus_tokens": len(corpus),
        "scored_tokens": ppl[ref_label].num_tokens,
        "windows": len(spans),
        "window": window,
        "stride": stride,
        "num_prompts": len(prompts),
        "decode_tokens": decode_tokens,
        "gen_same_tokens": gen_same_tokens,
        "rows": rows,
        "generation_prompts": [p.get("prompt", "") for p in gen_prompts],
        "generations": texts,
    }


# ------------------------------------------------------------------ report
def _cell(value, fmt: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return format(value, fmt)


def format_quality(result: dict, generations: bool = True, width: int = 100) -> str:
    rows: list[QualityRow] = result["rows"]
    ref = next(r for r in rows if r.label == result["reference"])
    lines = [
        f"device: {result['device']}; reference: {ref.label}",
        f"perplexity on data/corpus.txt: {result['scored_tokens']} of {result['corpus_tokens']} tokens scored in "
        f"{result['windows']} windows of {result['window']} (stride {result['stride']}); top-1 agreement on "
        f"{result['num_prompts']} chat prompts (next token) and on every scored corpus position",
    ]
    gen = bool(result.get("gen_same_tokens"))
    if gen:
        lines.append(f"gen same: prompts whose {result['gen_same_tokens']} greedy tokens through the engine (KV cache "
                     "included) all equal the reference's; same for: the greedy tokens equal to the reference's "
                     "before the first that differs, mean over the prompts")
    head = (f"{'setting':<18}{'head':>9}{'weights MB':>11}{'KV B/tok':>10}{'perplexity':>12}{'vs ref':>9}"
            f"{'top-1':>8}{'corpus top-1':>14}" + (f"{'gen same':>10}{'same for':>10}" if gen else "")
            + f"{'decode tok/s':>14}")
    lines += [head, "-" * len(head)]
    for r in rows:
        if not r.ok:
            lines.append(f"{r.label:<18}  {NOT_AVAILABLE}: {r.message.split(';')[0]}")
            continue
        delta = 100 * (r.perplexity / ref.perplexity - 1)
        lines.append(
            f"{r.label:<18}{r.head:>9}{r.weight_bytes / 1e6:>11.1f}{r.kv_bytes_per_token:>10d}{_cell(r.perplexity, '.3f'):>12}"
            f"{delta:>+8.2f}%{f'{r.top1_agree}/{r.top1_of}':>8}{_cell(100 * r.corpus_top1, '.1f') + '%':>14}"
            + (f"{f'{r.gen_same}/{r.gen_of}':>10}{_cell(r.gen_prefix, '.1f'):>10}" if gen else "")
            + f"{_cell(r.decode_tok_per_s, '.1f'):>14}")
    if generations and result["generations"]:
        lines.append("")
        lines.append(f"greedy generations side by side (first tokens, ignore_eos):")
        for i, prompt in enumerate(result["generation_prompts"]):
            question = prompt.split("user\n")[-1].split("<|im_end|>")[0].strip() if prompt else f"prompt {i}"
            lines.append(f"[{i + 1}] {question}")
            for label, texts in result["generations"].items():
                text = " ".join(texts[i].split())
                lines.append(f"    {label:<12} {text[:width]}")
    return "\n".join(lines)


def result_to_json(result: dict) -> dict:
    return {**result, "rows": [{**r.__dict__, "ok": r.ok} for r in result["rows"]]}
