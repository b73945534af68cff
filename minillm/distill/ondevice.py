"""The student beyond its own answers: as the teacher's draft model, and through llama.cpp on its exported GGUF.

    result = draft_comparison(teacher_dir, "students/extract-6", task="extract")
    print(format_draft_table(result))     # off, n-gram, self-draft and the student as draft: acceptance, speed-up

    row = llama_cpp_side_by_side("students/extract-6", file_type="f16")
    print(format_llama_cpp(row))          # tokens/s of llama.cpp and minillm on one task prompt, greedy tokens compared

The draft comparison runs the teacher at batch 1 on the task's few-shot prompts (greedy, answers up to the
newline) with speculation off, then with each proposer proposing k tokens per step: prompt lookup
("ngram"), the teacher's own first layers ("self", an early exit) and the distilled student ("draft",
its own KV cache). Greedy speculation is lossless, so every setting's answers must equal the plain
teacher's ("identical"); the speed-up is decode tokens/s over the plain teacher's.

llama.cpp runs through llama-cpp-python when it is importable (bench/peer_engines.LlamaCppPeer); the
student is exported to GGUF first (export_gguf) and minillm runs the same weights in the matching
weight_dtype (F16: fp32, Q8_0: int8, Q4_0: int4). Without the package the row says how to install it.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

LLAMA_CPP_INSTALL = ("llama.cpp: llama-cpp-python is not installed here; install it with "
                     "`.venv/bin/pip install llama-cpp-python` (it compiles llama.cpp: minutes), then rerun")
MINILLM_DTYPE = {"f16": "fp32", "q8_0": "int8", "q4_0": "int4"}    # the GGUF type -> minillm's closest weights


def task_requests(tokenizer, task: str, examples: list, max_tokens: int = 48) -> list:
    """The teacher's few-shot prompts for `examples`, greedy, each answer stopping at its newline."""
    from ..bench.workloads import Request
    from ..sampling import SamplingParams
    from .tasks import prompt_text

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n"])
    return [Request({"prompt_token_ids": tokenizer.encode(prompt_text(task, e.message))}, params) for e in examples]


def draft_settings(student_dir: str | Path, k: int = 4, self_layers: int | None = None) -> dict[str, dict]:
    """The proposers beside n-gram (which compare_speculative adds itself): the self-draft and the student."""
    if not (isinstance(k, int) and 1 <= k <= 16):
        raise ValueError(f"k={k!r} must be an integer in 1..16 (tokens proposed per step)")
    return {f"self k={k}": {"speculative": "self", "num_speculative_tokens": k, "draft_num_layers": self_layers},
            f"student k={k}": {"speculative": "draft", "draft_model": str(student_dir), "num_speculative_tokens": k}}


def draft_comparison(teacher_dir: str | Path, student_dir: str | Path, task: str = "extract", num_requests: int = 8,
                     k: int = 4, self_layers: int | None = None, llm=None) -> dict:
    """Speculation off / n-gram / self-draft / the student as draft on the teacher, batch 1, the task's prompts."""
    from ..bench.speculative import compare_speculative
    from ..llm import LLM
    from .tasks import make_examples

    if not (isinstance(num_requests, int) and 1 <= num_requests <= 5000):
        raise ValueError(f"num_requests={num_requests!r} must be an integer in 1..5000")
    llm = llm if llm is not None else LLM(str(teacher_dir))
    requests = task_requests(llm.tokenizer, task, make_examples(task, "heldout", num_requests))
    result = compare_speculative(llm, requests, ks=(k,), others=draft_settings(student_dir, k, self_layers))
    result["rows"] = [draft_row(row) for row in result["rows"]]
    result["k"] = k
    return result


def draft_row(row: dict) -> dict:
    """compare_speculative's row with the proposer named: label, proposer, decode tok/s, speed-up, acceptance,
    tokens per target pass, answers identical to the plain teacher's."""
    label = row["label"]
    proposer = ("off" if label == "off" else "n-gram" if label.startswith("ngram") else
                "self-draft" if label.startswith("self") else "student draft")
    return {"label": label, "proposer": proposer, "decode_tok_per_s": row["decode_tok_per_s"],
            "speedup": row["speedup"], "acceptance_rate": None if label == "off" else row["acceptance_rate"],
            "tokens_per_pass": None if label == "off" else row["tokens_per_pass"], "identical": row["identical"]}


def format_draft_table(result: dict) -> str:
    rows = result["rows"]
    lines = [f"the teacher with a draft, batch 1 on {result['num_requests']} task prompts "
             f"({result['output_tokens']} answer tokens), k={result['k']} proposed per step",
             f"{'proposer':<16}{'decode tok/s':>14}{'speed-up':>10}{'acceptance':>12}{'tokens/pass':>13}{'identical':>11}"]
    for row in rows:
        accept = "" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.1%}"
        per_pass = "" if row["tokens_per_pass"] is None else f"{row['tokens_per_pass']:.2f}"
        lines.append(f"{row['proposer']:<16}{row['decode_tok_per_s']:>14.1f}{row['speedup']:>9.2f}x{accept:>12}"
                     f"{per_pass:>13}{row['identical']:>6}/{result['num_requests']}")
    return "\n".join(lines)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _decode_rate(run) -> float:
    return (len(run.tokens) - 1) / (run.last_s - run.ttft_s) if run.last_s > run.ttft_s else float("nan")


def llama_cpp_side_by_side(model_dir: str | Path, file_type: str = "f16", gguf: str | Path | None = None,
                           task: str = "extract", tokens: int = 32, warmup: int = 1, repeats: int = 3,
                           threads: int | None = None) -> dict:
    """{"skipped": why} without llama-cpp-python; else both engines' decode tok/s (median of `repeats`) and TTFT
    on one task prompt, and how many of llama.cpp's greedy tokens equal minillm's."""
    from .export_gguf import FILE_TYPES

    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type {file_type!r} is not one of {list(FILE_TYPES)}")
    if not _importable("llama_cpp"):
        return {"skipped": LLAMA_CPP_INSTALL}
    from ..bench.peer_engines import LlamaCppPeer, MinillmPeer
    from ..hardware import num_cpu_threads
    from ..llm import LLM
    from .export_gguf import export_gguf
    from .tasks import make_examples
    from .teacher import student_prompt_text

    threads = threads or num_cpu_threads()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(gguf) if gguf is not None else export_gguf(model_dir, scratch, file_type, modelfile=False)
        dtype = MINILLM_DTYPE[file_type]
        llm = LLM(str(model_dir))
        peers = [MinillmPeer(f"minillm {dtype}", llm if dtype == "fp32" else llm.with_levers(weight_dtype=dtype)),
                 LlamaCppPeer(str(path), threads, n_ctx=512)]
        ids = llm.tokenizer.encode(student_prompt_text(task, make_examples(task, "heldout", 1)[0].message))
        engines = {}
        for peer in peers:
            for _ in range(warmup):
                peer.run(ids, tokens)
            runs = [peer.run(ids, tokens) for _ in range(repeats)]
            engines[peer.name] = {"decode_tok_s": statistics.median(_decode_rate(r) for r in runs),
                                  "ttft_ms": statistics.median(r.ttft_s for r in runs) * 1e3,
                                  "weight_bytes": peer.weight_bytes, "tokens": runs[-1].tokens}
    return side_by_side_row(engines, path.name, tokens)


def side_by_side_row(engines: dict[str, dict], gguf_name: str, tokens: int) -> dict:
    """The first engine is minillm's: the others' greedy tokens are compared with its (same leading tokens)."""
    names = list(engines)
    ours = engines[names[0]]["tokens"]
    for name in names:
        theirs = engines[name]["tokens"]
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        engines[name]["same_prefix"] = same
        engines[name]["vs_minillm"] = engines[name]["decode_tok_s"] / engines[names[0]]["decode_tok_s"]
    return {"gguf": gguf_name, "tokens": tokens, "engines": engines}


def format_llama_cpp(row: dict) -> str:
    if "skipped" in row:
        return row["skipped"]
    lines = [f"llama.cpp beside minillm on {row['gguf']}: one task prompt, {row['tokens']} greedy tokens, batch 1",
             f"{'engine':<22}{'decode tok/s':>14}{'vs minillm':>12}{'TTFT ms':>9}{'weights MB':>12}{'same tokens':>13}"]
    for name, e in row["engines"].items():
        lines.append(f"{name:<22}{e['decode_tok_s']:>14.1f}{e['vs_minillm']:>11.2f}x{e['ttft_ms']:>9.1f}"
                     f"{e['weight_bytes'] / 1e6:>12.1f}{e['same_prefix']:>7}/{row['tokens']}")
    return "\n".join(lines)
