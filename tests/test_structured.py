"""Structured output (issue 28): JSON schema, JSON object, regex, choice and grammar constraints through xgrammar,
in the engine and through the OpenAI-compatible server (response_format), batched with unconstrained requests."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from conftest import assert_engine_idle
from minillm import SamplingParams, StructuredOutputs
from minillm.serve import serve_in_thread

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                   "city": {"type": "string", "maxLength": 24}, "likes_tea": {"type": "boolean"}},
    "required": ["name", "age", "city", "likes_tea"],
    "additionalProperties": False,
}
SUBJECTS = ["a baker", "a pilot", "a child", "a lighthouse keeper", "a chess player", "a nurse", "a farmer",
            "a painter", "a student", "a sailor", "a judge", "a dancer", "a miner", "a poet", "a chef", "a diver",
            "a monk", "a cyclist", "a librarian", "an astronaut"]


def questions(llm) -> list[str]:
    return [llm.apply_chat_template([{"role": "user", "content": f"Invent {who} and describe them as JSON."}])
            for who in SUBJECTS]


def test_twenty_prompts_follow_a_json_schema_in_one_batch(default_llm):
    """Twenty prompts in one batch (greedy and sampled rows, an unconstrained row among them): every constrained
    answer parses and validates; the grammar's mask is timed per step."""
    llm = default_llm
    so = StructuredOutputs(json=SCHEMA)
    params = [SamplingParams(max_tokens=80, structured_outputs=so, temperature=0.0 if i % 2 else 0.9, seed=i)
              for i in range(len(SUBJECTS))]
    prompts = questions(llm) + ["The capital of France is"]
    outs = llm.generate(prompts, params + [SamplingParams(max_tokens=6)])
    for out in outs[:-1]:
        answer = json.loads(out.outputs[0].text)
        jsonschema.validate(answer, SCHEMA)
        assert out.outputs[0].finish_reason == "stop"
    assert "{" not in outs[-1].outputs[0].text, "the unconstrained row is not masked"
    grammars = llm.engine.runner.grammars
    assert grammars.mask_steps > 0 and grammars.mask_rows >= 20 * 10 and grammars.mask_s > 0
    assert_engine_idle(llm)


@pytest.mark.parametrize("so, check", [
    (StructuredOutputs(choice=["yes", "no", "maybe"]), lambda text: text in ("yes", "no", "maybe")),
    (StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"), lambda text: len(text) == 8 and text[3] == "-"
     and (text[:3] + text[4:]).isdigit()),
    (StructuredOutputs(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    (StructuredOutputs(grammar='root ::= "(" [a-z]+ ")"'), lambda text: text[0] == "(" and text[-1] == ")"
     and text[1:-1].isalpha()),
], ids=["choice", "regex", "json_object", "grammar"])
def test_each_kind_of_constraint(default_llm, so, check):
    """Greedy and sampled: the answer satisfies the constraint and stops when the grammar is complete (a sampled
    free-form JSON object may still be open at max_tokens: then it is a valid start of one)."""
    for temperature in (0.0, 1.0):
        out = default_llm.generate("Is the sea salty? Answer:", SamplingParams(
            max_tokens=40, temperature=temperature, seed=3, structured_outputs=so))[0].outputs[0]
        if out.finish_reason == "length" and so.json_object and temperature > 0:
            assert out.text.lstrip().startswith("{"), out.text
            continue
        assert check(out.text), out.text
        assert out.finish_reason == "stop"


@pytest.mark.parametrize("so, words", [
    (lambda: StructuredOutputs(json={"type": "foo"}), ["structured_outputs.json", "Unsupported type"]),
    (lambda: StructuredOutputs(regex="(unclosed"), ["structured_outputs.regex=(unclosed", "parenthesis"]),
    (lambda: StructuredOutputs(grammar="root ::= "), ["structured_outputs.grammar"]),
    (lambda: StructuredOutputs(regex="a", choice=["b"]), ["exactly one of", "regex, choice"]),
    (lambda: StructuredOutputs(choice=[]), ["choice=[]", "non-empty list"]),
])
def test_a_bad_constraint_is_refused_and_the_engine_serves_on(default_llm, so, words):
    with pytest.raises(ValueError) as info:
        default_llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=so()))
    assert all(w in str(info.value) for w in words), str(info.value)
    assert default_llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"
    assert_engine_idle(default_llm)


def test_a_complete_constraint_ends_the_request_before_min_tokens(default_llm):
    """min_tokens bans EOS, but a choice that is complete allows nothing else: the constraint wins (with
    ignore_eos too, and with speculative decoding), instead of a crash in the matcher."""
    spec = default_llm.with_levers(speculative="ngram")
    for llm in (default_llm, spec):
        for ignore_eos in (False, True):
            out = llm.generate("Is the sea salty? Answer:", SamplingParams(
                max_tokens=12, min_tokens=6, ignore_eos=ignore_eos,
                structured_outputs=StructuredOutputs(choice=["yes", "no"])))[0].outputs[0]
            assert out.text in ("yes", "no") and out.finish_reason == "stop", (out.text, out.finish_reason, out.error)
        assert_engine_idle(llm)


def test_speculative_decoding_follows_a_constraint(default_llm):
    """A speculative engine used to refuse constraints; now each verified position is masked at its own grammar
    state, so the output is the plain engine's (tests/test_speculative_settings.py covers every setting)."""
    spec = default_llm.with_levers(speculative="ngram")
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="[a-z]+"))
    want = default_llm.generate("x", params)[0].outputs[0]
    got = spec.generate("x", params)[0].outputs[0]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert got.text.isalpha() and got.text.islower(), got.text
    assert_engine_idle(spec)


def test_the_server_follows_response_format_for_twenty_prompts_streaming_and_not(default_llm):
    """response_format json_schema through the server: 20 concurrent requests without streaming and 20 with;
    json_object through the official client; a malformed schema or type is a 400 naming response_format."""
    messages = [[{"role": "user", "content": f"Invent {who} and describe them as JSON."}] for who in SUBJECTS]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    async def ask(client, i, stream):
        body = {"messages": messages[i], "max_tokens": 200, "response_format": response_format,
                "temperature": 0.7, "seed": i, "stream": stream}
        if not stream:
            r = await client.post("/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        text = ""
        async with client.stream("POST", "/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
        return text

    async def main(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            return await asyncio.gather(*[ask(client, i, stream) for stream in (False, True)
                                          for i in range(len(SUBJECTS))])

    with serve_in_thread(default_llm, model_name="smollm2") as server:
        answers = asyncio.run(main(server.base_url))
        for i, text in enumerate(answers):
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
            except ValueError as error:
                raise AssertionError(f"answer {i} ({'streamed' if i >= len(SUBJECTS) else 'whole'}): {text!r}") from error
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        tiny = [{"role": "user", "content": 'Is the sea salty? Reply with JSON like {"answer": "..."} and nothing else.'}]
        chat = client.chat.completions.create(model="smollm2", messages=tiny, max_tokens=200,
                                              response_format={"type": "json_object"})
        assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
        choice = client.completions.create(model="smollm2", prompt="Tea or coffee?", max_tokens=5,
                                           extra_body={"structured_outputs": {"choice": ["tea", "coffee"]}})
        assert choice.choices[0].text in ("tea", "coffee")
        for bad, words in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
                            ["Unsupported type"]),
                           ({"type": "xml"}, ['"xml"', "json_schema"]),
                           ({"type": "json_schema"}, ["json_schema.schema is missing"])):
            r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                           json={"messages": messages[0], "response_format": bad})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] in ("response_format", "structured_outputs") and all(
                w in error["message"] for w in words), error
    assert_engine_idle(default_llm)
