"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP.

    POST /tokenize   {"prompt": "Hello"}                       -> {"tokens": [...], "count": n, "max_model_len": m,
                     {"messages": [...]} (the chat template)        "token_strs": null | [...]}
    POST /detokenize {"tokens": [1, 2, 3]}                     -> {"prompt": "..."}

Fields as vLLM names them: `add_special_tokens` (default true for a prompt, false for messages, whose
template writes its own), `add_generation_prompt` (messages; default true), `return_token_strs`. Every
refusal is a 400 in OpenAI's shape naming the field.
"""

from __future__ import annotations

from .errors import ApiError, bad_type
from .parsing import parse_messages

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_type(name, value, "true or false")
    return value


def _check_fields(body: dict, known: set[str], model_name: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(f"{unknown[0]} is not a field of this endpoint (it takes {', '.join(sorted(known))})",
                       unknown[0], "unknown_field")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(f"model={model!r:.80} is not served here; the served model is {model_name!r}", "model",
                       "model_not_found")


def _tokenizer(llm):
    if llm.tokenizer is None:
        raise ApiError(f"the served model ({llm.engine.model_path}) has no tokenizer", None, "no_tokenizer")
    return llm.tokenizer


def tokenize(llm, body: dict, model_name: str) -> dict:
    """vLLM's TokenizeResponse for a TokenizeCompletionRequest (prompt) or a TokenizeChatRequest (messages)."""
    _check_fields(body, TOKENIZE_FIELDS, model_name)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError("give prompt (a string) or messages (a chat), exactly one of them", "prompt",
                       "missing_field" if "prompt" not in body else "invalid_value")
    tokenizer = _tokenizer(llm)
    return_strs = _flag(body, "return_token_strs", False)
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_type("prompt", prompt, "a string")
        if "add_generation_prompt" in body:
            raise ApiError("add_generation_prompt goes with messages, not prompt", "add_generation_prompt",
                           "invalid_value")
        ids = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        messages = parse_messages(body["messages"])
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError("the served model has no chat template; tokenize a prompt instead", "messages",
                           "invalid_value")
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=_flag(body, "add_generation_prompt", True))
        ids = tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))
    ids = [int(t) for t in ids]
    return {"count": len(ids), "max_model_len": llm.engine.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if return_strs else None}


def detokenize(llm, body: dict, model_name: str) -> dict:
    """vLLM's DetokenizeResponse: the text of `tokens` (special tokens kept, as vLLM)."""
    _check_fields(body, DETOKENIZE_FIELDS, model_name)
    if "tokens" not in body:
        raise ApiError("tokens is missing: give a list of token ids", "tokens", "missing_field")
    tokens = body["tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_type("tokens", tokens, "a list of integer token ids")
    vocab_size = llm.engine.model_config.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(f"tokens[{tokens.index(bad)}]={bad} is not a token id; ids run from 0 to {vocab_size - 1}",
                       "tokens", "invalid_value")
    return {"prompt": _tokenizer(llm).decode(tokens)}
