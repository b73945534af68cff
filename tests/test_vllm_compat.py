"""The move to vLLM: `minillm serve` takes `vllm serve`'s spellings where they mean the same thing (each
alias checked against the EngineConfig it must produce), refuses the others with the reason, and
`minillm bench serve` measures a fake vLLM server that replays vLLM's real stream shapes at known
delays (TTFT / ITL / TPOT / E2EL and token counts checked against those delays and counts)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time

import pytest

from app_thread import AppInThread
from minillm.bench import serve as bs
from minillm.bench.serve_result import ServeBenchResult
from minillm.config import EngineConfig
from minillm import levers
from minillm.serve import cli, vllm_flags
from minillm.serve.client import _chunk_text


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
    assert vllm_flags.lora_module_entries(['{"name": "sql", "path": "/a/b", "base_model_name": "base"}', "chef=/c"]) == \
        ["sql=/a/b", "chef=/c"]
    with pytest.raises(ValueError, match="must be name=path or JSON"):
        vllm_flags.lora_module_entries(['{"name": "sql"}'])
    with pytest.raises(ValueError, match="neither name=path nor JSON"):
        vllm_flags.lora_module_entries(["{not json"])


def test_human_readable_int():
    assert [levers.human_readable_int(t) for t in ("8192", "1k", "1K", "25.6k", "3M", "2g", "1T")] == \
        [8192, 1000, 1024, 25600, 3 * 2 ** 20, 2_000_000_000, 2 ** 40]
    for bad in ("1.5K", "k", "12q", "-3"):
        with pytest.raises(ValueError):
            levers.human_readable_int(bad)


def test_tensor_parallel_size_and_its_short_spelling():
    assert config("--tensor-parallel-size", "3").tensor_parallel_size == 3
    assert config("-tp", "3").tensor_parallel_size == 3
    assert config("-tp", "1") == EngineConfig()


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
    for flag, (nargs, reason) in vllm_flags.VLLM_REFUSED.items():
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
                 "--pipeline-parallel-size", "MODEL", "vLLM spellings", "docs/VLLM.md", *vllm_flags.VLLM_REFUSED):
        assert flag in text, f"{flag} missing from minillm serve --help"
    for alias in vllm_flags.VLLM_ALIASES:
        assert "".join(alias.split()) in squeezed, alias


# ------------------------------------------------------------------ bench serve against vLLM's stream shapes
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FIRST_DELAY_S = 0.10    # request arrives -> first token (prefill)
GAP_S = 0.03            # between tokens (one decode step)
SLACK_S = 0.15          # what a busy 2-core machine may add to a delivery
EARLY_S = 0.005         # asyncio.sleep may wake this much before its time on time.perf_counter's clock


class FakeVLLM(AppInThread):
    """An OpenAI server that streams exactly as vLLM 0.11's serving_completion.py / serving_chat.py do, at known
    times. Every request gets max_tokens tokens (ignore_eos), token i's text is " t{i}", FIRST_DELAY_S after
    arrival for token 0 then one token every GAP_S. Options, each a detail of vLLM's streams:

    empty_at:      token i's chunk has text "" (an incomplete UTF-8 character); its text comes with token i + 1
    merged_at:     tokens i and i + 1 in one chunk (the engine's outputs coalesce when the client lags)
    continuous:    usage (running totals) on every chunk, as stream_options.continuous_usage_stats asks
    reasoning:     chat: the first R tokens stream as delta.reasoning_content (a --reasoning-parser model)
    error_every:   every k-th request (1st, k+1-th, ...) fails after 2 tokens: {"error": {...}} then [DONE]

    `sent[n]` is request n's (arrival, [(time, text, num_tokens) per chunk]) on time.perf_counter's clock."""

    name = "the fake vLLM server"

    def __init__(self, first_delay_s=FIRST_DELAY_S, gap_s=GAP_S, empty_at=None, merged_at=None, continuous=False,
                 reasoning=0, error_every=0):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.first_delay_s, self.gap_s = first_delay_s, gap_s
        self.empty_at, self.merged_at, self.continuous = empty_at, merged_at, continuous
        self.reasoning, self.error_every = reasoning, error_every
        self.payloads: list[dict] = []
        self.sent: list[tuple[float, list]] = []

        async def models(request):
            card = {"object": "model", "created": 1764633600, "owned_by": "vllm", "max_model_len": 8192,
                    "permission": [{"id": "modelperm-0", "object": "model_permission", "allow_sampling": True}]}
            return JSONResponse({"object": "list", "data": [
                {**card, "id": BASE_MODEL, "root": BASE_MODEL, "parent": None},
                {**card, "id": "sql-lora", "root": "/adapters/sql", "parent": BASE_MODEL}]})

        async def complete(request):
            body = await request.json()
            arrival = time.perf_counter()
            n = len(self.payloads)
            self.payloads.append(body)
            chunks: list = []
            self.sent.append((arrival, chunks))
            chat = request.url.path.endswith("/chat/completions")
            if body.get("model") != BASE_MODEL:
                return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                               "type": "NotFoundError", "param": None, "code": 404}}, 404)
            return StreamingResponse(self._stream(body, n, chat, chunks), media_type="text/event-stream")

        self._app = Starlette(routes=[Route("/v1/models", models),
                                      Route("/v1/completions", complete, methods=["POST"]),
                                      Route("/v1/chat/completions", complete, methods=["POST"])])

    async def _stream(self, body: dict, n: int, chat: bool, chunks: list):
        num_tokens, prompt_tokens = body["max_tokens"], 11
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and (self.continuous or bool(options.get("continuous_usage_stats")))
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{n:032x}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": 1764633600,
                "model": BASE_MODEL}
        fails = self.error_every and n % self.error_every == 0

        def event(payload: dict, text: str = "", tokens: int = 0) -> str:
            chunks.append((time.perf_counter(), text, tokens))
            return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

        def usage(done: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + done, "completion_tokens": done}

        await asyncio.sleep(self.first_delay_s)
        if chat:   # vLLM sends the role with the first output (exclude_unset: only the fields it set)
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}], "prompt_token_ids": None}
            if continuous:
                first["usage"] = usage(0)
            yield event(first)
        done, pending, i = 0, "", 0
        while i < num_tokens:
            if i:
                await asyncio.sleep(self.gap_s)
            if fails and i == 2:
                error = {"error": {"message": "Request 'x' aborted: KV cache exhausted", "type": "BadRequestError",
                                   "param": None, "code": 400}}
                yield event(error)
                yield "data: [DONE]\n\n"
                return
            take = 2 if i == self.merged_at else 1
            text = pending + "".join(f" t{j}" for j in range(i, i + take))
            pending = ""
            if i == self.empty_at:
                text, pending = "", text
            done += take
            finish = "length" if done == num_tokens else None
            if chat:
                field = "reasoning_content" if i < self.reasoning else "content"
                choice = {"index": 0, "delta": {field: text}, "logprobs": None, "finish_reason": finish,
                          "token_ids": None}
                if finish:
                    choice["stop_reason"] = None
            else:   # completions dump every field (exclude_unset=False): nulls included, usage: null
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                          "prompt_token_ids": None, "token_ids": None}
            payload = {**head, "choices": [choice]}
            if not chat:
                payload["usage"] = None
            if continuous:
                payload["usage"] = {**usage(done), **({} if chat else {"prompt_tokens_details": None})}
            yield event(payload, text, take)
            i += take
        if include_usage:   # exclude_none: the usage chunk has an empty choices list
            yield event({**head, "choices": [], "usage": usage(done)})
        yield "data: [DONE]\n\n"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def implied(self, n: int) -> dict:
        """What request n's stream implies: TTFT, TPOT, ITL sum and counts, from the server's own send times."""
        arrival, chunks = self.sent[n]
        texts = [(t, text) for t, text, _ in chunks if text]
        tokens = sum(k for _, _, k in chunks)
        ttft = texts[0][0] - arrival
        return {"ttft_s": ttft, "itl_sum_s": texts[-1][0] - texts[0][0], "num_text_chunks": len(texts),
                "tokens": tokens, "tpot_s": (chunks[-1][0] - texts[0][0]) / (tokens - 1),
                "text": "".join(text for _, text in texts)}


PROMPTS = [{"prompt": f"question {i}: why is the sky blue?", "output_tokens": 8} for i in range(6)]


def check_against_server(fake: FakeVLLM, result: ServeBenchResult, expect_tokens: int) -> None:
    """Each record's TTFT / TPOT / ITL / tokens equal what the server's send times and counts imply."""
    assert result.failed == 0, result.errors
    by_server_order = sorted(result.records, key=lambda r: r.start_s)
    assert len(fake.sent) == len(by_server_order)
    for n, rec in enumerate(by_server_order):
        implied = fake.implied(n)
        assert rec.usage_reported and rec.output_tokens == implied["tokens"] == expect_tokens
        assert rec.prompt_tokens == 11
        assert rec.num_chunks == implied["num_text_chunks"] and len(rec.itl_s) == rec.num_chunks - 1
        # the client starts its clock before the server's arrival and reads each chunk after it was sent
        assert implied["ttft_s"] <= rec.ttft_s <= implied["ttft_s"] + SLACK_S, (rec.ttft_s, implied)
        assert implied["ttft_s"] >= fake.first_delay_s - EARLY_S
        assert sum(rec.itl_s) == pytest.approx(implied["itl_sum_s"], abs=SLACK_S)
        assert rec.tpot_s == pytest.approx((rec.e2el_s - rec.ttft_s) / (expect_tokens - 1), rel=1e-12)
        assert rec.tpot_s == pytest.approx(implied["tpot_s"], abs=SLACK_S / (expect_tokens - 1))
    assert result.total_output_tokens == expect_tokens * len(result.records)
    assert result.total_input_tokens == 11 * len(result.records)
    assert result.metrics["ttft"]["mean_ms"] >= (fake.first_delay_s - EARLY_S) * 1e3


def test_completions_stream_with_vllms_shapes():
    """usage: null on every chunk, an empty-text chunk, two tokens in one chunk, the final usage chunk with
    "choices": [], data: [DONE]; the model found in a /v1/models list that also holds a LoRA adapter."""
    with FakeVLLM(empty_at=2, merged_at=5) as fake:
        r = bs.run_benchmark(fake.base_url, num_prompts=6, max_concurrency=2, dataset=PROMPTS, progress=False)
    assert r.model == BASE_MODEL and all(p["model"] == BASE_MODEL for p in fake.payloads)
    assert all(p["stream_options"] == {"include_usage": True} and p["max_tokens"] == 8 for p in fake.payloads)
    check_against_server(fake, r, expect_tokens=8)
    for rec in r.records:
        assert rec.num_chunks == 6   # 8 tokens: one chunk had no text, one carried two tokens
        assert rec.text == "".join(f" t{j}" for j in range(8))
        assert rec.tpot_s == pytest.approx(GAP_S * 6 / 7, abs=SLACK_S / 7)   # 7 gaps, one saved by the merge
    assert r.table().count("\n") > 10


def test_continuous_usage_stats_take_the_last_running_total():
    with FakeVLLM(continuous=True) as fake:
        r = bs.run_benchmark(fake.base_url, num_prompts=4, max_concurrency=2, dataset=PROMPTS, progress=False)
    check_against_server(fake, r, expect_tokens=8)   # not the sum of the running totals (36)
    with FakeVLLM(continuous=True) as fake:
        chat = bs.run_benchmark(fake.base_url, endpoint="/v1/chat/completions", num_prompts=2, max_tokens=5,
                                dataset=PROMPTS, progress=False)
    check_against_server(fake, chat, expect_tokens=5)


def test_chat_stream_role_chunk_and_reasoning_deltas():
    """The role-only first chunk is not a token; a reasoning model's thinking (reasoning_content) is output:
    the first token is the first thinking token, and the answer text is the content alone."""
    with FakeVLLM(reasoning=3) as fake:
        r = bs.run_benchmark(fake.base_url, endpoint="/v1/chat/completions", num_prompts=4, max_concurrency=2,
                             max_tokens=7, dataset=PROMPTS, progress=False)
    assert fake.payloads[0]["messages"] == [{"role": "user", "content": fake.payloads[0]["messages"][0]["content"]}]
    check_against_server(fake, r, expect_tokens=7)
    for rec in r.records:
        assert rec.ttft_s < FIRST_DELAY_S + 2 * GAP_S + SLACK_S / 2   # not at the first content token (3 gaps on)
        assert rec.text == " t3 t4 t5 t6" and rec.num_chunks == 7


def test_error_inside_the_stream_fails_that_request_only():
    with FakeVLLM(error_every=3) as fake:
        r = bs.run_benchmark(fake.base_url, num_prompts=6, max_concurrency=1, dataset=PROMPTS, progress=False)
    assert (r.completed, r.failed) == (4, 2)   # requests 0 and 3 in arrival order
    assert r.errors == {"error in the stream: Request 'x' aborted: KV cache exhausted": 2}
    assert r.total_output_tokens == 4 * 8 and r.metrics["ttft"]["mean_ms"] >= (FIRST_DELAY_S - EARLY_S) * 1e3
    failed = [rec for rec in sorted(r.records, key=lambda x: x.start_s) if not rec.success]
    assert [rec.index for rec in failed] == [rec.index for rec in sorted(r.records, key=lambda x: x.start_s)[::3]]


def test_unknown_model_is_vllms_404():
    with FakeVLLM() as fake:
        r = bs.run_benchmark(fake.base_url, "sql-lora-typo", num_prompts=2, dataset=PROMPTS, progress=False)
    assert r.failed == 2 and all(e.startswith("HTTP 404") and "does not exist" in e for e in r.errors)


def test_chunk_text_reads_every_kind_of_delta():
    chat = "/v1/chat/completions"
    assert _chunk_text({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, chat) == ("", "")
    assert _chunk_text({"choices": [{"delta": {"reasoning": "hmm"}}]}, chat) == ("", "hmm")
    call = {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}
    assert _chunk_text({"choices": [{"delta": {"tool_calls": [call]}}]}, chat) == ("", "f{\"a\"")
    assert _chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, "/v1/completions") == ("", "")
    assert _chunk_text({"choices": [{"text": " x", "usage": None}]}, "/v1/completions") == (" x", " x")


def test_compare_servers_runs_each_and_skips_a_missing_vllm():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead_port = sock.getsockname()[1]
    sock.close()
    dead = f"http://127.0.0.1:{dead_port}/v1"
    with FakeVLLM(first_delay_s=0.05, gap_s=0.01) as fast, FakeVLLM(first_delay_s=0.25, gap_s=0.04) as slow:
        c = bs.compare_servers({"fast": fast.base_url, "vllm": dead, "slow": slow.base_url + "/v1"}, num_prompts=4,
                               max_concurrency=2, max_tokens=6, dataset=PROMPTS, progress=False)
        sent = [p["prompt"] for p in fast.payloads], [p["prompt"] for p in slow.payloads]
    assert sorted(sent[0]) == sorted(sent[1])   # the same prompts for each server
    rows = {row["server"]: row for row in c.rows}
    assert [row["server"] for row in c.rows] == ["fast", "vllm", "slow"]
    assert rows["vllm"]["skipped"] and c.notes["vllm"] == rows["vllm"]["note"] == (
        f"no vLLM server at {dead} (vLLM needs a GPU; run `vllm serve HuggingFaceTB/SmolLM2-135M-Instruct "
        f"--port {dead_port}` where one exists)")
    assert set(c.results) == {"fast", "slow"}
    for name, fake in (("fast", fast), ("slow", slow)):
        check_against_server(fake, c.results[name], expect_tokens=6)
        assert rows[name]["ttft_mean_ms"] == c.results[name].metrics["ttft"]["mean_ms"]
        assert rows[name]["total_output_tokens"] == 24 and rows[name]["completed"] == 4
    assert rows["slow"]["ttft_mean_ms"] - rows["fast"]["ttft_mean_ms"] > 150     # 250 ms vs 50 ms prefill
    assert rows["slow"]["tpot_mean_ms"] > rows["fast"]["tpot_mean_ms"] + 20       # 40 ms vs 10 ms a token
    assert rows["fast"]["output_throughput_ratio"] == 1.0
    assert rows["slow"]["output_throughput_ratio"] == pytest.approx(
        rows["slow"]["output_throughput"] / rows["fast"]["output_throughput"])
    text = c.table()
    assert "vllm      skipped: no vLLM server at" in text and text.count("\n") == 5
    json.dumps(c.to_dict())
    other = bs.compare_servers({"mine": dead}, progress=False)
    assert other.notes["mine"].startswith(f"no server answers at {dead} (") and not other.results
    with pytest.raises(ValueError, match="servers=.* is empty"):
        bs.compare_servers({})


def test_bench_serve_cli_compare(capsys):
    with FakeVLLM(first_delay_s=0.02, gap_s=0.005) as fake:
        code = bs.main(["--compare", f"vllm={fake.base_url}", "--num-prompts", "2", "--max-tokens", "3",
                        "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and out.splitlines()[2].split()[:3] == ["vllm", "2", "0"], out
    args = bs.build_parser().parse_args(["--metric-percentiles", "50,99", "--disable-tqdm"])   # vLLM's spellings
    assert (args.percentiles, args.no_progress) == ("50,99", True)
    assert bs.main(["--compare", "nourl"]) == 2
    assert "--compare 'nourl' must be NAME=URL" in capsys.readouterr().err


# ------------------------------------------------------------------ docs/VLLM.md covers every lever, flag and metric
DOC = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "VLLM.md"


def test_vllm_page_maps_every_lever_flag_and_metric():
    from minillm.sampling import SamplingParams
    from minillm.serve.metrics import EngineGauges, ServerMetrics, render_prometheus

    text = DOC.read_text()
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")}
    missing = [f.name for f in dataclasses.fields(EngineConfig)
               if not any(row.startswith(f"`{f.name}`") for row in rows)]
    assert not missing, f"docs/VLLM.md has no row for EngineConfig fields {missing}"
    missing = [f.name for f in dataclasses.fields(SamplingParams) if f"`{f.name}`" not in text]
    assert not missing, f"docs/VLLM.md does not map SamplingParams fields {missing}"
    server = [a.option_strings[0] for g in cli.build_parser()._action_groups if g.title == "server"
              for a in g._group_actions]
    bench = [a.option_strings[0] for a in bs.build_parser()._actions if a.option_strings and a.dest != "help"]
    missing = [flag for flag in server + bench if f"`{flag}" not in text and flag != "--write-dataset"]
    assert not missing, f"docs/VLLM.md does not map the flags {missing}"
    exported = {line.split()[2] for line in render_prometheus("m", EngineGauges(), ServerMetrics()).splitlines()
                if line.startswith("# TYPE")}
    missing = [name for name in exported if f"`{name}`" not in text and f"`{name}{{" not in text]
    assert not missing, f"docs/VLLM.md does not map the metrics {missing}"
    for flag in [*vllm_flags.VLLM_REFUSED, "--speculative-config", "--kv-cache-dtype", "--enable-chunked-prefill",
                 "--gpu-memory-utilization", "--tensor-parallel-size", "compare_servers"]:
        assert f"`{flag}" in text or flag in text, flag
    assert "vLLM 0.11" in text and "99d7eb5d" in text   # the version the page was read from
