"""minillm vs transformers on the same prompts, one request at a time, in one run.

Decode tokens/s is measured the same way for both: time a request that makes N tokens and
one that makes 1 token (prefill + first token); decode rate = (N - 1) / (t_N - t_1).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..hardware import measure_memory_bandwidth
from ..sampling import SamplingParams


@dataclass
class CompareRow:
    engine: str
    decode_tok_per_s: float      # median over prompts
    ttft_ms: float               # median time to first token
    tokens_match: bool | None    # greedy tokens equal to transformers'


def _median_rate(times_1: list[float], times_n: list[float], n: int) -> float:
    return statistics.median((n - 1) / max(tn - t1, 1e-9) for t1, tn in zip(times_1, times_n))


def compare_with_transformers(llm, prompt_ids: list[list[int]], new_tokens: int = 64, progress: bool = True) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=llm.engine.dtype).to(llm.engine.device)
    hf.eval()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    many = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ours_1, ours_n, hf_1, hf_n, match = [], [], [], [], []
    llm.generate([{"prompt_token_ids": prompt_ids[0]}], one)  # warm-up both
    with torch.inference_mode():
        hf.generate(torch.tensor([prompt_ids[0]]), max_new_tokens=2, do_sample=False)
    for ids in tqdm(prompt_ids, desc="minillm vs transformers", disable=not progress):
        prompt = {"prompt_token_ids": ids}
        t0 = time.perf_counter(); llm.generate([prompt], one); ours_1.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); out = llm.generate([prompt], many); ours_n.append(time.perf_counter() - t0)
        x = torch.tensor([ids], device=llm.engine.device)
        kw = dict(do_sample=False, pad_token_id=hf.config.eos_token_id)
        with torch.inference_mode():
            t0 = time.perf_counter(); hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw); hf_1.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref = hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
            hf_n.append(time.perf_counter() - t0)
        # transformers' min_new_tokens forbids EOS while our ignore_eos lets it through and
        # goes on, so the two runs are the same computation only up to the first EOS.
        mine, theirs = out[0].outputs[0].token_ids, ref[0, len(ids):].tolist()
        eos = [i for i, t in enumerate(mine) if t in llm.engine.eos_token_ids]
        cut = eos[0] if eos else len(mine)
        match.append(mine[:cut] == theirs[:cut])
    ours = CompareRow("minillm", _median_rate(ours_1, ours_n, new_tokens), 1e3 * statistics.median(ours_1), all(match))
    theirs = CompareRow("transformers", _median_rate(hf_1, hf_n, new_tokens), 1e3 * statistics.median(hf_1), None)
    bandwidth = measure_memory_bandwidth()
    bound = bandwidth / llm.weight_bytes
    return {
        "device": llm.device,
        "prompts": len(prompt_ids),
        "new_tokens": new_tokens,
        "rows": [ours, theirs],
        "speedup": ours.decode_tok_per_s / theirs.decode_tok_per_s,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bound_tok_per_s": bound,
        "tokens_match": sum(match),
    }


def format_compare(result: dict) -> str:
    lines = [
        f"single-request decode, {result['prompts']} prompts x {result['new_tokens']} new tokens, {result['device']}",
        f"{'engine':<14}{'decode tok/s':>14}{'TTFT ms':>10}{'% of bound':>12}",
    ]
    for row in result["rows"]:
        lines.append(f"{row.engine:<14}{row.decode_tok_per_s:>14.1f}{row.ttft_ms:>10.1f}"
                     f"{100 * row.decode_tok_per_s / result['bound_tok_per_s']:>11.0f}%")
    lines.append(f"bandwidth bound (weights once per token at {result['bandwidth_gb_s']:.1f} GB/s measured read): "
                 f"{result['bound_tok_per_s']:.1f} tok/s")
    lines.append(f"minillm / transformers: {result['speedup']:.2f}x; greedy tokens identical on "
                 f"{result['tokens_match']}/{result['prompts']} prompts (up to the first EOS)")
    return "\n".join(lines)
