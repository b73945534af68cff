"""`minillm bench prefill`: time to first token and prefill tokens/s by prompt length, minillm beside its peers.

    minillm bench prefill                                   # 128, 512, 2048, 8192 tokens (up to the context)
    minillm bench prefill --lengths 1024 4096 --engines minillm --settings fp32

Rows: minillm fp32 / int8 / int4 (one loaded model, `with_levers`; its default chunked prefill), transformers
(fp32, the same directory), CTranslate2 float32 / int8 (`pip install -e '.[peers]'`) and llama.cpp
(llama-cpp-python, `pip install -e '.[llama]'`, on the GGUF the default model ships as, Q4_1); each is
one greedy request of one new token on a prompt of N tokens (bench/peer_engines.py runs them), engines
interleaved length by length, the median over rounds reported. A peer that cannot run here is one line
saying why. Beside each time: the fraction of the machine's measured fp32 matmul rate it reaches
(2 * parameters per token * N + attention's FLOPs, over the time), attention's share of those FLOPs
(QK^T and PV over the causal half: it grows with N while the weights' share stays flat) and, for minillm's
rows, attention's share of the time as measured: the engine's attention backend is wrapped for the run
(TimedAttention), every call to it (the KV store, the prefill chunks' attention) timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

LENGTHS = (128, 512, 2048, 8192)
SETTINGS = {"model dtype": {}, "int8": {"weight_dtype": "int8"},
            "int4 g128": {"weight_dtype": "int4", "weight_group_size": 128}}
SETTING_FLAGS = {"fp32": "model dtype", "int8": "int8", "int4": "int4 g128"}   # --settings fp32 int8 int4


def prompt_lengths(requested, max_model_len: int) -> list[int]:
    """The lengths to run: each at most max_model_len - 1 (one output token must fit), sorted, once each."""
    bad = [n for n in requested if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise ValueError(f"--lengths {bad[0]!r}: a prompt length is an integer >= 1")
    if max_model_len < 2:
        raise ValueError(f"max_model_len={max_model_len}: no prompt leaves room for a token")
    return sorted({min(n, max_model_len - 1) for n in requested})


def prompt_ids(length: int, vocab_size: int) -> list[int]:
    """A fixed prompt of `length` ordinary token ids (ids 0-2 are often special)."""
    return [(i * 7919 + 13) % (vocab_size - 3) + 3 for i in range(length)]


def matmul_flops(model_config, num_tokens: int) -> int:
    """FLOPs of the weight matmuls of a prefill: 2 per parameter per token (the embedding is a lookup, not a
    matmul; the LM head runs for the last token only)."""
    cfg = model_config
    embedding = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    per_token = cfg.num_active_params - embedding
    return 2 * per_token * num_tokens + 2 * cfg.vocab_size * cfg.hidden_size


def attention_flops(model_config, num_tokens: int) -> int:
    """FLOPs of causal attention over a prompt: QK^T and PV, 2 FLOPs a multiply-add, token i attends to i + 1."""
    cfg = model_config
    pairs = num_tokens * (num_tokens + 1) // 2
    return 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs


class TimedAttention:
    """An attention backend's stand-in that runs the wrapped backend's calls and adds up their wall time
    (`seconds`): what the bench reports as attention's share of a prefill. Install it with `timed(llm)`."""

    CALLS = ("store_kv", "decode", "extend", "attend", "decode_padded")

    def __init__(self, inner):
        self.inner, self.name, self.layout = inner, inner.name, inner.layout
        self.seconds = 0.0

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name not in self.CALLS:
            return method

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def timed(llm) -> TimedAttention:
    """Wrap `llm`'s engine's attention backend in a TimedAttention (for as long as the engine lives)."""
    runner = llm.engine.runner
    if not isinstance(runner.backend, TimedAttention):
        runner.backend = TimedAttention(runner.backend)
    return runner.backend


@dataclass
class PrefillRow:
    engine: str
    num_tokens: int
    ttft_s: float | None = None      # median over rounds
    skipped: str | None = None
    attention_s: float | None = None   # minillm: the attention backend's time in the run of median TTFT

    @property
    def tok_per_s(self) -> float | None:
        return None if self.ttft_s is None else self.num_tokens / self.ttft_s


def summarize(times: dict[tuple[str, int], list[float]], skipped: dict[str, str], lengths: list[int],
              attention: dict[tuple[str, int], list[float]] | None = None) -> list[PrefillRow]:
    """One row per (engine, length): the median TTFT and, where timed, the attention time of the same run."""
    attention = attention or {}
    rows = []
    for key, ts in times.items():
        middle = sorted(range(len(ts)), key=ts.__getitem__)[(len(ts) - 1) // 2]
        att = attention.get(key)
        rows.append(PrefillRow(*key, statistics.median(ts), attention_s=att[middle] if att else None))
    rows += [PrefillRow(engine, n, skipped=why) for engine, why in skipped.items() for n in lengths[:1]]
    return rows


def format_prefill(result: dict) -> str:
    cfg, rate = result["model_config"], result["matmul_flops_per_s"]
    lines = [f"prefill on {result['cpu']}, {result['threads']} threads; fp32 matmul roof "
             f"{rate / 1e9:.0f} GFLOP/s (measured); the median of {result['rounds']} rounds",
             f"{'engine':<20}{'tokens':>8}{'TTFT s':>10}{'prefill tok/s':>15}{'% of matmul roof':>18}"
             f"{'attention FLOPs':>17}{'attention time':>16}"]
    for row in sorted(result["rows"], key=lambda r: (r.skipped is not None, r.engine, r.num_tokens)):
        if row.skipped is not None:
            lines.append(f"{row.engine:<20} skipped: {row.skipped}")
            continue
        weights, attention = matmul_flops(cfg, row.num_tokens), attention_flops(cfg, row.num_tokens)
        fraction = (weights + attention) / row.ttft_s / rate
        lines.append(f"{row.engine:<20}{row.num_tokens:>8}{row.ttft_s:>10.3f}{row.tok_per_s:>15.0f}"
                     f"{100 * fraction:>17.1f}%{100 * attention / (weights + attention):>16.1f}%"
                     + (f"{100 * row.attention_s / row.ttft_s:>15.1f}%" if row.attention_s is not None else ""))
    return "\n".join(lines)


def compare_prefill(llm, lengths: list[int], engines: set[str], rounds: int = 2, gguf: str | None = None,
                    progress: bool = True, settings: list[str] | None = None) -> dict:
    """Time every engine's prefill at every length (engines interleaved); rows, the hardware, the matmul roof.
    settings: minillm's rows by SETTINGS name (None: all)."""
    import torch
    from tqdm.auto import tqdm

    from ..hardware import cpu_name, measure_matmul_flops
    from .peer_engines import MinillmPeer, build_peers

    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1")
    threads = torch.get_num_threads()
    unknown = sorted(set(settings or ()) - set(SETTINGS))
    if unknown:
        raise ValueError(f"settings {unknown}: minillm's rows are {list(SETTINGS)}")
    settings = {k: v for k, v in SETTINGS.items() if settings is None or k in settings} if "minillm" in engines else {}
    peers, skipped, _ = build_peers(llm, settings, engines, gguf, threads, n_ctx=max(lengths) + 8)
    vocab = llm.engine.model_config.vocab_size
    for peer in peers:   # warm-up: first-call allocations, thread pools
        peer.run(prompt_ids(min(lengths), vocab), 1)
    clocks = {peer.name: timed(peer.llm) for peer in peers if isinstance(peer, MinillmPeer)}
    times: dict[tuple[str, int], list[float]] = {}
    attention: dict[tuple[str, int], list[float]] = {}
    bar = tqdm(total=rounds * len(lengths) * len(peers), desc="prefill", disable=not progress)
    for _ in range(rounds):
        for n in lengths:
            ids = prompt_ids(n, vocab)
            for peer in peers:
                bar.set_postfix_str(f"{peer.name} {n}")
                clock = clocks.get(peer.name)
                before = clock.seconds if clock else 0.0
                times.setdefault((peer.name, n), []).append(peer.run(ids, 1).ttft_s)
                if clock:
                    attention.setdefault((peer.name, n), []).append(clock.seconds - before)
                bar.update()
    bar.close()
    rate = max(measure_matmul_flops("cpu", size=1024), measure_matmul_flops("cpu", size=2048, repeats=3))
    return {"cpu": cpu_name(), "threads": threads, "rounds": rounds, "matmul_flops_per_s": rate,
            "model_config": llm.engine.model_config, "rows": summarize(times, skipped, lengths, attention)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minillm bench prefill", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                        help="prompt lengths in tokens (each at most the context - 1)")
    parser.add_argument("--engines", nargs="+", default=["minillm", "transformers", "ctranslate2", "llama.cpp"],
                        choices=["minillm", "transformers", "ctranslate2", "llama.cpp"], help="only these rows")
    parser.add_argument("--settings", nargs="+", default=None, choices=list(SETTING_FLAGS),
                        help="only these of minillm's rows (default: all)")
    parser.add_argument("--gguf", default="default", metavar="PATH",
                        help="the GGUF llama.cpp runs ('default': the one the default model ships as)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the median is reported)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..llm import LLM

    llm = LLM(args.model)
    gguf = args.gguf
    if gguf == "default":
        from ..models.default import gguf_path

        try:
            gguf = str(gguf_path())
        except Exception as exc:   # no shipped GGUF here: llama.cpp's row says so
            print(f"llama.cpp: no default GGUF ({type(exc).__name__}: {exc})")
            gguf = None
    try:
        lengths = prompt_lengths(args.lengths, llm.engine.max_model_len)
    except ValueError as exc:
        print(f"minillm bench prefill: {exc}")
        return 2
    print(format_prefill(compare_prefill(llm, lengths, set(args.engines), args.rounds, gguf,
                                         progress=not args.no_progress,
                                         settings=[SETTING_FLAGS[f] for f in args.settings] if args.settings else None)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
