"""minillm against the CPU engines people use instead: batch-1 decode on the same prompts and token counts, in one run.

    python -m minillm.bench.peers                      # minillm fp32 / int8 / int4, transformers, CTranslate2
    minillm bench --compare-peers --gguf default       # + llama.cpp on the default model's shipped Q4_1 GGUF
    python -m minillm.bench.peers --rounds 5 --json peers.json

Rows: minillm in each weight format (`LLM.with_levers(weight_dtype=...)` of one loaded model, the
settings of bench/quant_speed.py); transformers `generate` (fp32, the same model directory);
CTranslate2 float32 and int8 (`pip install -e '.[peers]'`; the model is converted once, offline,
into the minillm cache); llama.cpp through llama-cpp-python when it is installed and --gguf is given.
Every request is greedy, batch 1, EOS ignored, N new tokens. Decode tokens/s = (N - 1) / (t_N - t_1),
t_1 and t_N the times of the first and the N-th token (transformers has no token timestamps here, so
as in bench/compare.py t_1 is a 1-token request's time and t_N an N-token one's). Engines run
interleaved, prompt by prompt, round after round, and each row reports the median over rounds of
its per-round median over prompts, so a noisy shared CPU hurts all rows alike.
% of bound: the row's decode rate over the read-bandwidth bound of ITS format (measured read
bandwidth / bytes of weights that format reads per token).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .compare import _median_rate
from .quant_speed import SETTINGS, greedy_request

BASE = "minillm fp32"
CT2_INT8 = "CTranslate2 int8"
AGREE_TOKENS = 16      # greedy agreement is checked on each prompt's first 16 tokens
ENGINES = frozenset({"minillm", "transformers", "ctranslate2", "llama.cpp"})


@dataclass
class Run:
    """One greedy request, timed from the moment the prompt is handed over."""
    ttft_s: float          # to the first new token
    last_s: float          # to the N-th (last) new token
    tokens: list[int]      # the N new token ids


@dataclass
class Row:
    engine: str
    weight_bytes: int | None = None     # bytes of weights this format reads per decode step
    skipped: str | None = None          # why this row has no numbers ("not installed", ...)
    tok_s: float | None = None          # decode tokens/s: median over rounds of the per-round median over prompts
    tok_s_rounds: list[float] = field(default_factory=list)
    ttft_ms: float | None = None        # median over every request
    pct_of_bound: float | None = None   # tok_s / (bandwidth / weight_bytes), in %
    vs_base: float | None = None        # tok_s / minillm fp32's
    agree: int | None = None            # prompts whose first AGREE_TOKENS tokens equal minillm fp32's


# ------------------------------------------------------------------ the rows from the timings (no engine here)
def summarize(runs: dict[str, list[list[Run]]], weight_bytes: dict[str, int | None], skipped: dict[str, str],
              bandwidth: float, base: str = BASE) -> list[Row]:
    """runs[engine][round][prompt] -> one Row per engine (skipped engines keep their reason), ratios filled in."""
    rows = []
    for name in list(runs) + [n for n in skipped if n not in runs]:
        if name in skipped:
            rows.append(Row(name, weight_bytes.get(name), skipped=skipped[name]))
            continue
        rounds = runs[name]
        per_round = [_median_rate([r.ttft_s for r in rnd], [r.last_s for r in rnd], len(rnd[0].tokens))
                     for rnd in rounds]
        row = Row(name, weight_bytes.get(name), tok_s=statistics.median(per_round), tok_s_rounds=per_round,
                  ttft_ms=1e3 * statistics.median(r.ttft_s for rnd in rounds for r in rnd))
        if row.weight_bytes:
            row.pct_of_bound = 100 * row.tok_s * row.weight_bytes / bandwidth
        rows.append(row)
    by_name = {r.engine: r for r in rows}
    ref = by_name.get(base)
    if ref is not None and ref.tok_s:
        ref_tokens = [r.tokens[:AGREE_TOKENS] for r in runs[base][0]]
        for row in rows:
            if row.tok_s is not None:
                row.vs_base = row.tok_s / ref.tok_s
                row.agree = sum(r.tokens[:AGREE_TOKENS] == want for r, want in zip(runs[row.engine][0], ref_tokens))
    return rows


def best_minillm_vs(rows: list[Row], other: str = CT2_INT8) -> tuple[str, float] | None:
    """(the fastest minillm row, its tok/s over `other`'s), or None when either has no numbers."""
    ours = [r for r in rows if r.engine.startswith("minillm") and r.tok_s]
    theirs = next((r for r in rows if r.engine == other and r.tok_s), None)
    if not ours or theirs is None:
        return None
    best = max(ours, key=lambda r: r.tok_s)
    return best.engine, best.tok_s / theirs.tok_s


# ------------------------------------------------------------------ the engines
class MinillmPeer:
    """One minillm engine (a weight format) stepped by bench/quant_speed.greedy_request."""

    def __init__(self, name: str, llm):
        self.name, self.llm = name, llm
        self.weight_bytes = llm.weight_bytes

    def run(self, ids: list[int], n: int) -> Run:
        seq = greedy_request(self.llm, ids, n)
        times = seq.token_times_s
        return Run(times[0] - seq.arrival_s, times[-1] - seq.arrival_s, list(seq.output_token_ids))


class TransformersPeer:
    """transformers `generate`, greedy, on the same model directory in fp32; min_new_tokens keeps it at N tokens."""

    def __init__(self, model_path: str, weight_bytes: int, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        self.name, self.weight_bytes, self.torch = "transformers fp32", weight_bytes, torch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.pad = self.model.config.eos_token_id
        if isinstance(self.pad, list):
            self.pad = self.pad[0]

    def _generate(self, ids: list[int], n: int):
        with self.torch.inference_mode():
            return self.model.generate(self.torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                       pad_token_id=self.pad)

    def run(self, ids: list[int], n: int) -> Run:
        t0 = time.perf_counter()
        self._generate(ids, 1)
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = self._generate(ids, n)
        tn = time.perf_counter() - t0
        return Run(t1, tn, out[0, len(ids):].tolist())


def ct2_model_dir(model_path: str, quantization: str) -> Path:
    """Where the CTranslate2 conversion of `model_path` at `quantization` is cached: next to the model in the
    minillm cache (`<cache>/models/<name>.ct2-<quantization>`), or for a model elsewhere under
    `<cache>/ctranslate2/<name>-<hash of its path>.<quantization>`."""
    from ..models.default import cache_root

    src = Path(model_path).resolve()
    models = (cache_root() / "models").resolve()
    if src.parent == models:
        return models / f"{src.name}.ct2-{quantization}"
    digest = hashlib.sha256(str(src).encode()).hexdigest()[:8]
    return cache_root() / "ctranslate2" / f"{src.name}-{digest}.{quantization}"


def convert_for_ct2(model_path: str, quantization: str) -> Path:
    """Convert a local Hugging Face directory once (offline) with CTranslate2's TransformersConverter; reuse the
    cached copy while the source's config and the CTranslate2 version are unchanged."""
    import ctranslate2

    out = ct2_model_dir(model_path, quantization)
    stamp = {"source": str(Path(model_path).resolve()), "quantization": quantization,
             "ctranslate2": ctranslate2.__version__,
             "source_mtime": max(p.stat().st_mtime for p in Path(model_path).iterdir() if p.is_file())}
    marker = out / "minillm-ct2.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    ctranslate2.converters.TransformersConverter(str(model_path), low_cpu_mem_usage=True).convert(
        str(tmp), quantization=quantization, force=True)
    (tmp / "minillm-ct2.json").write_text(json.dumps(stamp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


class CTranslate2Peer:
    """ctranslate2.Generator on the CPU; end_token=[] lets EOS through (like minillm's ignore_eos), so every
    request makes exactly N tokens, timed as generate_tokens yields them."""

    def __init__(self, model_path: str, quantization: str, tokenizer, threads: int):
        import ctranslate2

        path = convert_for_ct2(model_path, quantization)
        self.name = f"CTranslate2 {quantization}"
        self.weight_bytes = (path / "model.bin").stat().st_size
        self.tokenizer = tokenizer
        self.generator = ctranslate2.Generator(str(path), device="cpu", compute_type=quantization,
                                               intra_threads=threads)

    def run(self, ids: list[int], n: int) -> Run:
        prompt = self.tokenizer.convert_ids_to_tokens(ids)
        times, tokens = [], []
        t0 = time.perf_counter()
        for step in self.generator.generate_tokens(prompt, max_length=n, sampling_topk=1, end_token=[]):
            times.append(time.perf_counter() - t0)
            tokens.append(step.token_id)
        return Run(times[0], times[-1], tokens)


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) on a GGUF file, greedy; Llama.generate never stops on EOS by itself."""

    def __init__(self, gguf: str, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.name = f"llama.cpp {Path(gguf).stem.rsplit('.', 1)[-1]}"
        self.weight_bytes = Path(gguf).stat().st_size
        self.llama = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           verbose=False)

    def run(self, ids: list[int], n: int) -> Run:
        times, tokens = [], []
        t0 = time.perf_counter()
        for token in self.llama.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                         reset=True):
            times.append(time.perf_counter() - t0)
            tokens.append(token)
            if len(tokens) == n:
                break
        return Run(times[0], times[-1], tokens)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ------------------------------------------------------------------ one run
def prompt_ids_for(llm, num_prompts: int) -> list[list[int]]:
    """The chat workload's prompts (data/prompts.txt in the chat template) as token ids; a model without a
    tokenizer (random:...) gets fixed 16-token prompts."""
    from .workloads import chat_workload

    if llm.tokenizer is None:
        vocab = llm.engine.model_config.vocab_size
        return [[(37 * p + 11 * j) % (vocab - 3) + 3 for j in range(16)] for p in range(num_prompts)]
    return [r.prompt["prompt_token_ids"] if isinstance(r.prompt, dict) else llm.tokenizer.encode(r.prompt)
            for r in chat_workload(num_prompts, 1, llm.tokenizer)]


def build_peers(llm, settings: dict[str, dict], engines: set[str], gguf: str | None, threads: int,
                n_ctx: int) -> tuple[list, dict[str, str], dict[str, int | None]]:
    """(the peers that run, {row: why it is skipped}, {row: weight bytes}) for the rows asked for."""
    peers, skipped = [], {}
    for label, levers in settings.items():
        name = "minillm " + ("fp32" if label == "model dtype" else label)
        if "minillm" in engines:
            peers.append(MinillmPeer(name, llm.with_levers(**levers) if levers else llm))
    path = llm.engine.model_path
    local = isinstance(path, str) and Path(path).is_dir()
    base_bytes = peers[0].weight_bytes if peers else llm.weight_bytes
    if "transformers" in engines:
        if local:
            peers.append(TransformersPeer(path, base_bytes, threads))
        else:
            skipped["transformers fp32"] = f"no local model directory ({path!r})"
    for quantization in ("float32", "int8"):
        name = f"CTranslate2 {quantization}"
        if "ctranslate2" not in engines:
            continue
        if not _importable("ctranslate2"):
            skipped[name] = "not installed (pip install -e '.[peers]')"
        elif not local or llm.tokenizer is None:
            skipped[name] = f"no local model directory with a tokenizer to convert ({path!r})"
        else:
            peers.append(CTranslate2Peer(path, quantization, llm.tokenizer, threads))
    if "llama.cpp" in engines:
        if not _importable("llama_cpp"):
            skipped["llama.cpp"] = "not installed (pip install llama-cpp-python; it builds from source)"
        elif gguf is None:
            skipped["llama.cpp"] = "no --gguf (give a GGUF of the same model, or 'default')"
        else:
            peers.append(LlamaCppPeer(gguf, threads, n_ctx))
    return peers, skipped, {p.name: p.weight_bytes for p in peers}


def compare_peers(llm, prompt_ids: list[list[int]], new_tokens: int = 64, rounds: int = 3,
                  settings: dict[str, dict] | None = None, engines=ENGINES, gguf: str | None = None, progress: bool = True) -> dict:
    """Run every engine on every prompt, round after round (engines interleaved prompt by prompt); the result
    holds rows (see Row), the hardware and the settings."""
    import torch
    from tqdm.auto import tqdm

    from ..hardware import cpu_name, measure_memory_bandwidth

    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens}: need at least 2 (decode rate = (N - 1) / (t_N - t_1))")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one prompt")
    unknown = set(engines) - ENGINES
    if unknown:
        raise ValueError(f"engines {sorted(unknown)} unknown; choose from {sorted(ENGINES)}")
    threads = torch.get_num_threads()
    n_ctx = max(len(ids) for ids in prompt_ids) + new_tokens + 8
    peers, skipped, weight_bytes = build_peers(llm, settings or SETTINGS, set(engines), gguf, threads, n_ctx)
    for peer in peers:   # warm up: first-call allocations, kernel dispatch, thread pools
        peer.run(prompt_ids[0], 2)
    before = measure_memory_bandwidth()
    runs: dict[str, list[list[Run]]] = {p.name: [] for p in peers}
    bar = tqdm(total=rounds * len(prompt_ids) * len(peers), desc="peers", disable=not progress)
    for _ in range(rounds):
        for p in runs:
            runs[p].append([])
        for ids in prompt_ids:
            for peer in peers:
                bar.set_postfix_str(peer.name)
                runs[peer.name][-1].append(peer.run(ids, new_tokens))
                bar.update()
    bar.close()
    # Best of before and after the rounds (a second call with another `repeats` is a new measurement, not the
    # cached one): a burst of other work during one of them would otherwise lower the bound and flatter every row.
    bandwidth = max(before, measure_memory_bandwidth(repeats=6))
    rows = summarize(runs, weight_bytes, skipped, bandwidth)
    return {"cpu": cpu_name(), "threads": threads, "torch": torch.__version__, "bandwidth_gb_s": bandwidth / 1e9,
            "prompts": len(prompt_ids), "new_tokens": new_tokens, "rounds": rounds, "rows": rows,
            "best_minillm_vs_ct2_int8": best_minillm_vs(rows)}


def _fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_peers(result: dict) -> str:
    lines = [
        f"batch-1 decode, {result['prompts']} prompts x {result['new_tokens']} new tokens (greedy, EOS ignored), "
        f"median of {result['rounds']} interleaved rounds",
        f"cpu: {result['cpu']}, {result['threads']} threads (torch {result['torch']}); read bandwidth "
        f"{result['bandwidth_gb_s']:.1f} GB/s measured (best of before and after the rounds)",
        f"{'engine':<20}{'weights MB':>11}{'tok/s':>8}{'TTFT ms':>9}{'% bound':>9}{'vs fp32':>9}"
        f"{f'first {AGREE_TOKENS} =fp32':>16}  rounds tok/s",
    ]
    prompts = result["prompts"]
    for r in result["rows"]:
        head = f"{r.engine:<20}{_fmt(r.weight_bytes and r.weight_bytes / 1e6, '.1f', 11)}"
        if r.skipped:
            lines.append(f"{head}  {r.skipped}")
            continue
        lines.append(f"{head}{_fmt(r.tok_s, '.1f', 8)}{_fmt(r.ttft_ms, '.0f', 9)}"
                     f"{_fmt(r.pct_of_bound, '.0f', 8)}%{_fmt(r.vs_base, '.2f', 8)}x"
                     f"{f'{r.agree}/{prompts}' if r.agree is not None else '-':>16}  "
                     + " ".join(f"{v:.1f}" for v in r.tok_s_rounds))
    best = result["best_minillm_vs_ct2_int8"]
    lines.append(f"best minillm ({best[0]}) / CTranslate2 int8: {best[1]:.2f}x" if best else
                 "best minillm / CTranslate2 int8: - (CTranslate2 int8 did not run)")
    lines.append("% bound: decode tok/s over (read bandwidth / that row's weight bytes); greedy agreement is a "
                 "sanity check (quantized formats may part), not a speed claim")
    return "\n".join(lines)


def format_peers_markdown(result: dict) -> str:
    """The same rows as a Markdown table (for docs/PERFORMANCE.md), with the hardware line under it."""
    lines = [f"| engine | weights MB | decode tok/s | TTFT ms | % of bound | vs minillm fp32 | first {AGREE_TOKENS} "
             "tokens = fp32 |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mb = f"{r.weight_bytes / 1e6:.1f}" if r.weight_bytes else ""
        if r.skipped:
            lines.append(f"| {r.engine} | {mb} | {r.skipped} | | | | |")
            continue
        lines.append(f"| {r.engine} | {mb} | {r.tok_s:.1f} | {r.ttft_ms:.0f} | "
                     f"{'' if r.pct_of_bound is None else f'{r.pct_of_bound:.0f}%'} | {r.vs_base:.2f}x | "
                     f"{r.agree}/{result['prompts']} |")
    best = result["best_minillm_vs_ct2_int8"]
    lines.append("")
    lines.append(f"{result['prompts']} prompts x {result['new_tokens']} new tokens, median of {result['rounds']} "
                 f"interleaved rounds; {result['cpu']}, {result['threads']} threads, torch {result['torch']}, "
                 f"read bandwidth {result['bandwidth_gb_s']:.1f} GB/s measured"
                 + (f"; best minillm ({best[0]}) / CTranslate2 int8: **{best[1]:.2f}x**" if best else ""))
    return "\n".join(lines)


def result_json(result: dict) -> dict:
    return {**result, "rows": [asdict(r) for r in result["rows"]]}


def run(model: str | None = None, num_prompts: int = 4, new_tokens: int = 64, rounds: int = 3,
        gguf: str | None = None, json_path: str | None = None, engines=None, levers: dict | None = None,
        threads: int | None = None, progress: bool = True, markdown: bool = False) -> dict:
    """Load the model, compare, print the table; write the rows to `json_path` when given."""
    import torch

    from ..llm import LLM

    if not 1 <= num_prompts <= 32:
        raise ValueError(f"num_prompts={num_prompts}: choose 1 to 32 (data/prompts.txt has 32)")
    if threads:
        torch.set_num_threads(threads)
    if gguf == "default":
        from ..models.default import gguf_path

        gguf = str(gguf_path())
    elif gguf is not None and not Path(gguf).is_file():
        raise ValueError(f"--gguf {gguf!r}: no such file (give a GGUF path, or 'default' for the shipped Q4_1)")
    llm = LLM(model, **(levers or {}))
    result = compare_peers(llm, prompt_ids_for(llm, num_prompts), new_tokens, rounds,
                           engines=set(engines or ENGINES), gguf=gguf, progress=progress)
    print(format_peers(result))
    if markdown:
        print()
        print(format_peers_markdown(result))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result_json(result), indent=1))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench.peers", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts from data/prompts.txt (1-32)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--gguf", default=None, metavar="PATH",
                        help="a GGUF of the same model for the llama.cpp row ('default': the shipped Q4_1)")
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=None, help="only these rows")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows to this file")
    parser.add_argument("--markdown", action="store_true", help="also print the rows as a Markdown table")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run(args.model, args.prompts, args.tokens, args.rounds, args.gguf, args.json, args.engines,
        threads=args.threads, progress=not args.no_progress, markdown=args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
