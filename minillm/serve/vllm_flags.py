"""vLLM's spellings of `minillm serve`'s flags: the aliases that mean the same, the flags refused with the reason.

    minillm serve HuggingFaceTB/SmolLM2-135M-Instruct --enable-prefix-caching --kv-cache-dtype fp8   # vLLM's spelling

`vllm serve`'s spellings are accepted where they mean the same thing (VLLM_ALIASES: the model as
the first argument, --enable-prefix-caching, --kv-cache-dtype fp8, --speculative-config '{...}',
...); vLLM flags with no minillm meaning are refused with the reason (VLLM_REFUSED), never
ignored. docs/VLLM.md maps every lever, flag and metric to vLLM's.
"""

from __future__ import annotations

import argparse
import json

from ..sampling import MAX_LOGPROBS
from .flags import lever_type

# Read from vLLM 0.11 (vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py,
# vllm/config/speculative.py); docs/VLLM.md explains each difference.
VLLM_VERSION = "0.11"
VLLM_KV_CACHE_DTYPES = {"auto": None, "fp8": "fp8", "fp8_e4m3": "fp8"}   # minillm stores fp8 KV as e4m3
VLLM_QUANTIZATION = {"fp8": "fp8", "none": None}   # vLLM's online fp8: a float checkpoint quantized at load
NGRAM_LOOKUP = {"prompt_lookup_max": 3, "prompt_lookup_min": 1}   # speculative/ngram.py: ngram_propose's n = 3..1

# vLLM flag -> what it sets here (the --help group "vLLM spellings" lists them; tests check each).
VLLM_ALIASES = {
    "MODEL (first argument)": "--model MODEL (`vllm serve MODEL`)",
    "--enable-prefix-caching / --no-enable-prefix-caching": "--prefix-caching / --no-prefix-caching",
    "--enable-chunked-prefill / --no-enable-chunked-prefill": "--chunked-prefill / --no-chunked-prefill",
    "--kv-cache-dtype {auto,fp8,fp8_e4m3}": "--kv-dtype none / fp8 (e4m3, a scale per token and head)",
    "--quantization / -q fp8": "--weight-dtype fp8 (a float checkpoint quantized at load, as vLLM's online fp8)",
    "--speculative-config JSON": "--speculative ngram|draft, --num-speculative-tokens, --draft-model "
                                 "(methods 'ngram' and 'draft_model')",
    "--enforce-eager / --no-enforce-eager": "--no-cuda-graphs / --cuda-graphs",
    "--kv-cache-memory-bytes N": "--kv-cache-bytes N",
    "--uvicorn-log-level": "--log-level",
    "--dtype half / float": "--dtype float16 / float32",
    "--tensor-parallel-size / -tp N": "--tensor-parallel-size N",
    "--pipeline-parallel-size / -pp 1, --data-parallel-size / -dp 1": "accepted: one stage, one replica",
    "--disable-log-requests, --disable-log-stats": "accepted: minillm logs neither",
    "--max-logprobs 20": "accepted: minillm's cap is 20",
    "--lora-modules '{\"name\": N, \"path\": P}'": "--lora-modules N=P",
    "32k, 2K, 1.5g (--max-model-len, --max-num-batched-tokens, --kv-cache-bytes)": "32000, 2048, 1500000000",
    "same name, same flag": "--max-num-seqs, --max-num-batched-tokens, --block-size, --max-model-len, --seed, "
                            "--dtype, --enable-lora, --max-loras, --max-lora-rank, --lora-modules, "
                            "--served-model-name, --host, --port",
}

_GPU_UTIL = ("it is the fraction of the GPU's whole memory vLLM may use for weights, activations and KV cache; "
             "minillm sizes only its KV pool: --kv-cache-memory-fraction F (F of the free memory after the "
             "weights) or --kv-cache-memory-bytes N")
# vLLM flags refused: flag -> (values it takes: 0 or 1, the reason). A flag neither listed nor minillm's is
# refused by argparse, by name.
VLLM_REFUSED = {
    "--gpu-memory-utilization": (1, _GPU_UTIL),
    "--swap-space": (1, "minillm preempts by recomputing, it never swaps KV blocks to the CPU"),
    "--cpu-offload-gb": (1, "minillm keeps every weight on its device"),
    "--num-gpu-blocks-override": (1, "size the KV pool with --kv-cache-bytes instead"),
    "--trust-remote-code": (0, "minillm runs its own Llama-family forward pass and never runs a model's code"),
    "--tokenizer": (1, "minillm reads the tokenizer from the model directory"),
    "--revision": (1, "minillm loads the hub's default revision"),
    "--download-dir": (1, "minillm uses the Hugging Face cache (MINILLM_CACHE for the default model)"),
    "--load-format": (1, "minillm reads safetensors / GGUF by the files it finds"),
    "--chat-template": (1, "minillm uses the tokenizer's chat template"),
    "--api-key": (1, "minillm's server has no authentication: keep it on 127.0.0.1"),
    "--enable-auto-tool-choice": (0, "tools are not implemented"),
    "--tool-call-parser": (1, "tools are not implemented"),
    "--reasoning-parser": (1, "minillm does not split reasoning from content"),
    "--enable-expert-parallel": (0, "minillm runs every expert on one device"),
    "--scheduling-policy": (1, "minillm schedules first come, first served (a seam: LLM(scheduling_policy=...))"),
    "--async-scheduling": (0, "minillm schedules and runs each step in turn"),
    "--compilation-config": (1, "minillm does not torch.compile; CUDA graphs are --cuda-graphs"),
    "--kv-transfer-config": (1, "minillm has no disaggregated prefill"),
    "--max-cpu-loras": (1, "minillm reads an adapter from disk again after its slot is evicted"),
    "--fully-sharded-loras": (0, "minillm's LoRA slots are not sharded"),
    "--enable-force-include-usage": (0, "ask per request with stream_options.include_usage"),
    "--structured-outputs-config": (1, "minillm's structured output always uses xgrammar"),
    "--guided-decoding-backend": (1, "minillm's structured output always uses xgrammar"),
    "--enable-sleep-mode": (0, "minillm cannot release its weights' memory while serving"),
}
SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size") + \
    tuple(NGRAM_LOOKUP)


def kv_cache_dtype(text: str) -> str | None:
    """vLLM's --kv-cache-dtype -> EngineConfig.kv_dtype."""
    if text in VLLM_KV_CACHE_DTYPES:
        return VLLM_KV_CACHE_DTYPES[text]
    why = ("minillm's fp8 KV is e4m3 (fp8 / fp8_e4m3); e5m2 is not built" if text == "fp8_e5m2" else
           "minillm builds auto (the model dtype), fp8 and fp8_e4m3 (int8 KV has no vLLM spelling: --kv-dtype int8)")
    raise argparse.ArgumentTypeError(f"--kv-cache-dtype {text}: {why}")


def quantization(text: str) -> str | None:
    """vLLM's --quantization -> EngineConfig.weight_dtype, where the meaning is the same."""
    if text.lower() in VLLM_QUANTIZATION:
        return VLLM_QUANTIZATION[text.lower()]
    if text in ("awq", "awq_marlin", "gptq", "gptq_marlin"):
        why = (f"vLLM's {text} loads a checkpoint already quantized by {text[:4].rstrip('_').upper()}; minillm "
               "quantizes a float checkpoint itself: --weight-dtype int4 --weight-calibration "
               f"{'awq' if text.startswith('awq') else 'gptq'}")
    else:
        why = ("minillm quantizes a float checkpoint at load: fp8 is vLLM's one method with that meaning "
               "(int8 / int4 have no vLLM spelling: --weight-dtype int8 / int4)")
    raise argparse.ArgumentTypeError(f"--quantization {text}: {why}")


def speculative_config(text: str) -> dict:
    """vLLM's --speculative-config JSON -> {speculative, num_speculative_tokens, draft_model}."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config {text!r} is not JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"--speculative-config {text!r} must be a JSON object like "
                                         '{"method": "ngram", "num_speculative_tokens": 4}')
    unknown = [k for k in spec if k not in SPECULATIVE_CONFIG_KEYS]
    if unknown:
        raise argparse.ArgumentTypeError(f"--speculative-config key {unknown[0]!r} has no minillm counterpart "
                                         f"(the keys minillm takes: {', '.join(SPECULATIVE_CONFIG_KEYS)})")
    method, model = spec.get("method"), spec.get("model")
    if method is None and model is not None:   # vLLM infers the method from the model
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        model = None if method == "ngram" else model
    out: dict = {}
    if method == "ngram":
        if model is not None:
            raise argparse.ArgumentTypeError(f"--speculative-config: method 'ngram' takes no model (got {model!r})")
        for key, fixed in NGRAM_LOOKUP.items():
            if spec.get(key) not in (None, fixed):
                raise argparse.ArgumentTypeError(
                    f"--speculative-config {key}={spec[key]!r}: minillm's n-gram proposer always tries n = "
                    f"{NGRAM_LOOKUP['prompt_lookup_max']} down to {NGRAM_LOOKUP['prompt_lookup_min']} "
                    "(leave the key out, or give those values)")
        out["speculative"] = "ngram"
    elif method == "draft_model":
        if not isinstance(model, str) or not model:
            raise argparse.ArgumentTypeError("--speculative-config: method 'draft_model' needs \"model\": a smaller "
                                             "model sharing the target's tokenizer")
        out["speculative"], out["draft_model"] = "draft", model
    else:
        raise argparse.ArgumentTypeError(
            f"--speculative-config method {method!r}: minillm builds 'ngram' and 'draft_model' (and its own "
            "early-exit draft, --speculative self, which vLLM lacks); EAGLE, Medusa, MTP, suffix decoding are not built")
    if spec.get("draft_tensor_parallel_size") not in (None, 1):
        raise argparse.ArgumentTypeError(f"--speculative-config draft_tensor_parallel_size="
                                         f"{spec['draft_tensor_parallel_size']!r}: minillm's draft runs on one device")
    if "num_speculative_tokens" in spec:
        out["num_speculative_tokens"] = spec["num_speculative_tokens"]
    return out


class _SetFields(argparse.Action):
    """Store the converter's {field: value} dict as those fields (one vLLM flag, several EngineConfig fields)."""

    def __call__(self, parser, namespace, values, option_string=None):
        for name, value in values.items():
            setattr(namespace, name, value)


class _Inverted(argparse.BooleanOptionalAction):
    """--enforce-eager / --no-enforce-eager: the opposite of a minillm bool (cuda_graphs)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.option_strings:
            setattr(namespace, self.dest, option_string.startswith("--no-"))


class _Refused(argparse.Action):
    """A vLLM flag with no minillm meaning: stop with the reason instead of ignoring it."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (vLLM's flag) is refused: {self.reason}")


class _Fixed(argparse.Action):
    """-pp / -dp / --max-logprobs: the value minillm always has is accepted, another is refused with the reason."""

    def __init__(self, option_strings, dest, reason: str = "", value=1, **kwargs):
        self.reason, self.value = reason, value
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if values != self.value:
            parser.error(f"{option_string} {values}: {self.reason}")


def add_vllm_spellings(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        f"vLLM spellings (vllm serve {VLLM_VERSION}; docs/VLLM.md)",
        "Accepted where the meaning is minillm's: " + "; ".join(f"{k} -> {v}" for k, v in VLLM_ALIASES.items()))
    sup = argparse.SUPPRESS
    group.add_argument("--enable-prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                       default=sup, help="= --prefix-caching (vLLM's default is on, minillm's off)")
    group.add_argument("--enable-chunked-prefill", dest="chunked_prefill", action=argparse.BooleanOptionalAction,
                       default=sup, help="= --chunked-prefill (on by default in vLLM and in minillm)")
    group.add_argument("--kv-cache-dtype", dest="kv_dtype", type=kv_cache_dtype, default=sup,
                       metavar="{auto,fp8,fp8_e4m3}", help="= --kv-dtype: auto -> none, fp8 / fp8_e4m3 -> fp8")
    group.add_argument("--quantization", "-q", dest="weight_dtype", type=quantization, default=sup,
                       metavar="fp8", help="= --weight-dtype fp8 (awq / gptq are refused with the minillm flags that "
                                           "do the same from a float checkpoint)")
    group.add_argument("--speculative-config", dest="speculative_config", type=speculative_config, action=_SetFields,
                       default=sup, metavar="JSON", help='\'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                       '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' -> --speculative, '
                       "--num-speculative-tokens, --draft-model")
    group.add_argument("--enforce-eager", dest="cuda_graphs", action=_Inverted, default=sup,
                       help="= --no-cuda-graphs (--no-enforce-eager = --cuda-graphs)")
    group.add_argument("--kv-cache-memory-bytes", dest="kv_cache_bytes", type=lever_type("kv_cache_bytes", "int"),
                       default=sup, metavar="N", help="= --kv-cache-bytes (32G, 1.5g, ...)")
    group.add_argument("--uvicorn-log-level", dest="log_level", default=sup,
                       choices=["critical", "error", "warning", "info", "debug", "trace"], help="= --log-level")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=sup, action=_Fixed, metavar="1",
                       help="accepted as 1: minillm runs the whole model in one stage",
                       reason="minillm has no pipeline parallelism (tensor parallelism is --tensor-parallel-size)")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=sup, action=_Fixed, metavar="1",
                       help="accepted as 1: one server is one replica",
                       reason="one minillm server is one replica; start several and route between them "
                              "(minillm.fleet)")
    group.add_argument("--max-logprobs", type=int, default=sup, action=_Fixed, value=MAX_LOGPROBS,
                       metavar=str(MAX_LOGPROBS), help=f"accepted as {MAX_LOGPROBS}: minillm's fixed cap",
                       reason=f"minillm's cap on logprobs is fixed at {MAX_LOGPROBS} (vLLM's default)")
    for flag in ("--disable-log-requests", "--disable-log-stats"):
        group.add_argument(flag, action="store_true", default=sup, help="accepted: minillm logs neither")
    refused = parser.add_argument_group("vLLM flags refused (no minillm meaning; the reason is printed)")
    for flag, (nargs, reason) in VLLM_REFUSED.items():
        refused.add_argument(flag, action=_Refused, nargs=nargs, reason=reason, default=sup,
                             metavar="X" if nargs else None, help=reason)


def lora_module_entries(entries: list[str] | None) -> list[str] | None:
    """--lora-modules items: 'name=path', or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}'
    -> 'name=path' (the base model is always the served one here)."""
    if not entries:
        return entries
    out = []
    for entry in entries:
        if not entry.lstrip().startswith("{"):
            out.append(entry)
            continue
        try:
            item = json.loads(entry)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {entry!r} is neither name=path nor JSON ({exc})") from None
        extra = sorted(set(item) - {"name", "path", "base_model_name"}) if isinstance(item, dict) else ["?"]
        if extra or not item.get("name") or not item.get("path"):
            raise ValueError(f"--lora-modules {entry!r} must be name=path or JSON with \"name\" and \"path\" "
                             "(and optionally \"base_model_name\")")
        out.append(f"{item['name']}={item['path']}")
    return out
