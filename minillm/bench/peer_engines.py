"""The CPU engines the peer comparison runs, one class each: minillm, transformers, CTranslate2, llama.cpp.

Each peer has a `name`, the `weight_bytes` its format reads per decode step, and `run(ids, n) -> Run` (one
greedy batch-1 request of n new tokens, timed); build_peers picks the ones asked for that can run here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from .peer_rows import Run
from .quant_speed import greedy_request


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
        # generate(reset=True) still keeps the longest prefix shared with the last call's tokens: a repeated prompt
        # would skip its prefill. Forget them, so every run reads the whole prompt as the other engines do.
        self.llama.reset()
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



def llama_cpp_missing() -> str:
    """The one line a llama.cpp row says when llama-cpp-python is not installed: how to get it, or why it cannot
    build here (it compiles llama.cpp from source with the machine's C++ compiler)."""
    import shutil

    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        return "not installed, and no C++ compiler here to build llama-cpp-python from source"
    return ("not installed (make bench-peers builds it, or CMAKE_ARGS=-DLLAVA_BUILD=OFF pip install -e '.[llama]': "
            "llama.cpp compiles from source, about 20 minutes on 2 cores)")


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
            skipped["llama.cpp"] = llama_cpp_missing()
        elif gguf is None:
            skipped["llama.cpp"] = "no --gguf (give a GGUF of the same model, or 'default')"
        else:
            peers.append(LlamaCppPeer(gguf, threads, n_ctx))
    return peers, skipped, {p.name: p.weight_bytes for p in peers}
