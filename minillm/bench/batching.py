"""Static vs continuous batching, and paged vs contiguous KV memory, on one workload in one run.

Three ways to serve the same requests with batches of up to B sequences:
- transformers `generate` with static padded batches: B requests left-padded to one length,
  decoded together until the longest output is done (finished rows keep computing);
- minillm static: the batch is held until its longest member ends, but finished rows stop;
- minillm continuous: every step, finished requests leave and waiting ones join.

Throughput counts only the tokens each request asked for. Then, in one fixed KV budget,
contiguous reservations (max_model_len per request) against paged blocks: how many
sequences run at once, and how much of the reserved memory holds real tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..serve.client import percentile
from .workloads import Request


@dataclass
class BatchingRow:
    label: str
    output_tokens: int          # tokens the requests asked for (padding and overrun excluded)
    wall_s: float
    ttft_p50_s: float = float("nan")
    mean_batch: float = float("nan")   # mean sequences per decode step
    peak_running: int = 0
    kv_utilization: float = float("nan")
    preemptions: int = 0
    same_tokens: str = ""

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def _engine_row(llm, requests: list[Request], label: str) -> tuple[BatchingRow, list[list[int]]]:
    outs = llm.generate([r.prompt for r in requests], [r.params for r in requests], use_tqdm=False)
    st = llm.stats
    decode = [s.num_seqs for s in st.steps if s.kind == "decode"]
    row = BatchingRow(
        label=label,
        output_tokens=st.num_output_tokens,
        wall_s=st.wall_s,
        ttft_p50_s=percentile([o.metrics.ttft_s for o in outs if o.metrics.ttft_s is not None], 50),
        mean_batch=sum(decode) / len(decode) if decode else float("nan"),
        peak_running=st.peak_running,
        kv_utilization=st.kv_utilization,
        preemptions=st.num_preemptions,
    )
    return row, [o.outputs[0].token_ids for o in outs]


def load_transformers(llm):
    """The same checkpoint in transformers, same dtype and device (for side-by-side runs)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=llm.engine.dtype).to(llm.engine.device)
    return hf.eval()


@torch.inference_mode()
def transformers_static(hf, requests: list[Request], batch_size: int, pad_token_id: int,
                        progress: bool = True) -> tuple[BatchingRow, list[list[int]]]:
    """transformers `generate` over static, left-padded batches of `batch_size` in arrival order."""
    from tqdm.auto import tqdm

    device = next(hf.parameters()).device
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    for batch in tqdm(batches, desc="transformers static batches", disable=not progress):
        prompts = [r.prompt["prompt_token_ids"] for r in batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(r.params.max_tokens for r in batch)   # every row runs until the longest is done
        out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=pad_token_id)
        tokens.extend(out[row, width:width + r.params.max_tokens].tolist() for row, r in enumerate(batch))
    wall = time.perf_counter() - t0
    useful = sum(r.params.max_tokens for r in requests)
    return BatchingRow(f"transformers static B={batch_size}", useful, wall), tokens


def compare_batching(llm, requests: list[Request], batch_size: int, with_transformers: bool = True,
                     reservations: int = 4, progress: bool = True) -> dict:
    """Run every setting on `requests`; returns rows and the ratios the course quotes.

    The memory comparison gives both modes the KV memory for `reservations` requests of
    max_model_len = the longest request the workload holds (its longest prompt + longest output).
    """
    from tqdm.auto import tqdm

    longest = max(len(r.prompt["prompt_token_ids"]) for r in requests) + max(r.params.max_tokens for r in requests)
    block = llm.config.block_size
    max_model_len = -(-longest // block) * block
    budget = reservations * max_model_len * llm.kv_bytes_per_token
    settings = [
        ("minillm static", dict(batching="static", max_num_seqs=batch_size)),
        ("minillm continuous", dict(batching="continuous", max_num_seqs=batch_size)),
        ("contiguous, fixed KV", dict(paged=False, max_model_len=max_model_len, kv_cache_bytes=budget,
                                      max_num_seqs=4 * batch_size)),
        ("paged, fixed KV", dict(paged=True, max_model_len=max_model_len, kv_cache_bytes=budget,
                                 max_num_seqs=4 * batch_size)),
    ]
    warm = requests[0]
    rows, tokens = {}, {}
    for label, levers in tqdm(settings, desc="minillm settings", disable=not progress):
        engine = llm.with_levers(**levers)
        engine.generate([warm.prompt], warm.params.__class__(max_tokens=2, ignore_eos=True), use_tqdm=False)
        rows[label], tokens[label] = _engine_row(engine, requests, label)
    reference = tokens["minillm continuous"]
    for label, row in rows.items():
        row.same_tokens = f"{sum(a == b for a, b in zip(tokens[label], reference))}/{len(requests)}"
    result = {"device": llm.device, "num_requests": len(requests), "batch_size": batch_size,
              "prompt_tokens": sum(len(r.prompt["prompt_token_ids"]) for r in requests),
              "output_tokens": sum(r.params.max_tokens for r in requests),
              "max_model_len": max_model_len, "kv_budget_bytes": budget, "reservations": reservations}
    if with_transformers:
        hf = load_transformers(llm)
        pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else next(iter(llm.engine.eos_token_ids))
        transformers_static(hf, requests[:1], 1, pad, progress=False)   # warm-up
        row, hf_tokens = transformers_static(hf, requests, batch_size, pad, progress=progress)
        # Left padding changes float rounding a little, so long greedy runs may part at near-ties.
        agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(hf_tokens, reference)]
        row.same_tokens = f"{sum(a == len(x) for a, x in zip(agree, reference))}/{len(requests)}"
        rows = {row.label: row, **rows}
        del hf
    cont, static = rows["minillm continuous"], rows["minillm static"]
    result["rows"] = list(rows.values())
    result["continuous_over_static"] = cont.tok_per_s / static.tok_per_s
    hf_row = next((r for r in rows.values() if r.label.startswith("transformers")), None)
    result["continuous_over_transformers"] = cont.tok_per_s / hf_row.tok_per_s if hf_row else None
    result["paged_over_contiguous_concurrency"] = (rows["paged, fixed KV"].peak_running
                                                   / rows["contiguous, fixed KV"].peak_running)
    return result


def format_batching(result: dict) -> str:
    r = result
    lines = [
        f"mixed workload: {r['num_requests']} requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens; "
        f"device: {r['device']}",
        f"{'setting':<28}{'out tok/s':>10}{'wall s':>9}{'TTFT p50 s':>11}{'mean batch':>11}{'peak seqs':>10}"
        f"{'KV real/reserved':>17}{'preempt':>8}{'same tokens':>12}",
    ]
    for row in r["rows"]:
        util = "" if row.kv_utilization != row.kv_utilization else f"{100 * row.kv_utilization:.0f}%"
        ttft = "" if row.ttft_p50_s != row.ttft_p50_s else f"{row.ttft_p50_s:.2f}"
        batch = "" if row.mean_batch != row.mean_batch else f"{row.mean_batch:.1f}"
        lines.append(f"{row.label:<28}{row.tok_per_s:>10.1f}{row.wall_s:>9.1f}{ttft:>11}{batch:>11}"
                     f"{row.peak_running or '':>10}{util:>17}{row.preemptions or '':>8}{row.same_tokens:>12}")
    lines.append(f"(batches of up to {r['batch_size']}; 'same tokens' counts requests whose greedy output equals "
                 "minillm continuous)")
    if r["continuous_over_transformers"] is not None:
        lines.append(f"continuous / transformers static padded batches: {r['continuous_over_transformers']:.2f}x")
    lines.append(f"continuous / static (minillm): {r['continuous_over_static']:.2f}x")
    lines.append(f"KV budget {r['kv_budget_bytes'] / 2**20:.1f} MiB = {r['reservations']} reservations of "
                 f"max_model_len={r['max_model_len']}: paged runs "
                 f"{r['paged_over_contiguous_concurrency']:.2f}x as many sequences at once as contiguous")
    return "\n".join(lines)
