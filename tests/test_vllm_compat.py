"""The move to vLLM: `minillm serve` takes `vllm serve`'s spellings where they mean the same thing (each
alias checked against the EngineConfig it must produce), refuses the others with the reason, and
`minillm bench serve` measures a fake vLLM server that replays vLLM's real stream shapes at known
delays (TTFT / ITL / TPOT / E2EL and token counts checked against those delays and counts)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time

import pytest

from minillm.bench import serve as bs
from minillm.config import EngineConfig
from minillm.serve import cli

HAS_TP = "tensor_parallel_size" in {f.name for f in dataclasses.fields(EngineConfig)}


def config(*argv: str) -> EngineConfig:
    return cli.config_from_argv(list(argv))


def refused(capsys, *argv: str) -> str:
    """The one-line error `minillm serve ARGV` stops with (exit status 2)."""
    with pytest.raises(SystemExit) as info:
        cli.parse_args(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line:\n{err}"
    return err


# ------------------------------------------------------------------ aliases -> EngineConfig
@pytest.mark.parametrize("argv, expected", [
    (["--enable-prefix-caching"], {"prefix_caching": True}),
    (["--prefix-caching", "--no-enable-prefix-caching"], {"prefix_caching": False}),   # the last one wins
    (["--enable-chunked-prefill"], {"chunked_prefill": True}),
    (["--no-enable-chunked-prefill"], {"chunked_prefill": False}),
    (["--kv-cache-dtype", "fp8"], {"kv_dtype": "fp8"}),
    (["--kv-cache-dtype", "fp8_e4m3"], {"kv_dtype": "fp8"}),
    (["--kv-dtype", "int8", "--kv-cache-dtype", "auto"], {"kv_dtype": None}),
    (["--quantization", "fp8"], {"weight_dtype": "fp8"}),
    (["-q", "fp8"], {"weight_dtype": "fp8"}),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'],
     {"speculative": "ngram", "num_speculative_tokens": 5}),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, '
                              '"prompt_lookup_min": 1}'], {"speculative": "ngram", "num_speculative_tokens": 2}),
    (["--speculative-config", '{"model": "[ngram]", "num_speculative_tokens": 3}'],    # vLLM's older spelling
     {"speculative": "ngram", "num_speculative_tokens": 3}),
    (["--speculative-config", '{"method": "draft_model", "model": "random:tiny-llama", "num_speculative_tokens": 6, '
                              '"draft_tensor_parallel_size": 1}'],
     {"speculative": "draft", "draft_model": "random:tiny-llama", "num_speculative_tokens": 6}),
    (["--speculative-config", '{"model": "some/draft"}'], {"speculative": "draft", "draft_model": "some/draft"}),
    (["--kv-cache-memory-bytes", "2G"], {"kv_cache_bytes": 2 * 1024 ** 3}),
    (["--kv-cache-memory-bytes", "1.5g"], {"kv_cache_bytes": 1_500_000_000}),
    (["--max-model-len", "32k", "--max-num-batched-tokens", "2K"],
     {"max_model_len": 32_000, "max_num_batched_tokens": 2048}),
    (["--dtype", "half"], {"dtype": "float16"}),
    (["--dtype", "float"], {"dtype": "float32"}),
    (["--dtype", "bfloat16", "--seed", "7"], {"dtype": "bfloat16", "seed": 7}),
    (["--enforce-eager"], {"cuda_graphs": False}),
    (["--no-enforce-eager", "--attention-backend", "triton"], {"cuda_graphs": True, "attention_backend": "triton"}),
    (["--max-num-seqs", "64", "--block-size", "32", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"],
     {"max_num_seqs": 64, "block_size": 32, "enable_lora": True, "max_loras": 3, "max_lora_rank": 8}),
    (["-pp", "1", "--data-parallel-size", "1", "--disable-log-requests", "--disable-log-stats", "--max-logprobs", "20"],
     {}),
])
def test_vllm_spelling_sets_the_same_engine_config(argv, expected):
    assert config(*argv) == EngineConfig(**expected), argv


def test_model_as_first_argument_like_vllm_serve():
    assert config("random:tiny-llama").model == "random:tiny-llama"
    assert config("random:tiny-llama", "--enable-prefix-caching", "--max-num-seqs", "4") == \
        EngineConfig(model="random:tiny-llama", prefix_caching=True, max_num_seqs=4)
    assert config("--model", "m1", "m1").model == "m1"   # the same model twice is fine
    args = cli.parse_args(["HuggingFaceTB/SmolLM2-135M-Instruct", "--lora-modules", "a=/x", "--port", "9"])
    assert (args.model, args.lora_modules, args.port) == ("HuggingFaceTB/SmolLM2-135M-Instruct", ["a=/x"], 9)


def test_vllm_server_flag_spellings():
    args = cli.parse_args(["--uvicorn-log-level", "debug", "--served-model-name", "smol", "--host", "0.0.0.0"])
    assert (args.log_level, args.served_model_name, args.host) == ("debug", "smol", "0.0.0.0")
    assert cli.lora_module_entries(['{"name": "sql", "path": "/a/b", "base_model_name": "base"}', "chef=/c"]) == \
        ["sql=/a/b", "chef=/c"]
    with pytest.raises(ValueError, match="must be name=path or JSON"):
        cli.lora_module_entries(['{"name": "sql"}'])
    with pytest.raises(ValueError, match="neither name=path nor JSON"):
        cli.lora_module_entries(["{not json"])


def test_human_readable_int():
    assert [cli.human_readable_int(t) for t in ("8192", "1k", "1K", "25.6k", "3M", "2g", "1T")] == \
        [8192, 1000, 1024, 25600, 3 * 2 ** 20, 2_000_000_000, 2 ** 40]
    for bad in ("1.5K", "k", "12q", "-3"):
        with pytest.raises(ValueError):
            cli.human_readable_int(bad)


@pytest.mark.skipif(not HAS_TP, reason="EngineConfig has no tensor_parallel_size yet (the TP lever is being built)")
def test_tensor_parallel_size_alias_sets_the_field():
    assert config("--tensor-parallel-size", "2").tensor_parallel_size == 2
    assert config("-tp", "2").tensor_parallel_size == 2


@pytest.mark.skipif(HAS_TP, reason="EngineConfig has tensor_parallel_size: -tp sets it")
def test_tensor_parallel_size_without_the_field(capsys):
    assert config("-tp", "1") == EngineConfig()   # one device is what this engine does
    err = refused(capsys, "--tensor-parallel-size", "2")
    assert "--tensor-parallel-size 2" in err and "tensor_parallel_size" in err


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("argv, needles", [
    (["--gpu-memory-utilization", "0.9"], ["--gpu-memory-utilization", "whole memory", "--kv-cache-memory-fraction"]),
    (["--swap-space", "4"], ["--swap-space", "recomputing"]),
    (["--trust-remote-code"], ["--trust-remote-code", "never runs a model's code"]),
    (["--api-key", "k"], ["--api-key", "no authentication"]),
    (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice", "tools"]),
    (["-q", "awq"], ["--quantization awq", "already quantized", "--weight-dtype int4 --weight-calibration awq"]),
    (["--quantization", "gptq"], ["--quantization gptq", "--weight-calibration gptq"]),
    (["--quantization", "bitsandbytes"], ["--quantization bitsandbytes", "fp8 is vLLM's one method"]),
    (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype fp8_e5m2", "e4m3"]),
    (["--kv-cache-dtype", "int8"], ["--kv-cache-dtype int8", "--kv-dtype int8"]),
    (["--speculative-config", '{"method": "eagle3", "model": "x", "num_speculative_tokens": 3}'],
     ["method 'eagle3'", "'ngram' and 'draft_model'"]),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 5}'],
     ["prompt_lookup_max=5", "n = 3 down to 1"]),
    (["--speculative-config", '{"method": "ngram", "disable_by_batch_size": 4}'],
     ["'disable_by_batch_size' has no minillm counterpart"]),
    (["--speculative-config", '{"method": "draft_model"}'], ["needs \"model\""]),
    (["--speculative-config", '{"method": "ngram", "model": "x"}'], ["takes no model"]),
    (["--speculative-config", '{"method": "draft_model", "model": "x", "draft_tensor_parallel_size": 2}'],
     ["draft_tensor_parallel_size=2"]),
    (["--speculative-config", "ngram"], ["is not JSON"]),
    (["--speculative-config", "[1, 2]"], ["must be a JSON object"]),
    (["-pp", "2"], ["-pp 2", "pipeline"]),
    (["--data-parallel-size", "4"], ["--data-parallel-size 4", "replica"]),
    (["--max-logprobs", "5"], ["--max-logprobs 5", "fixed at 20"]),
    (["--max-model-len", "1.5K"], ["--max-model-len='1.5K'", "32k"]),
    (["--no-such-flag", "3"], ["--no-such-flag", "docs/VLLM.md"]),
    (["--model", "a", "b"], ["given twice", "'b'", "'a'"]),
])
def test_vllm_flags_without_minillm_meaning_are_refused(capsys, argv, needles):
    err = refused(capsys, *argv)
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_every_listed_refusal_is_refused_with_its_reason(capsys):
    for flag, (nargs, reason) in cli.VLLM_REFUSED.items():
        err = refused(capsys, flag, *(["1"] * nargs))
        assert flag in err and reason in err, err


def test_refused_alias_leaves_the_engine_serving_nothing(capsys):
    """`minillm serve` stops before loading any model when a flag is refused (exit 2, the reason on stderr)."""
    with pytest.raises(SystemExit) as info:
        cli.main(["random:tiny-llama", "--gpu-memory-utilization", "0.5"])
    assert info.value.code == 2 and "--gpu-memory-utilization" in capsys.readouterr().err
    assert cli.main(["random:tiny-llama", "--lora-modules", '{"path": "/x"}']) == 2
    assert "must be name=path or JSON" in capsys.readouterr().err


def test_help_lists_the_vllm_spellings(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    text, squeezed = " ".join(out.split()), "".join(out.split())   # argparse wraps lines, also inside flags
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                 "--kv-cache-dtype", "--quantization", "-q", "--speculative-config", "--enforce-eager",
                 "--kv-cache-memory-bytes", "--uvicorn-log-level", "--tensor-parallel-size", "-tp",
                 "--pipeline-parallel-size", "MODEL", "vLLM spellings", "docs/VLLM.md", *cli.VLLM_REFUSED):
        assert flag in text, f"{flag} missing from minillm serve --help"
    for alias in cli.VLLM_ALIASES:
        assert "".join(alias.split()) in squeezed, alias
