"""Structured output: constrain a request's tokens to a JSON schema, any JSON object, a regex, a choice of strings
or an EBNF grammar, through xgrammar (the grammar library vLLM uses by default).

Each step, before the sampler sees the logits, the request's grammar matcher fills a bitmask of the tokens that
keep the output a valid prefix, and every other token's logit becomes -inf; after the step, the matcher accepts
the sampled token. When the grammar is complete only EOS is allowed, so the request stops there.

    SamplingParams(structured_outputs=StructuredOutputs(json={"type": "object", ...}))   # vLLM's names
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import torch

FIELDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    """Exactly one constraint (vLLM's StructuredOutputsParams): json (a JSON schema, dict or str), json_object=True
    (any JSON object), regex, choice (one of these strings) or grammar (EBNF, xgrammar's dialect)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in FIELDS if _given(self, name)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(FIELDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON schema (an object or its text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex={self.regex!r} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice={self.choice!r} must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"structured_outputs.grammar={self.grammar!r} must be a non-empty EBNF string")

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the compile cache's key)."""
        if self.json is not None:
            return ("json", self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True))
        if self.json_object:
            return ("json_object",)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", tuple(self.choice))
        return ("grammar", self.grammar)


def _given(so: StructuredOutputs, name: str) -> bool:
    value = {"json": so.json, "json_object": so.json_object, "regex": so.regex, "choice": so.choice,
             "grammar": so.grammar}[name]
    return value not in (None, False)


def _choice_regex(choices: list[str]) -> str:
    special = set(r"\.^$*+?{}[]|()/")
    escape = lambda text: "".join("\\" + c if c in special else c for c in text)  # noqa: E731
    return "(" + "|".join(escape(c) for c in choices) + ")"


class GrammarBackend:
    """Compiles constraints for one tokenizer (cached by constraint) and makes a matcher per request; times the
    masks (``mask_s``, ``mask_rows``, ``mask_steps``: the cost of structured output per step)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        try:
            import xgrammar as xgr
        except ImportError as exc:  # pragma: no cover - xgrammar is a dependency
            raise ValueError("structured output needs xgrammar (pip install xgrammar)") from exc
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none (a random-weight preset?)")
        self.xgr = xgr
        stop = sorted(eos_token_ids) or None
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.cache: dict[tuple, object] = {}
        self.vocab_size = vocab_size
        self.mask_s, self.mask_rows, self.mask_steps = 0.0, 0, 0

    def compile(self, so: StructuredOutputs):
        """The compiled grammar (ValueError naming the field for a malformed schema, regex or grammar)."""
        key = so.key
        if key in self.cache:
            return self.cache[key]
        try:
            if so.json is not None:
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                compiled = self.compiler.compile_json_schema(schema)
            elif so.json_object:   # OpenAI's json_object: an object (xgrammar's builtin JSON grammar takes any value)
                compiled = self.compiler.compile_json_schema(json.dumps({"type": "object"}))
            elif so.regex is not None:
                compiled = self.compiler.compile_regex(so.regex)
            elif so.choice is not None:
                compiled = self.compiler.compile_regex(_choice_regex(so.choice))
            else:
                compiled = self.compiler.compile_grammar(so.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types; the client gets the reason
            field = key[0]
            shown = str(key[1])[:120] if len(key) > 1 else ""
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).splitlines()[0] if str(exc) else "invalid")
            raise ValueError(f"structured_outputs.{field}={shown}: cannot be compiled: {reason}") from None
        self.cache[key] = compiled
        return compiled

    def matcher(self, so: StructuredOutputs):
        """A fresh matcher. Speculative decoding advances it through proposals and rolls it back
        (apply_proposals, the draft loop): xgrammar >= 0.2.9's rollback is unlimited (its max_rollback_tokens
        is deprecated, and warns when set), so nothing needs sizing for num_speculative_tokens."""
        return self.xgr.GrammarMatcher(self.compile(so))

    def apply(self, logits: torch.Tensor, matchers: list) -> None:
        """Mask, in place, the rows of [B, V] logits whose matcher is not None."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        t0 = time.perf_counter()
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.info.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        width = min(logits.shape[-1], self.vocab_size)
        self.xgr.apply_token_bitmask_inplace(logits[:, :width] if width != logits.shape[-1] else logits,
                                             bitmask.to(logits.device), indices=rows)
        self._count(t0, len(rows))

    def apply_proposals(self, logits: torch.Tensor, matchers: list, proposals: list[list[int]]) -> None:
        """Speculative verification: sequence i owns len(proposals[i]) + 1 consecutive rows of `logits` [R, V];
        its row j is masked, in place, at its matcher's state after proposals[i][:j] (the matcher accepts the
        proposals one by one and is rolled back at the end, so it is left where it was). From the first proposal
        the grammar refuses (or after the one that terminated it, EOS), the later rows repeat the last mask: that
        token's own row bans it, so neither it nor what follows can be kept. Rows of a None matcher are left."""
        counts = [len(p) + 1 for p in proposals]
        if sum(counts) != logits.shape[0]:
            raise ValueError(f"apply_proposals: {logits.shape[0]} logits rows for proposals needing {sum(counts)}")
        if all(m is None for m in matchers):
            return
        t0 = time.perf_counter()
        bitmask = self.xgr.allocate_token_bitmask(logits.shape[0], self.info.vocab_size)
        rows: list[int] = []
        start = 0
        for matcher, proposal, count in zip(matchers, proposals, counts):
            if matcher is not None:
                advanced, live = 0, True
                try:
                    for j in range(count):
                        if j and live:
                            if matcher.accept_token(proposal[j - 1]):
                                advanced += 1
                                live = not matcher.is_terminated()
                            else:
                                live = False
                        if live:
                            matcher.fill_next_token_bitmask(bitmask, start + j)
                        else:
                            bitmask[start + j] = bitmask[start + j - 1]
                        rows.append(start + j)
                finally:
                    if advanced:
                        matcher.rollback(advanced)
            start += count
        width = min(logits.shape[-1], self.vocab_size)
        self.xgr.apply_token_bitmask_inplace(logits[:, :width] if width != logits.shape[-1] else logits,
                                             bitmask.to(logits.device), indices=rows)
        self._count(t0, len(rows))

    def _count(self, t0: float, rows: int) -> None:
        self.mask_s += time.perf_counter() - t0
        self.mask_rows += rows
        self.mask_steps += 1
