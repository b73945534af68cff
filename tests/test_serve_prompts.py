"""minillm.serve: a list of prompts on /v1/completions (OpenAI / vLLM semantics) and vLLM's /tokenize, /detokenize.

One server on the default model for the module; the offline greedy answers it is compared with are
computed before the server takes the engine.
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import assert_engine_idle
from minillm import SamplingParams
from minillm.serve import serve_in_thread

PROMPTS = ["The capital of France is", "Once upon a time, a fox named Luna", "1, 2, 3, 4,"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def offline(default_llm):
    outs = default_llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ids = [default_llm.tokenizer.encode(p) for p in PROMPTS]
    return {"texts": [o.outputs[0].text for o in outs], "prompt_ids": ids}


@pytest.fixture(scope="module")
def server(default_llm, offline):
    with serve_in_thread(default_llm, model_name="smollm2") as handle:
        yield handle
    assert_engine_idle(default_llm)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_list_of_prompts_indexes_choices_prompt_major_with_summed_usage(server, offline):
    body = {"model": "smollm2", "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == list(range(len(PROMPTS) * 2))
    # greedy: both choices of prompt p are offline's answer to prompt p (index = p * n + j)
    assert [c["text"] for c in choices] == [t for t in offline["texts"] for _ in range(2)]
    num_prompt = sum(len(ids) for ids in offline["prompt_ids"])   # each prompt once: its n choices share it
    assert answer["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": len(PROMPTS) * 2 * MAX_TOKENS,
                               "total_tokens": num_prompt + len(PROMPTS) * 2 * MAX_TOKENS}


def test_list_of_token_id_lists_and_mixed_forms_match_text_prompts(server, offline):
    ids = offline["prompt_ids"]
    body = {"prompt": [ids[0], PROMPTS[1], ids[2]], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "return_token_ids": True}
    choices = post(server, "/v1/completions", body).json()["choices"]
    assert [c["text"] for c in choices] == offline["texts"]
    assert all(len(c["token_ids"]) == MAX_TOKENS for c in choices)
    # a single list of ids is one prompt, and a list of one string is one prompt
    one = post(server, "/v1/completions", {"prompt": ids[1], "max_tokens": MAX_TOKENS, "ignore_eos": True}).json()
    assert [c["text"] for c in one["choices"]] == [offline["texts"][1]]
    one = post(server, "/v1/completions", {"prompt": [PROMPTS[2]], "max_tokens": MAX_TOKENS,
                                          "ignore_eos": True}).json()
    assert [(c["index"], c["text"]) for c in one["choices"]] == [(0, offline["texts"][2])]


def test_list_of_prompts_streams_every_choice_with_its_index(server, offline):
    body = {"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, finish, usage = {}, {}, None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line)
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
        usage = chunk.get("usage") or usage
    assert texts == {p * 2 + j: offline["texts"][p] for p in range(len(PROMPTS)) for j in range(2)}
    assert finish == dict.fromkeys(range(6), "length")
    assert usage["completion_tokens"] == 6 * MAX_TOKENS
    assert usage["prompt_tokens"] == sum(len(ids) for ids in offline["prompt_ids"])


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt is an empty list"),
    (["ok", 7], r"prompt\[1\] of 2 is 7 \(integer\)"),
    ([[1, 2], [3, "x"]], r"prompt\[1\] of 2 is \[3, \"x\"\]"),
    ([[1, 2], []], r"prompt\[1\] of 2 is an empty list of token ids"),
    (["fine", "also fine", ""], r"prompt\[2\] of 3: the prompt is empty"),
    (["fine", [1, 49152]], r"prompt\[1\] of 2: .*49152"),
    (["fine", "word " * 9000], r"prompt\[1\] of 2: the prompt has \d+ tokens; the context \(max_model_len\) is 8192"),
])
def test_a_bad_prompt_refuses_the_whole_list_and_queues_nothing(server, default_llm, prompt, message):
    import re

    before = httpx.get(server.url + "/metrics").text
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
    assert re.search(message, error["message"]), error["message"]
    engine = default_llm.engine
    assert not engine.scheduler.waiting and not engine.scheduler.running   # nothing was queued
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert "minillm_num_requests_waiting{model_name=\"smollm2\"} 0" in before
    # the server keeps serving
    ok = post(server, "/v1/completions", {"prompt": ["Hi", "Yo"], "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_tokenize_and_detokenize_as_vllm(server, default_llm):
    tokenizer = default_llm.tokenizer
    text = "Hello, world! The capital of France is Paris."
    r = post(server, "/tokenize", {"model": "smollm2", "prompt": text})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert r.json() == {"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}
    strs = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(ids) and len(strs) == len(ids)
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": text}
    # messages go through the chat template, with the generation prompt by default (as the chat endpoint)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == default_llm.chat_token_ids(messages)
    assert chat["count"] == len(chat["tokens"])
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]
    text_back = post(server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text_back == default_llm.apply_chat_template(messages)


@pytest.mark.parametrize("path, body, param, message", [
    ("/tokenize", {}, "prompt", "give prompt .* or messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": 5}, "prompt", "prompt=5 must be a string"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "true or false"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "goes with messages"),
    ("/tokenize", {"messages": []}, "messages", "messages is empty"),
    ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate", "not a field of this endpoint"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", "not served here"),
    ("/detokenize", {}, "tokens", "tokens is missing"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "a list of integer token ids"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", r"tokens\[1\]=-1 is not a token id; ids run from 0 to 49151"),
])
def test_tokenize_errors_name_the_field(server, path, body, param, message):
    import re

    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error


def test_lm_eval_loglikelihood_batch_of_four_matches_one_at_a_time(server, offline):
    """What `lm_eval --model local-completions --batch_size 4` sends to score continuations (tokenized requests,
    echo, logprobs=1, max_tokens=1, seed): the batch's choices, sorted by index, score as the prompts do alone."""
    ids = offline["prompt_ids"]
    batch = [ids[0], ids[1], ids[2], ids[0] + ids[2]]
    body = {"model": "smollm2", "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    together = post(server, "/v1/completions", body).json()["choices"]
    assert [c["index"] for c in together] == [0, 1, 2, 3]
    for prompt, choice in zip(batch, together):
        alone = post(server, "/v1/completions", {**body, "prompt": prompt}).json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(alone["logprobs"]["token_logprobs"][1:], abs=1e-4)
        assert lp["tokens"] == alone["logprobs"]["tokens"]
