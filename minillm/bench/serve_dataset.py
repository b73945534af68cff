"""The serving benchmark's inputs: the prompt dataset, Poisson arrival gaps, and the SLO and percentile specs.

Records are {"prompt": ..., "output_tokens": N}: by default minillm/data/serve_prompts.jsonl, built by
build_serve_dataset() from data/prompts.txt and windows of data/corpus.txt; `minillm bench serve`
(minillm/bench/serve.py) sends them at arrival_gaps() and judges them against parse_goodput()'s SLOs.
"""

from __future__ import annotations

import json
import math
import random
from importlib import resources
from pathlib import Path

from .workloads import shipped_corpus, shipped_prompts

SLO_METRICS = ("ttft", "tpot", "e2el")
DATASET_FILE = "data/serve_prompts.jsonl"


# ------------------------------------------------------------------ dataset
def build_serve_dataset(num_records: int = 256, seed: int = 0) -> list[dict]:
    """Deterministic {"prompt", "output_tokens"} records from data/prompts.txt and data/corpus.txt.

    A quarter are bare questions (32-128 output tokens), half a corpus window of 40-160 words
    followed by a question (16-96), a quarter ask to summarize a window of 80-240 words (48-160).
    Lengths are in words and tokens of no particular tokenizer, so any server can take them."""
    if num_records < 1:
        raise ValueError(f"num_records={num_records} must be >= 1")
    questions = shipped_prompts()
    words = shipped_corpus().split()
    rng = random.Random(seed)

    def window(lo: int, hi: int) -> str:
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(words) - n)
        return " ".join(words[start:start + n])

    records = []
    for i in range(num_records):
        question = questions[i % len(questions)]
        kind = i % 4
        if kind == 0:
            prompt, out = question, rng.randint(32, 128)
        elif kind in (1, 2):
            prompt = f"Read the passage, then answer the question.\n\nPassage: {window(40, 160)}\n\nQuestion: {question}"
            out = rng.randint(16, 96)
        else:
            prompt, out = f"Summarize the following passage in a few sentences:\n\n{window(80, 240)}", rng.randint(48, 160)
        records.append({"prompt": prompt, "output_tokens": out})
    return records


def write_serve_dataset(path: str | Path, num_records: int = 256, seed: int = 0) -> Path:
    """Write build_serve_dataset() as JSONL (how minillm/data/serve_prompts.jsonl was made)."""
    path = Path(path)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build_serve_dataset(num_records, seed)))
    return path


def load_dataset(dataset=None) -> list[dict]:
    """None: the shipped data/serve_prompts.jsonl; a path to a JSONL file; or a list of records
    (dicts with "prompt" and optionally "output_tokens", or plain prompt strings)."""
    if dataset is None:
        text = resources.files("minillm").joinpath(DATASET_FILE).read_text()
        source = DATASET_FILE
    elif isinstance(dataset, (str, Path)):
        path = Path(dataset)
        if not path.is_file():
            raise FileNotFoundError(f"dataset={str(dataset)!r}: no such file (a JSONL file of "
                                    '{"prompt": ..., "output_tokens": N} lines)')
        text, source = path.read_text(), str(path)
    else:
        text, source = None, "the given list"
    if text is not None:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{source} line {n} is not JSON: {exc}") from None
    else:
        records = [r if isinstance(r, dict) else {"prompt": r} for r in dataset]
    for n, r in enumerate(records):
        if not isinstance(r.get("prompt"), str) or not r["prompt"]:
            raise ValueError(f"{source} record {n} has no non-empty 'prompt' string: {str(r)[:80]}")
        out = r.get("output_tokens")
        if out is not None and not (isinstance(out, int) and out >= 1):
            raise ValueError(f"{source} record {n}: output_tokens={out!r} must be an integer >= 1")
    if not records:
        raise ValueError(f"{source} holds no records")
    return records


# ------------------------------------------------------------------ arrivals and SLOs
def arrival_gaps(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each request after the previous one was sent (the first goes at 0):
    exponential gaps with mean 1 / request_rate, i.e. Poisson arrivals; all 0 for rate inf."""
    if not (request_rate > 0):
        raise ValueError(f"request_rate={request_rate} must be > 0 requests/s (or inf: all at once)")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]


def parse_goodput(spec) -> dict[str, float]:
    """SLOs in milliseconds: ["ttft:200", "e2el:5000"], "ttft:200 tpot:50" or {"ttft": 200}."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        spec = spec.replace(",", " ").split()
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        items = []
        for part in spec:
            name, sep, value = str(part).partition(":")
            if not sep:
                raise ValueError(f"goodput {part!r} must look like NAME:MILLISECONDS with NAME in {SLO_METRICS}")
            try:
                items.append((name, float(value)))
            except ValueError:
                raise ValueError(f"goodput {part!r}: {value!r} is not a number of milliseconds") from None
    slos = {}
    for name, value in items:
        if name not in SLO_METRICS:
            raise ValueError(f"goodput metric {name!r} is not one of {SLO_METRICS}")
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"goodput {name}:{value} must be a positive number of milliseconds")
        slos[name] = float(value)
    return slos


def parse_percentiles(spec) -> tuple[float, ...]:
    values = spec.replace(",", " ").split() if isinstance(spec, str) else list(spec)
    out = []
    for v in values:
        try:
            p = float(v)
        except ValueError:
            raise ValueError(f"percentile {v!r} is not a number in [0, 100]") from None
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p:g} must be in [0, 100]")
        out.append(p)
    if not out:
        raise ValueError("give at least one percentile, e.g. 50,90,99")
    return tuple(out)
