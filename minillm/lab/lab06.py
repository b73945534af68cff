"""Lab 06 helpers — prefix caching: checks for the block hash chain, the cache lookup, the engine's
hash link, the reading-time measurement and the hosted-API pricing; CountedLink, which hands the
learner's hash_link to the engine's BlockManager (counting its calls, a crash naming the call); the
prompts, tables and figures of the notebook's experiments (the shared document, the one-word edit,
the eviction sweep: their code is in the notebook).

The learner writes, with fixed signatures:

    block_hashes(token_ids, block_size, salt=None) -> list[key]     # one hashable key per FULL block
    lookup(cache, keys) -> list[block_id]                            # the run of hits from the start
    reusable_blocks(cache, token_ids, block_size, salt=None) -> list[block_id]   # <= (len - 1) // block_size
    hash_link(parent_key, block_token_ids, salt) -> key              # one link of the chain: the engine's hash_fn
    cached_cost(prefix_tokens, suffix_tokens, n_requests, write=1.25, read=0.1) -> float

and the measurement reading_off, reading_on, saving (sums of TTFT, 1 - on / off) and the short answer
answer_break_even (the fewest requests for which the prompt cache is cheaper).

Keys are the learner's own (ints, tuples, bytes...): the checks never compare them with the
engine's SHA-256 keys, only with each other — two prompts must get equal keys for block i exactly
when their first (i + 1) * block_size tokens and their salts are equal.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence

from .common import CheckFailed, call_learner, expect_number, format_seconds, is_close, new_figure, passed
from .common import chat_prompts, echo_prediction, print_beside_reference  # noqa: F401 - the notebook calls them as lab06.*

# What the sources measured on a laptop: ten questions about one long document, total reading
# (prefill) time without and with a kept prefix; and the re-read cost after changing one word at
# 25 / 50 / 75 % of the prompt, relative to the first read.
SOURCE_READING_S = {"off": 144.0, "on": 15.2}
SOURCE_SENSITIVITY = {0.25: 0.78, 0.5: 0.55, 0.75: 0.28}
# Hosted-API prompt-cache pricing, as multiples of the input-token price.
CACHE_WRITE, CACHE_READ = 1.25, 0.1


# =================================================================== A. the hash chain
_call = call_learner   # lab/common.py


def _keys_of(block_hashes: Callable, token_ids: Sequence[int], block_size: int, salt: str | None) -> list:
    call = f"block_hashes({_ids(token_ids)}, {block_size}, salt={salt!r})"
    keys = _call(block_hashes, (list(token_ids), block_size, salt), call)
    if not isinstance(keys, (list, tuple)):
        raise CheckFailed(f"{call} returned {type(keys).__name__}; expected a list of keys, one per full block")
    full = len(token_ids) // block_size
    if len(keys) != full:
        hint = ""
        if len(keys) == -(-len(token_ids) // block_size):
            hint = (" — the partial last block has no key: only full blocks are cached (a partial block's K/V "
                    "is still being written, and the next request's block there holds other tokens)")
        elif len(keys) == len(token_ids):
            hint = " — one key per block of block_size tokens, not one per token"
        raise CheckFailed(f"{call} returned {len(keys)} keys; expected {full} "
                          f"({len(token_ids)} tokens = {full} full blocks of {block_size}){hint}")
    for i, key in enumerate(keys):
        try:
            hash(key)
        except TypeError:
            raise CheckFailed(f"{call}: key {i} is a {type(key).__name__}, which cannot be a dict key; return "
                              "hashable keys (a tuple, an int, a str or bytes), not lists") from None
    again = _call(block_hashes, (list(token_ids), block_size, salt), call)
    if list(again) != list(keys):
        raise CheckFailed(f"{call} gave different keys when called twice with the same arguments: a key must "
                          "depend only on the tokens and the salt (no id(), no random numbers, no counters)")
    return list(keys)


def _ids(token_ids: Sequence[int]) -> str:
    ids = list(token_ids)
    return repr(ids) if len(ids) <= 8 else f"[{', '.join(map(str, ids[:4]))}, ... ({len(ids)} tokens)]"


def _hash_cases(block_size: int, seed: int) -> list[tuple[str, list[int], str | None]]:
    """Prompts that share starts of every length, differ in one token, repeat a block, permute a
    block, carry different salts — and end in partial blocks of every length."""
    rng = random.Random(seed)
    bs = block_size
    base = [rng.randrange(1, 50_000) for _ in range(6 * bs + 1)]
    cases = [("base", base, None), ("base, first 3 blocks", base[:3 * bs], None),
             ("base minus its last token", base[:-1], None)]
    for i in (0, 2, 4):   # one token changed inside block i
        edited = list(base)
        edited[i * bs + rng.randrange(bs)] += 1
        cases.append((f"base with one token changed in block {i}", edited, None))
    block = [rng.randrange(1, 50_000) for _ in range(bs)]
    cases.append(("one block repeated three times", block * 3, None))
    cases.append(("the repeated block once, then base", block + base[:2 * bs], None))
    if bs > 1:
        cases.append(("base with its block 1 reversed", base[:bs] + base[bs:2 * bs][::-1] + base[2 * bs:4 * bs], None))
    cases.append(("base, new tail", base[:3 * bs] + [rng.randrange(1, 50_000) for _ in range(2 * bs + bs // 2)], None))
    for salt in ("tenant-a", "tenant-b", ""):
        cases.append((f"base, salt {salt!r}", base[:4 * bs], salt))
    return cases


def _why_equal(a, b, i: int, bs: int) -> str:
    """Why block i's keys of prompts a and b must differ, and the likely mistake behind equal keys."""
    (name_a, ids_a, salt_a), (name_b, ids_b, salt_b) = a, b
    own_a, own_b = ids_a[i * bs:(i + 1) * bs], ids_b[i * bs:(i + 1) * bs]
    if ids_a[:(i + 1) * bs] == ids_b[:(i + 1) * bs]:
        return (f"their tokens agree but the salts differ ({salt_a!r} vs {salt_b!r}) — the salt must enter the "
                "key (the first block's at least: the chain carries it on), or two tenants share a cache")
    if own_a == own_b:
        return (f"block {i} holds the same tokens in both, but an earlier block differs — each key must cover its "
                "parent's key: hash (parent key, this block's tokens, salt), not the block alone, or a block "
                "would be served after a different start (its K/V depends on every token before it)")
    if sorted(own_a) == sorted(own_b):
        return (f"block {i} holds the same tokens in another order ({own_a} vs {own_b}) — hash the tokens in "
                "order (a tuple), not their sum or set")
    return f"block {i} differs ({own_a} vs {own_b}) — two different prefixes collided"


def _compare_keys(cases: list, keys: list[list], bs: int) -> int:
    """Key i of cases a and b must be equal exactly when their first (i + 1) * bs tokens and their salts
    are equal (None and "" are different salts); the number of pairs compared."""
    num_pairs = 0
    for x in range(len(cases)):
        for y in range(x + 1, len(cases)):
            a, b = cases[x], cases[y]
            for i in range(min(len(keys[x]), len(keys[y]))):
                num_pairs += 1
                same = a[1][:(i + 1) * bs] == b[1][:(i + 1) * bs] and a[2] == b[2]
                equal = keys[x][i] == keys[y][i]
                if same and not equal:
                    hint = ("a key must depend only on the blocks up to it and the salt"
                            if a[2] == b[2] else "")
                    if a[1][:(i + 1) * bs] == b[1][:(i + 1) * bs] and len(a[1]) != len(b[1]):
                        hint = ("the prompts share their first blocks but differ in length or later tokens — a key "
                                "may not depend on anything after its own block (the rest of the prompt, its length)")
                    raise CheckFailed(f"block {i} ({bs} tokens a block): {a[0]!r} and {b[0]!r} have equal tokens up to "
                                      f"the end of block {i} but different keys — {hint}")
                if equal and not same:
                    raise CheckFailed(f"block {i} ({bs} tokens a block): {a[0]!r} and {b[0]!r} got the same key, but "
                                      + _why_equal(a, b, i, bs))
    return num_pairs


def check_block_hashes(block_hashes: Callable, block_size: int = 4, seed: int = 0) -> None:
    """Keys agree exactly where prompts agree: key i of prompts a and b are equal iff their first
    (i + 1) * block_size tokens and their salts are equal. One key per full block, hashable, stable."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    bs = block_size
    for n in (0, 1, bs - 1, bs, bs + 1, 3 * bs - 1, 3 * bs):
        if n >= 0:
            _keys_of(block_hashes, list(range(7, 7 + n)), bs, None)
    cases = _hash_cases(bs, seed)
    keys = [_keys_of(block_hashes, ids, bs, salt) for _, ids, salt in cases]
    default = _call(block_hashes, (list(cases[0][1]), bs), f"block_hashes({_ids(cases[0][1])}, {bs})")
    if list(default) != keys[0]:
        raise CheckFailed(f"block_hashes(ids, {bs}) and block_hashes(ids, {bs}, salt=None) differ: salt defaults to None")
    num_pairs = _compare_keys(cases, keys, bs)
    passed("block_hashes", num_pairs)


SALT_CASES = (  # (salt a, salt b, what it shows)
    ("alice", "alice", "the same tenant: the same keys"),
    ("alice", "bob", "two tenants: every key differs, not only the first"),
    (None, "bob", "no salt and a salt"),
    (None, "", "salt None (no salt) and salt '' (an empty salt): different salts"),
    ("", "alice", "an empty salt and a salt"),
)


def check_block_hashes_salt(block_hashes: Callable, block_size: int = 4) -> None:
    """One 4-block prompt under pairs of salts: equal salts give equal keys, different salts (None and ""
    included: the reference and the engine's SHA-256 keep them apart) give different keys for every block."""
    ids = list(range(100, 100 + 4 * block_size + 1))
    for salt_a, salt_b, why in SALT_CASES:
        a = _keys_of(block_hashes, ids, block_size, salt_a)
        b = _keys_of(block_hashes, ids, block_size, salt_b)
        call = f"block_hashes({_ids(ids)}, {block_size}, salt=...)"
        if salt_a == salt_b and a != b:
            raise CheckFailed(f"{call} with salt {salt_a!r} twice gave different keys ({why})")
        if salt_a != salt_b:
            shared = [i for i in range(len(a)) if a[i] == b[i]]
            if shared:
                hint = ""
                if {salt_a, salt_b} == {None, ""}:
                    hint = (" — compare the salt with `is None`, not its truth value: an empty salt is still a salt "
                            "(`salt or None` makes '' and None one tenant)")
                elif len(shared) < len(a):
                    hint = " — the salt must reach every key: put it in each link (or let the chain carry it on)"
                else:
                    hint = " — the salt must enter the key, or two tenants share a cache"
                raise CheckFailed(f"{call}: salt {salt_a!r} and salt {salt_b!r} gave equal keys for blocks {shared} "
                                  f"({why}){hint}")
    passed("block_hashes with salts", len(SALT_CASES))


def reference_block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """One of many correct answers: Python's hash of (parent key, block tokens, salt)."""
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size]), salt))
        keys.append(parent)
    return keys


# =================================================================== B. the lookup
def reference_lookup(cache: dict, keys: Sequence[Hashable]) -> list[int]:
    blocks = []
    for key in keys:
        if key not in cache:
            break
        blocks.append(cache[key])
    return blocks


LOOKUP_CASES = (  # (cache, keys, what it shows)
    ({"k0": 7, "k1": 3, "k2": 12}, ["k0", "k1", "k2"], "every block cached: their ids, in the keys' order"),
    ({"k0": 7, "k1": 3, "k3": 12}, ["k0", "k1", "k2", "k3"], "a miss at block 2: stop there, even though block 3 hits"),
    ({"k1": 3, "k2": 12}, ["k0", "k1", "k2"], "the first block misses: nothing is reusable"),
    ({"k0": 7}, [], "no keys (a prompt shorter than one block)"),
    ({}, ["k0", "k1"], "an empty cache"),
    ({"k0": 0, "k1": 5, "x": 9, "k2": 1}, ["k0", "k1"], "more cached blocks than keys: only the keys asked for"),
)


def check_lookup(lookup: Callable, cases=LOOKUP_CASES) -> None:
    for cache, keys, why in cases:
        call = f"lookup({cache}, {keys})"
        got = _call(lookup, (dict(cache), list(keys)), call)
        want = reference_lookup(cache, keys)
        if not isinstance(got, (list, tuple)) or list(got) != want:
            hint = ""
            hits = [cache[k] for k in keys if k in cache]
            if isinstance(got, (list, tuple)) and list(got) == hits and hits != want:
                hint = (" — stop at the first miss: block i's K/V was computed after blocks 0..i-1, so a hit after a "
                        "miss is useless (the blocks before it would be recomputed, and with them block i)")
            elif isinstance(got, (list, tuple)) and list(got) == list(keys)[:len(want)]:
                hint = " — return the cached block ids (cache[key]), not the keys"
            elif isinstance(got, (list, tuple)) and sorted(got) == sorted(want):
                hint = " — keep the keys' order: block i of the prompt is the i-th block id"
            raise CheckFailed(f"{call} returned {got!r}, expected {want} ({why}){hint}")
    passed("lookup", len(cases))


def check_reusable_blocks(reusable_blocks: Callable, block_hashes: Callable, block_size: int = 4,
                          seed: int = 0) -> None:
    """A cache filled with one earlier request's blocks (keys from your block_hashes), then prompts
    that share its start, diverge, end on a block boundary, carry a salt."""
    rng = random.Random(seed)
    bs = block_size
    first = [rng.randrange(1, 50_000) for _ in range(6 * bs + bs // 2 + 1)]   # 6 full blocks + a partial one
    num_cases = 0
    for cache_salt in (None, "tenant-a"):
        first_keys = _keys_of(block_hashes, first, bs, cache_salt)
        cache = {key: 100 + 3 * i for i, key in enumerate(first_keys)}   # block ids the engine handed out
        doc = first[:4 * bs]
        diverge = list(first)
        diverge[2 * bs + rng.randrange(bs)] += 1
        cases = [
            (first, "the same prompt again: every full block its last token is not in"),
            (doc + [1, 2, 3], "the 4-block document, then another question"),
            (doc, "exactly the 4-block document: its last token must be computed, so its last block too"),
            (first[:6 * bs], "exactly 6 full blocks: the last one holds the last token"),
            (first[:6 * bs + 1], "6 full blocks and one more token: all 6 come from the cache"),
            (diverge, "one token changed in block 2: blocks 0 and 1 only"),
            (first[:1], "one token: nothing"),
        ]
        for ids, why in cases:
            for salt in (None, "tenant-a"):
                call = f"reusable_blocks(cache, {_ids(ids)}, {bs}, salt={salt!r})"
                got = _call(reusable_blocks, (dict(cache), list(ids), bs, salt), call)
                limit = (len(ids) - 1) // bs
                same = 0
                while same < min(limit, len(first_keys)) and ids[:(same + 1) * bs] == first[:(same + 1) * bs]:
                    same += 1
                want = [100 + 3 * i for i in range(same)] if salt == cache_salt else []
                num_cases += 1
                if not isinstance(got, (list, tuple)) or list(got) != want:
                    hint = ""
                    full = min(len(ids) // bs, len(first_keys))
                    if isinstance(got, (list, tuple)) and len(got) == full > len(want) and salt == cache_salt:
                        hint = (f" — at least the last prompt token must be computed: the model needs its logits to "
                                f"pick the first output token, so at most (len(token_ids) - 1) // block_size = {limit} "
                                "blocks come from the cache")
                    elif salt != cache_salt and got:
                        hint = " — pass the salt on to block_hashes: another tenant's blocks must not match"
                    raise CheckFailed(f"{call} with the cache of an earlier {len(first)}-token request "
                                      f"(salt {cache_salt!r}) returned {got!r}, expected {want} ({why})" + hint)
    passed("reusable_blocks", num_cases)


# =================================================================== C. the engine on your hash link
def reference_hash_link(parent_key: Hashable | None, block_token_ids: Sequence[int], salt: str | None) -> int:
    """One of many correct answers: the reference chain's link, Python's hash of (parent key, tokens, salt)."""
    return hash((parent_key, tuple(block_token_ids), salt))


def _link_call(parent, i: int, block: Sequence[int], salt) -> str:
    parent_text = "None" if parent is None else f"<key of block {i - 1}>"
    return f"hash_link({parent_text}, {_ids(block)}, {salt!r})"


def _link_chain(hash_link: Callable, token_ids: Sequence[int], bs: int, salt: str | None) -> list:
    """The keys of a prompt's full blocks, link by link, as the engine computes them."""
    keys, parent = [], None
    for i in range(len(token_ids) // bs):
        block = tuple(token_ids[i * bs:(i + 1) * bs])
        call = _link_call(parent, i, block, salt)
        key = _call(hash_link, (parent, block, salt), call)
        try:
            hash(key)
        except TypeError:
            raise CheckFailed(f"{call} returned a {type(key).__name__}, which cannot be a dict key; return a hashable "
                              "key (an int, a tuple, bytes), not a list") from None
        if key is None:
            raise CheckFailed(f"{call} returned None: None is the parent of a first block, not a key")
        if _call(hash_link, (parent, block, salt), call) != key:
            raise CheckFailed(f"{call} gave different keys when called twice: a key must depend only on the parent "
                              "key, the tokens and the salt")
        keys.append(key)
        parent = key
    return keys


def check_hash_link(hash_link: Callable, block_size: int = 4, seed: int = 0) -> None:
    """The engine calls hash_fn(parent_key, block_token_ids, salt) once per full block, the parent being
    the previous block's key (None for block 0). Chained that way, the keys of prompts a and b must agree
    for block i exactly when their first (i + 1) * block_size tokens and their salts agree."""
    cases = _hash_cases(block_size, seed)
    keys = [_link_chain(hash_link, ids, block_size, salt) for _, ids, salt in cases]
    num_pairs = _compare_keys(cases, keys, block_size)
    passed("hash_link", num_pairs)


class CountedLink:
    """The BlockManager's `hash_fn`: your `hash_link`, called through call_learner (a crash names the
    call), counting its calls."""

    def __init__(self, hash_link: Callable):
        self.hash_link = hash_link
        self.num_calls = 0

    def __call__(self, parent: Hashable | None, token_ids: tuple[int, ...], salt: str | None) -> Hashable:
        self.num_calls += 1
        parent_text = "None" if parent is None else "<parent key>"
        return _call(self.hash_link, (parent, tuple(token_ids), salt),
                     f"hash_link({parent_text}, {_ids(token_ids)}, {salt!r}) (called by the engine)")


def sibling_prompts(block_size: int = 8) -> list[dict]:
    """Three prompts whose blocks 1-2 repeat under a different block 0 (A = X Y Z .., B = W Y Z .., C = W Y Z ..):
    C must find B's three blocks. A link that ignores its parent keys Y and Z of B like A's, the engine
    refuses those keys for B (they are A's blocks), and C finds only W."""
    bs = block_size
    x, w = [11 + i for i in range(bs)], [900 + i for i in range(bs)]
    yz = [300 + 7 * i for i in range(2 * bs)]
    return [{"prompt_token_ids": x + yz + [5]}, {"prompt_token_ids": w + yz + [6, 7]},
            {"prompt_token_ids": w + yz + [8, 9, 10]}]


def system_conversations(system: str, questions: Sequence[str]) -> list[list[dict]]:
    """One conversation per question, each after the same system prompt (for chat_prompts)."""
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]


def print_hash_run(result: dict) -> None:
    verdict = "✓ the same tokens as with the cache off" if result["equal"] else "✗ tokens differ from the cache off"
    print(f"{verdict} ({len(result['tokens'])} requests, one after another, block_size={result['block_size']})")
    print(f"{'request':>8}{'prompt tokens':>15}{'cached (yours)':>16}{'cached (engine)':>17}  output")
    for i, (n, c, e, text) in enumerate(zip(result["prompt_tokens"], result["cached_tokens"],
                                            result["expected_cached_tokens"], result["text"])):
        print(f"{i:>8}{n:>15}{c:>16}{e:>17}  {text!r}")
    print(f"your hash_link ran {result['hash_calls']} times "
          "(once per full block of each request: the engine keeps a request's keys)")


def check_hash_run(result: dict) -> None:
    if not result["equal"]:
        raise CheckFailed(f"with your hash_link the engine generated {result['tokens']}, with the cache off "
                          f"{result['expected']}: a block was served after a different start — check that each key "
                          "covers its parent's key")
    if result["cached_tokens"] != result["expected_cached_tokens"]:
        hint = ""
        if any(c < e for c, e in zip(result["cached_tokens"], result["expected_cached_tokens"])):
            hint = (" — a request found fewer cached tokens: if a block repeats under another first block, a key that "
                    "ignores its parent equals the other prompt's key, the engine refuses it (that key holds another "
                    "block, after another parent), and later requests lose the rest of their start; each key must "
                    "cover its parent's key")
        raise CheckFailed(f"cached prompt tokens per request: {result['cached_tokens']} with your hash_link, "
                          f"{result['expected_cached_tokens']} with the engine's SHA-256 chain — equal prefixes must "
                          "give equal keys (and different ones different keys)" + hint)
    if not any(result["cached_tokens"]):
        raise CheckFailed("no request found a cached block: the prompts share a system prompt, so later ones should")
    passed("the engine on your hash chain", len(result["tokens"]))


# =================================================================== D. measurements
def document_ids(llm, num_tokens: int, offset: int = 0) -> list[int]:
    """`num_tokens` token ids of data/corpus.txt from token `offset` on (no BOS)."""
    from ..bench.workloads import shipped_corpus

    ids = llm.tokenizer.encode(shipped_corpus(), add_special_tokens=False)
    if offset + num_tokens > len(ids):
        raise ValueError(f"num_tokens={num_tokens} from offset={offset}: the corpus has only {len(ids)} tokens")
    return ids[offset:offset + num_tokens]


def document_questions(llm, doc: Sequence[int], num_questions: int) -> list[dict]:
    """The document, then 'Question k: ...' from data/prompts.txt (token ids: the document is the
    very same tokens in every prompt)."""
    from ..bench.workloads import shipped_prompts

    questions = shipped_prompts()
    return [{"prompt_token_ids": list(doc) + llm.tokenizer.encode(
        f"\n\nQuestion {i + 1}: {questions[i % len(questions)]}\nAnswer:", add_special_tokens=False)}
        for i in range(num_questions)]


def reading_s(rows: Sequence[dict]) -> float:
    """Total time to first token over requests sent one after another: the time spent reading prompts
    (for the printouts and the check; the learner computes it in the notebook)."""
    return sum(r["ttft_s"] for r in rows)


def print_shared_document(result: dict) -> None:
    """The raw rows, question by question (the totals are the learner's measurement)."""
    off, on = result["off"], result["on"]
    n = result["num_questions"]
    print(f"{n} questions about one document, one after another — {result['device']}")
    print(f"{'question':>9}{'prompt tokens':>15}{'TTFT off':>11}{'TTFT on':>11}{'from the cache (on)':>21}")
    for i, (a, b) in enumerate(zip(off, on)):
        print(f"{i:>9}{a['prompt_tokens']:>15}{format_seconds(a['ttft_s']):>11}{format_seconds(b['ttft_s']):>11}"
              f"{b['cached_tokens']:>21}")
    print(f"greedy outputs identical: {result['identical']}/{n}")


def print_reading(result: dict, reading_off: float, reading_on: float) -> None:
    """The learner's totals beside the tokens read and the sources' laptop."""
    for label, rows, total in (("off", result["off"], reading_off), ("on", result["on"], reading_on)):
        read = sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows)
        print(f"prefix_caching={label:<4} reading {format_seconds(total):>9}  ({read} prompt tokens computed, "
              f"{sum(r['cached_tokens'] for r in rows)} from the cache)")
    print(f"reading with the cache: {reading_on / reading_off:.1%} of without "
          f"(the sources' laptop, ten questions: {SOURCE_READING_S['off']:.0f} s -> {SOURCE_READING_S['on']} s, "
          f"{SOURCE_READING_S['on'] / SOURCE_READING_S['off']:.1%})")


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise CheckFailed(f"{name} is {value!r} ({type(value).__name__}); expected a number")
    return float(value)


def shared_document_figure(result: dict):
    fig = new_figure("Time to first token, question by question", "question", "TTFT (s)", device=result["device"])
    x = list(range(1, result["num_questions"] + 1))
    for label, color in (("off", "#d62728"), ("on", "#1f77b4")):
        rows = result[label]
        fig.add_bar(x=x, y=[r["ttft_s"] for r in rows], name=f"prefix_caching={label == 'on'} "
                    f"(reading {format_seconds(reading_s(rows))})", marker_color=color)
    fig.update_layout(barmode="group")
    return fig


def edit_one_token(llm, ids: Sequence[int], position: int) -> list[int]:
    """`ids` with the token at `position` replaced by another word (' banana', or ' apple' if it was that)."""
    banana = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    apple = llm.tokenizer.encode(" apple", add_special_tokens=False)[0]
    edited = list(ids)
    edited[position] = apple if edited[position] == banana else banana
    return edited


def print_sensitivity(result: dict, predicted: dict | None = None) -> None:
    print(f"a {result['num_tokens']}-token prompt read once in {format_seconds(result['first_s'])}, then re-read "
          f"with one word changed — {result['device']}")
    print(f"{'word changed at':>16}{'re-read':>10}{'relative':>10}{'tokens recomputed':>19}{'sources':>9}{'you predicted':>15}")
    for f in result["fractions"]:
        guess = (predicted or {}).get(f)
        print(f"{f:>16.0%}{format_seconds(result['reread_s'][f]):>10}{result['relative'][f]:>10.2f}"
              f"{result['computed'][f]:>19.1%}{SOURCE_SENSITIVITY.get(f, float('nan')):>9.2f}"
              f"{'' if guess is None else f'{guess:.2f}':>15}")


def sensitivity_figure(result: dict, predicted: dict | None = None):
    fig = new_figure("Re-read cost after changing one word", "where the word changed (fraction of the prompt)",
                     "re-read time / first read", device=result["device"])
    x = [f"{f:.0%}" for f in result["fractions"]]
    fig.add_bar(x=x, y=[result["relative"][f] for f in result["fractions"]], name="measured (TTFT ratio)",
                marker_color="#1f77b4")
    fig.add_bar(x=x, y=[result["computed"][f] for f in result["fractions"]], name="tokens recomputed (share)",
                marker_color="#aec7e8")
    fig.add_bar(x=x, y=[SOURCE_SENSITIVITY.get(f) for f in result["fractions"]], name="the sources' laptop",
                marker_color="#7f7f7f")
    if predicted and any(predicted.get(f) is not None for f in result["fractions"]):
        fig.add_scatter(x=x, y=[predicted.get(f) for f in result["fractions"]], mode="markers", name="your prediction",
                        marker=dict(symbol="x", size=14, color="#d62728"))
    fig.update_layout(barmode="group", yaxis_range=[0, 1.1])
    return fig


def eviction_figure(rows: Sequence[dict], device: str):
    fig = new_figure("Two documents taking turns in a small KV pool", "KV pool size (documents' worth of blocks)",
                     "prompt tokens served from the cache", device=device)
    fig.add_scatter(x=[r["pool_docs"] for r in rows], y=[r["hit_rate"] for r in rows], mode="lines+markers",
                    name="hit rate, requests 3..")
    fig.add_vline(x=2, line_dash="dot", annotation_text="both documents fit")
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    return fig


# =================================================================== E. hosted-API pricing
def reference_cached_cost(prefix_tokens: int, suffix_tokens: int, n_requests: int, write: float = CACHE_WRITE,
                          read: float = CACHE_READ) -> float:
    if n_requests <= 0:
        return 0.0
    return prefix_tokens * write + (n_requests - 1) * prefix_tokens * read + n_requests * suffix_tokens


COST_CASES = (  # (args, kwargs, what it shows)
    ((10_000, 0, 10), {}, "the example: 12,500 to write once, 9 x 1,000 to read"),
    ((10_000, 200, 10), {}, "each question's own 200 tokens are billed at the normal price"),
    ((2_000, 50, 1), {}, "one request: the write costs more than no cache at all"),
    ((1_000, 30, 0), {}, "no requests, no bill"),
    ((0, 100, 5), {}, "no shared start: plain input tokens"),
    ((1_000, 10, 4), {"write": 1.0, "read": 0.5}, "other prices: use write and read"),
)


def check_cached_cost(cached_cost: Callable, cases=COST_CASES) -> None:
    for args, kwargs, why in cases:
        got = _call(lambda *a: cached_cost(*a, **kwargs), args, f"cached_cost{args}")
        want = reference_cached_cost(*args, **kwargs)
        prefix, suffix, n = args
        write, read = kwargs.get("write", CACHE_WRITE), kwargs.get("read", CACHE_READ)
        hint = ""
        if isinstance(got, (int, float)) and not isinstance(got, bool):
            if n and got == n * prefix * write + n * suffix != want:
                hint = "the start is written once (the first request) and read by the other n_requests - 1"
            elif n and got == prefix * write + n * prefix * read + n * suffix != want:
                hint = "the first request writes the start; only the other n_requests - 1 read it"
            elif n and got == prefix * write + (n - 1) * prefix * read != want:
                hint = "each request's own suffix_tokens are billed too, at the plain input price (1x)"
            elif n and got == (prefix + suffix) * write + (n - 1) * prefix * read + (n - 1) * suffix != want:
                hint = "only the shared start is written to the cache; the first question is plain input"
            elif kwargs and got == reference_cached_cost(*args):
                hint = "use the write and read arguments, not the defaults"
            elif n == 0 and got != 0:
                hint = "no requests, nothing billed"
        name = "cached_cost" if not kwargs else f"cached_cost[{', '.join(f'{k}={v}' for k, v in kwargs.items())}]"
        expect_number(name, args, got, want, hint=(hint or why))
    passed("cached_cost", len(cases))


def break_even_requests(write: float = CACHE_WRITE, read: float = CACHE_READ, limit: int = 1000) -> int:
    """The fewest requests sharing a start for which the cached bill is strictly below the plain one
    (n * prefix; the suffixes cost the same either way)."""
    for n in range(1, limit + 1):
        if reference_cached_cost(1.0, 0, n, write, read) < n * 1.0:
            return n
    raise ValueError(f"the cache never pays for itself within {limit} requests at write={write}, read={read}")


def check_answer_break_even(answer) -> None:
    want = break_even_requests()
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        raise CheckFailed(f"answer_break_even = {answer!r}; expected a whole number of requests (an int)")
    if answer == want and float(answer).is_integer():
        passed("answer_break_even", 1)
        return
    n = answer
    if not float(n).is_integer():
        hint = (f"{n} is not a whole number of requests: solving 1.25 + 0.1 (n - 1) = n gives n = 1.28; "
                "the answer is the smallest whole n above it")
    elif n < want:
        hint = (f"with {int(n)} request(s) the start is written and never read: "
                f"{reference_cached_cost(1.0, 0, int(n)):.2f}x the plain price (the write costs {CACHE_WRITE}x)")
    else:
        hint = (f"already {want} requests pay: {CACHE_WRITE} + {CACHE_READ} = "
                f"{reference_cached_cost(1.0, 0, want):.2f} prefix-prices instead of {want}")
    raise CheckFailed(f"answer_break_even = {answer!r}, but the prompt cache is cheaper from {want} requests on — {hint}")


def cost_figure(cached_cost: Callable, prefix_tokens: int = 10_000, suffix_tokens: int = 0, max_requests: int = 20):
    """Billed input-token equivalents vs the number of requests sharing the start."""
    n = list(range(1, max_requests + 1))
    fig = new_figure(f"Billing a {prefix_tokens:,}-token shared start (write {CACHE_WRITE}x, read {CACHE_READ}x)",
                     "requests sharing the start", "billed as input tokens")
    fig.add_scatter(x=n, y=[k * (prefix_tokens + suffix_tokens) for k in n], name="no cache", mode="lines+markers")
    fig.add_scatter(x=n, y=[cached_cost(prefix_tokens, suffix_tokens, k) for k in n], name="prompt cache (yours)",
                    mode="lines+markers")
    return fig


# =================================================================== 5. the learner's TTFT harness
# The reference run: the notebook's measurement cell in full mode (time_ttft on NUM_QUESTIONS = 10 questions about
# a DOC_TOKENS = 2000-token document, SamplingParams(max_tokens=1), warmup=1) on the course's reference machine.
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
# The machine was shared with other jobs at the time: the absolute TTFTs are slow, the ratio is what to compare.
REFERENCE_TTFT_S = {"off": 103.3, "on": 2.67}   # median TTFT of the 9 questions after the first, seconds
REFERENCE_TTFT_SPEEDUP = REFERENCE_TTFT_S["off"] / REFERENCE_TTFT_S["on"]


class FakeTTFTEngine:
    """A stand-in for an engine in the harness check: each generate() call moves the shared FakeClock by the next
    scripted cost and records the prompt it was sent."""

    __sandbox_methods__ = ("generate",)
    __sandbox_attributes__ = ()

    def __init__(self, clock, costs):
        self.clock, self.costs, self.prompts = clock, list(costs), []

    def generate(self, prompts, params=None, use_tqdm=True):
        if len(self.prompts) >= len(self.costs):
            raise RuntimeError(f"generate() called {len(self.prompts) + 1} times; there are {len(self.costs)} prompts")
        self.clock.advance(self.costs[len(self.prompts)])
        self.prompts.append(prompts)
        batch = prompts if isinstance(prompts, list) else [prompts]
        return None   # a TTFT harness reads only the clock



def check_time_ttft(time_ttft: Callable, warmup: int = 1, num_prompts: int = 6, seed: int = 0) -> None:
    """Your harness with a FakeClock and fake engines whose calls cost scripted seconds (the first, the warm-up,
    20x: it fills the cache): one call per prompt in order, warm-up dropped, the median, min and max of the timed
    calls, and the speed-up off over on."""
    import statistics

    from .common import FakeClock, scripted_costs, timing_mistake

    clock = FakeClock()
    repeats = num_prompts - warmup
    costs = {"off": scripted_costs(0.6, warmup, repeats, seed), "on": scripted_costs(0.1, warmup, repeats, seed + 1)}
    engines = {name: FakeTTFTEngine(clock, costs[name]) for name in costs}
    prompts = [{"prompt_token_ids": [1, 2, 3, i]} for i in range(num_prompts)]
    call = f"time_ttft(engines, {num_prompts} prompts, params, warmup={warmup}, clock=FakeClock)"
    params = {"max_tokens": 1}   # the fake engines ignore it; plain data crosses to the sandbox
    got = call_learner(lambda: time_ttft(engines, prompts, params, warmup=warmup, clock=clock), (), call)
    if clock.reads == 0:
        raise CheckFailed(f"{call}: the clock it was given was never read: time each call with clock(), not "
                          "time.perf_counter() (the injected clock is what the check and your plot see)")
    for name, engine in engines.items():
        if engine.prompts != prompts:
            raise CheckFailed(f"{call}: engine {name!r} was sent {len(engine.prompts)} generate() calls; expected one "
                              f"call per prompt, in order ({num_prompts}), each a single prompt")
    if not isinstance(got, dict) or not all(isinstance(got.get(n), dict) for n in ("off", "on")) or "speedup" not in got:
        raise CheckFailed(f"{call} returned {type(got).__name__}; expected a dict with 'off', 'on' (dicts) and 'speedup'")
    for name in ("off", "on"):
        timed = costs[name][warmup:]
        want = {"median_s": statistics.median(timed), "min_s": min(timed), "max_s": max(timed), "n": len(timed)}
        for key, value in want.items():
            have = got[name].get(key)
            if not isinstance(have, (int, float)) or not is_close(float(have), value, rel=1e-6):
                why = timing_mistake(float(have), costs[name], warmup) if isinstance(have, (int, float)) else ""
                if key == "n" and have == num_prompts:
                    why = "the warm-up call counted: drop the first `warmup` calls"
                raise CheckFailed(f"{call}: [{name!r}][{key!r}] is {have!r}, expected {value:.6g}"
                                  + (f": {why}" if why else ""))
    want = statistics.median(costs["off"][warmup:]) / statistics.median(costs["on"][warmup:])
    have = got["speedup"]
    if not isinstance(have, (int, float)) or not is_close(float(have), want, rel=1e-6):
        why = ": inverted — the speed-up is TTFT off over TTFT on (above 1: the cache is faster)" if (
            isinstance(have, (int, float)) and have and is_close(1 / float(have), want, rel=1e-6)) else ""
        raise CheckFailed(f"{call}: speedup is {have!r}, expected {want:.6g}{why}")
    passed("time_ttft", 1)


def ttft_figure(timing: dict, device: str):
    """Median TTFT of the questions after the first, caching off and on, the min-max spread as error bars, beside
    the reference run."""
    fig = new_figure("Time to first token of a question about a cached document (your harness)", "",
                     "median TTFT (s)", device=device)
    names = ["off", "on"]
    med = [timing[n]["median_s"] for n in names]
    fig.add_bar(x=["prefix_caching=False", "prefix_caching=True"], y=med, name="yours (median, min-max)",
                error_y={"type": "data", "symmetric": False,
                         "array": [timing[n]["max_s"] - m for n, m in zip(names, med)],
                         "arrayminus": [m - timing[n]["min_s"] for n, m in zip(names, med)]})
    fig.add_bar(x=["prefix_caching=False", "prefix_caching=True"], y=[REFERENCE_TTFT_S[n] for n in names],
                name=f"reference ({REFERENCE_HARDWARE})")
    fig.update_layout(barmode="group")
    return fig


def print_explain_questions(saving, timing: dict | None) -> None:
    """Section 9's questions, each quoting the learner's own measurements."""
    t = timing or {}
    speedup = t.get("speedup")
    fmt = lambda v, spec: format(float(v), spec) if isinstance(v, (int, float)) else "(not measured)"  # noqa: E731
    print(f"1. The cache saved {fmt(saving, '.0%')} of section 5's reading time, and your harness measured a TTFT "
          f"speed-up of {fmt(speedup, '.1f')}x on a cached question (reference {REFERENCE_TTFT_SPEEDUP:.1f}x on "
          f"{REFERENCE_HARDWARE}). Why is the saving below 1 - 1/NUM_QUESTIONS, and what was still computed in a "
          "cached question's TTFT?")
    print('2. A chat app puts "Today is 2026-11-29 14:03:11." as the first line of its system prompt. What does that '
          "do to its cache hit rate, and where should the line go?")
    print("3. Two tenants send the same 4,000-token contract. With a per-tenant cache_salt, how many times is it read? "
          "Why might a provider still want the salt?")
    print("4. Your break-even of exercise 7 does not depend on how long the shared start is, nor on the questions "
          "after it. Why not?")


class TimedEngine:
    """A real engine handed to the learner's harness from the grader's kernel (the engine's own parts are references
    the sandbox does not have): generate() runs it with the SamplingParams it was made with (the harness's `params`
    argument, None here, is ignored)."""

    __sandbox_methods__ = ("generate",)
    __sandbox_attributes__ = ()

    def __init__(self, engine, params):
        self.engine, self.params = engine, params

    def generate(self, prompts, params=None, use_tqdm=True):
        self.engine.generate(prompts, self.params, use_tqdm=False)
        return None   # a TTFT harness reads only the clock
