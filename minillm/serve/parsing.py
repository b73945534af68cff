"""Request parsing: an OpenAI request body -> ParsedRequest, every refusal a 400 that names the field.

Requests are parsed by hand (not by pydantic models) so that every refusal is a 400 in OpenAI's shape whose
message names the value and the allowed range, reusing the engine's own validation messages. Unset sampling
fields take minillm's SamplingParams defaults: temperature 0 (greedy), top_p 1, top_k off.
OpenAI's sampling fields: temperature, top_p, max_tokens / max_completion_tokens, stop, seed, presence_penalty,
frequency_penalty, logit_bias, logprobs (chat: logprobs=true + top_logprobs; completions: logprobs=N), echo
(completions), response_format (text, json_object, json_schema: structured output through xgrammar), n (the
prompt prefilled once, its KV blocks shared; choice i draws with seed + i), best_of (completions; not streamed).
Extensions beyond them, as vLLM names them: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, return_token_ids, structured_outputs ({"json" | "regex" | "choice" | "grammar": ...}).
user, metadata, store, service_tier and parallel_tool_calls are accepted: they do not change the answer. Any
other field this server does not know or implement is a 400 naming it, never ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..sampling import MAX_LOGPROBS, SamplingParams
from ..structured import FIELDS as STRUCTURED_FIELDS
from ..structured import StructuredOutputs
from .errors import ApiError, bad_type, type_name

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "min_tokens", "logprobs", "structured_outputs", "n", "best_of")
# Fields that would change the answer in a way this server does not implement: refused, not ignored.
UNSUPPORTED = {
    "suffix": "suffix (insertion) is not supported",
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "tool_choice": "tool calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}
COMMON_FIELDS = {"model", "stream", "stream_options", "n", "best_of", "user", "return_token_ids", "metadata", "store",
                 "service_tier", "parallel_tool_calls", "response_format", "structured_outputs", *SAMPLING_FIELDS,
                 *UNSUPPORTED}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "modalities"}


def _int(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_type(name, value, "an integer")
    return value


def _number(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_type(name, value, "a number")
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_type(name, value, "true or false")
    return value


@dataclass
class ParsedRequest:
    kind: str                                   # "completion" | "chat"
    inputs: dict                                # prompt= | prompt_token_ids= | messages= for AsyncEngine
    params: SamplingParams
    fill_context: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: bool = False                      # return logprobs in the response (params.logprobs = top N)
    echo: bool = False                          # completions: the prompt comes back before the completion
    echo_only: bool = False                     # echo with max_tokens=0: score the prompt, generate nothing
    model: str | None = None                    # the `model` the client named (None: the base model)
    lora_request: object | None = None          # the LoRARequest that name selects (--lora-modules); None: base
    prompts: list[dict] | None = None           # completions: every prompt's inputs (a list of prompts); else [inputs]

    def __post_init__(self) -> None:
        if self.prompts is None:
            self.prompts = [self.inputs]


def _sampling(body: dict, max_tokens_field: str, default_max_tokens: int | None) -> tuple[SamplingParams, bool]:
    """SamplingParams from the request's fields; a bad value is a 400 naming the field and its range."""
    max_tokens = _int(body, max_tokens_field)
    if max_tokens_field != "max_tokens" and max_tokens is None:
        max_tokens_field, max_tokens = "max_tokens", _int(body, "max_tokens")
    fill_context = max_tokens is None and default_max_tokens is None
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_type("stop", stop, "a string or a list of strings")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not isinstance(stop_token_ids, list):
        raise bad_type("stop_token_ids", stop_token_ids, "a list of integers")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise bad_type("logit_bias", logit_bias, "an object mapping token ids to biases, like {\"50256\": -100}")
    for key, bias in (logit_bias or {}).items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad_type(f"logit_bias[{json.dumps(key)}]", bias, "a number in [-100, 100]")
    defaults = SamplingParams()
    kwargs = dict(
        max_tokens=1 if fill_context else (max_tokens if max_tokens is not None else default_max_tokens),
        temperature=_number(body, "temperature", defaults.temperature),
        top_p=_number(body, "top_p", defaults.top_p),
        top_k=_int(body, "top_k", defaults.top_k),
        seed=_int(body, "seed"),
        stop=stop,
        stop_token_ids=stop_token_ids or [],
        ignore_eos=_bool(body, "ignore_eos"),
        min_p=_number(body, "min_p", defaults.min_p),
        presence_penalty=_number(body, "presence_penalty", defaults.presence_penalty),
        frequency_penalty=_number(body, "frequency_penalty", defaults.frequency_penalty),
        repetition_penalty=_number(body, "repetition_penalty", defaults.repetition_penalty),
        min_tokens=_int(body, "min_tokens", defaults.min_tokens),
        logit_bias=logit_bias,
        logprobs=_logprobs(body),
        structured_outputs=_structured(body),
        n=_int(body, "n", 1),
        best_of=_int(body, "best_of"),
    )
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = next((f for f in SAMPLING_FIELDS if message.startswith((f + "=", f + "[", f + " ", f + "."))), None)
        if param == "max_tokens":
            param = max_tokens_field
            message = max_tokens_field + message[len("max_tokens"):]
        raise ApiError(message, param, "invalid_value") from None
    return params, fill_context


def _logprobs(body: dict) -> int | None:
    """The number of top logprobs asked for, or None. Chat: logprobs=true with top_logprobs=N (0..20);
    completions: logprobs=N (OpenAI allows 0..5, this server up to 20, as vLLM)."""
    if "messages" in body:
        wanted = _bool(body, "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not wanted:
            raise ApiError(f"top_logprobs={top} needs logprobs=true", "top_logprobs", "invalid_value")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(f"top_logprobs={top} must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs",
                           "invalid_value")
        return (top or 0) if wanted else None
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        raise ApiError("logprobs=true is the chat API's form; completions take logprobs=N, the number of top "
                       f"tokens (0 to {MAX_LOGPROBS})", "logprobs", "invalid_value")
    return _int(body, "logprobs")


def _structured(body: dict) -> StructuredOutputs | None:
    """response_format (OpenAI: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}})
    or structured_outputs (vLLM's extension: {"json" | "regex" | "choice" | "grammar": ...})."""
    response_format, structured = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and structured is not None:
        raise ApiError("give response_format or structured_outputs, not both", "structured_outputs", "invalid_value")
    if structured is not None:
        if not isinstance(structured, dict):
            raise bad_type("structured_outputs", structured, "an object like {\"regex\": \"[0-9]+\"}")
        unknown = sorted(set(structured) - set(STRUCTURED_FIELDS))
        if unknown:
            raise ApiError(f"structured_outputs.{unknown[0]} is not a constraint; give one of "
                           f"{', '.join(STRUCTURED_FIELDS)}", "structured_outputs", "invalid_value")
        try:
            return StructuredOutputs(**structured)
        except ValueError as exc:
            raise ApiError(str(exc), "structured_outputs", "invalid_value") from None
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError("response_format.json_schema.schema is missing: give "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                           "response_format", "invalid_value")
        return StructuredOutputs(json=schema)
    raise ApiError(f"response_format={json.dumps(response_format)[:80]}: type must be \"text\", \"json_object\" "
                   "or \"json_schema\"", "response_format", "invalid_value")


def _unknown_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(f"{unknown[0]} is not a field this server knows (unknown: {', '.join(unknown)}); it would be "
                       "ignored, so it is refused", unknown[0], "unknown_field")


def _common(body: dict, model_name: str, loras: dict | None = None) -> tuple[bool, bool, bool]:
    model = body.get("model")
    if model is not None and model != model_name and model not in (loras or {}):
        served = f"the served model is {model_name!r}" if not loras else \
            f"the served models are {[model_name, *loras]} (the base model and its LoRA adapters)"
        raise ApiError(f"model={json.dumps(model)[:80]} is not served here; {served} (GET /v1/models lists "
                       f"{'them' if loras else 'it'})", "model", "model_not_found")
    if "messages" in body and body.get("best_of") is not None:
        raise ApiError("best_of is a field of /v1/completions; the chat API has n only", "best_of", "unsupported")
    n, best_of = _int(body, "n", 1), _int(body, "best_of")
    if best_of is not None and best_of > n and _bool(body, "stream"):
        raise ApiError(f"best_of={best_of} > n={n} cannot stream: the best choices are known only when all have "
                       "finished (as OpenAI's API)", "best_of", "invalid_value")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False, 0, [], {}):
            raise ApiError(f"{name}={json.dumps(body[name])[:80]}: {why}", name, "unsupported")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_type("stream_options", options, "an object like {\"include_usage\": true}")
    include_usage = _bool(options or {}, "include_usage")
    if options is not None and not stream:
        raise ApiError("stream_options is only allowed with stream=true", "stream_options", "invalid_value")
    return stream, include_usage, _bool(body, "return_token_ids")


def _select_model(req: ParsedRequest, body: dict, loras: dict | None) -> ParsedRequest:
    """The request's `model` picks a LoRA adapter (--lora-modules) or the base model (its own name, or none)."""
    req.model = body.get("model")
    req.lora_request = (loras or {}).get(req.model)
    return req


def parse_completion(body: dict, model_name: str, loras: dict | None = None) -> ParsedRequest:
    if "prompt" not in body:
        raise ApiError("prompt is missing: give a string, a list of token ids, or a list of either", "prompt", "missing_field")
    _unknown_fields(body, COMPLETION_FIELDS)
    stream, include_usage, return_ids = _common(body, model_name, loras)
    original = body
    prompts = _prompts(body["prompt"])
    echo = _bool(body, "echo")
    echo_only = echo and body.get("max_tokens") == 0   # what evaluation harnesses send to score a prompt
    if echo_only:   # one token is generated (a step reads the prompt) and dropped, as vLLM does
        body = {**body, "max_tokens": 1}
    params, fill = _sampling(body, "max_tokens", default_max_tokens=16)  # OpenAI's default for completions
    if echo and params.logprobs is not None:
        params.prompt_logprobs = params.logprobs
    req = ParsedRequest("completion", prompts[0], params, fill, stream, include_usage, return_ids,
                        params.logprobs is not None, echo, echo_only, prompts=prompts)
    return _select_model(req, original, loras)


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt) -> list[dict]:
    """OpenAI's four forms of `prompt`: a string, a list of token ids, a list of strings, a list of token-id
    lists. Each prompt is one engine input ({"prompt": str} or {"prompt_token_ids": [...]}), refused by its place."""
    expected = "a string, a list of token ids, a list of strings or a list of token-id lists"
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not isinstance(prompt, list):
        raise bad_type("prompt", prompt, expected)
    if not prompt:
        raise ApiError(f"prompt is an empty list; give {expected}", "prompt", "invalid_value")
    if _is_ids(prompt):
        return [{"prompt_token_ids": prompt}]
    prompts = []
    for i, one in enumerate(prompt):
        if isinstance(one, str):
            prompts.append({"prompt": one})
        elif isinstance(one, list) and one and _is_ids(one):
            prompts.append({"prompt_token_ids": one})
        elif isinstance(one, list) and not one:
            raise ApiError(f"prompt[{i}] of {len(prompt)} is an empty list of token ids; give at least one token",
                           "prompt", "invalid_value")
        else:
            raise ApiError(f"prompt[{i}] of {len(prompt)} is {json.dumps(one)[:80]} ({type_name(one)}); each prompt "
                           "of a list must be a string or a list of integer token ids", "prompt", "invalid_type")
    return prompts


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(f"messages[{i}].content: only text parts {{\"type\": \"text\", \"text\": ...}} are "
                               f"supported, got {json.dumps(part)[:80]}", "messages", "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_type(f"messages[{i}].content", content, "a string or a list of text parts")


def parse_messages(raw) -> list[dict]:
    """A chat request's `messages` -> [{"role": str, "content": str}], text parts joined; 400 naming the entry."""
    if not isinstance(raw, list):
        raise bad_type("messages", raw, "a list of {\"role\": ..., \"content\": ...} objects")
    if not raw:
        raise ApiError("messages is empty: give at least one message", "messages", "invalid_value")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_type(f"messages[{i}]", m, "an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_type(f"messages[{i}].role", role, "a string such as \"system\", \"user\" or \"assistant\"")
        messages.append({"role": role, "content": _message_text(i, m.get("content"))})
    return messages


def parse_chat(body: dict, model_name: str, loras: dict | None = None) -> ParsedRequest:
    if "messages" not in body:
        raise ApiError("messages is missing: give a list like [{\"role\": \"user\", \"content\": \"Hi\"}]",
                       "messages", "missing_field")
    _unknown_fields(body, CHAT_FIELDS)
    stream, include_usage, return_ids = _common(body, model_name, loras)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ApiError(f"modalities={json.dumps(modalities)[:80]}: only [\"text\"] is supported", "modalities",
                       "unsupported")
    if "messages" not in body:
        raise ApiError("messages is missing: give a list like [{\"role\": \"user\", \"content\": \"Hi\"}]",
                       "messages", "missing_field")
    messages = parse_messages(body["messages"])
    params, fill = _sampling(body, "max_completion_tokens", default_max_tokens=None)
    return _select_model(ParsedRequest("chat", {"messages": messages}, params, fill, stream, include_usage,
                                       return_ids, params.logprobs is not None), body, loras)


def engine_error(exc: Exception, req: ParsedRequest) -> ApiError:
    """The engine's refusal of an admitted request (ValueError / TypeError) as a 400 naming the field."""
    message = str(exc)
    param = next((f for f in SAMPLING_FIELDS if message.startswith((f + "=", f + "[", f + " ", f + "."))), None)
    if param is None:
        param = "messages" if req.kind == "chat" else "prompt"
    return ApiError(message, param, "invalid_value")
