"""Lab 06 (prefix caching): the master's solutions pass every check; the checks name each usual
mistake (blocks hashed alone, the partial block keyed, the salt left out, a sum for a hash, keys
that depend on the rest of the prompt, a lookup that skips misses, the last token taken from the
cache, the cache write billed every time, a mean for a sum of TTFTs, the saving divided the wrong
way); the engine on the learner's hash_link gives the cache-off tokens and the engine's own hits,
and a link that ignores its parent loses hits; the measurements and figures come out right on tiny
inputs; every graded test cell fails on two or more plausible mistakes (MISTAKES)."""

from __future__ import annotations

import time

import nbformat
import pytest

from lab_utils import assert_check_fails, nbgrader_cells, notebook_functions, run_solution_cells, solution_fixture

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab06
from minillm.lab.common import CheckFailed, figure_subtitle

MASTER = SOURCE_DIR / "06_prefix_caching" / "06_prefix_caching.ipynb"



def _rows(ttfts, prompt_tokens, cached):
    return [{"tokens": [1, 2], "ttft_s": t, "prompt_tokens": prompt_tokens, "cached_tokens": c}
            for t, c in zip(ttfts, cached)]


# What measure_shared_document returns, for three questions about a 200-token document (the measure_reading
# cell reads only this): the first question costs the same either way, the later ones read only their own tokens.
STUB_SHARED = {"off": _rows([0.30, 0.28, 0.29], 212, [0, 0, 0]), "on": _rows([0.31, 0.05, 0.04], 212, [0, 192, 192]),
               "num_questions": 3, "identical": 3, "device": "cpu", "prompt_tokens": [212] * 3}

STUB_TTFT = {"off": {"median_s": 0.29, "min_s": 0.28, "max_s": 0.30, "n": 2},
             "on": {"median_s": 0.05, "min_s": 0.04, "max_s": 0.05, "n": 2}, "speedup": 0.29 / 0.05}
solution = solution_fixture(MASTER, {"lab06": lab06, "shared": STUB_SHARED, "time": time})  # the master's solution cells


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The experiments the notebook defines in its own cells (run_with_hash, the measurements), as it runs them."""
    return notebook_functions(MASTER, "one_by_one", "run_with_hash", "measure_shared_document", "measure_sensitivity",
                              "measure_eviction")


SOLVED = ("block_hashes", "lookup", "reusable_blocks", "hash_link", "measure_time_ttft", "cached_cost", "answer_break_even")


def test_master_has_every_graded_piece_with_hidden_tests():
    nb = nbformat.read(MASTER, as_version=4)
    meta = nbgrader_cells(nb)
    for name in SOLVED:
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert set(graded) == {"test_block_hashes_chain", "test_block_hashes_salt", "test_lookup", "test_reusable_blocks",
                           "test_engine_hash", "test_measure_time_ttft", "test_cached_cost", "test_answer_break_even"}
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and graded[gid]["points"] > 0
        assert meta[gid][0].source.startswith("lab06.check_"), f"{gid} does not call a check first"
    assert sum(m["points"] for m in graded.values()) == 14
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "### BEGIN MODEL ANSWER" not in cell.source:
            assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source


def test_student_copy_has_stubs_and_no_solution():
    student = nbformat.read(REPO_ROOT / "labs" / "06_prefix_caching.ipynb", as_version=4)
    stubs = {c.metadata["nbgrader"]["grade_id"]: c.source for c in student.cells
             if c.metadata.get("nbgrader", {}).get("solution")}
    assert set(stubs) == set(SOLVED)
    for gid, source in stubs.items():
        assert "raise NotImplementedError()" in source, gid
    assert "hash((parent" not in stubs["block_hashes"] and "hash((parent" not in stubs["hash_link"]
    assert "statistics.median" not in stubs["measure_time_ttft"] and "= 2" not in stubs["answer_break_even"]


# --------------------------------------------------------------------- the solutions pass
def test_solution_passes_every_check(solution, passes):
    for block_size, seed in ((4, 0), (1, 11), (3, 12), (5, 13), (16, 14)):
        assert passes(lab06.check_block_hashes, solution["block_hashes"], block_size=block_size, seed=seed).startswith("✓")
        assert passes(lab06.check_reusable_blocks, solution["reusable_blocks"], solution["block_hashes"],
                      block_size=block_size, seed=seed).startswith("✓")
    assert passes(lab06.check_block_hashes_salt, solution["block_hashes"]).startswith("✓")
    for block_size, seed in ((4, 0), (1, 31), (3, 32), (16, 33)):
        assert passes(lab06.check_hash_link, solution["hash_link"], block_size=block_size, seed=seed).startswith("✓")
    assert passes(lab06.check_lookup, solution["lookup"]).startswith("✓")
    assert passes(lab06.check_cached_cost, solution["cached_cost"]).startswith("✓")
    assert passes(lab06.check_time_ttft, solution["time_ttft"]).startswith("✓")
    assert passes(lab06.check_time_ttft, solution["time_ttft"], warmup=2, num_prompts=7, seed=3).startswith("✓")
    assert passes(lab06.check_answer_break_even, solution["answer_break_even"]).startswith("✓")
    assert lab06.break_even_requests() == 2 and lab06.break_even_requests(write=2.0, read=0.5) == 4
    assert solution["cached_cost"](10_000, 0, 10) == pytest.approx(21_500)


def test_reference_chain_agrees_with_the_engine_keys_on_equality(passes):
    """The engine's SHA-256 chain and the reference give equal keys for exactly the same blocks."""
    from minillm.engine.block_manager import block_hash

    def engine_chain(ids, bs, salt=None):
        keys, parent = [], None
        for start in range(0, len(ids) - bs + 1, bs):
            parent = block_hash(parent, ids[start:start + bs], salt)
            keys.append(parent)
        return keys

    assert passes(lab06.check_block_hashes, engine_chain, block_size=3, seed=5).startswith("✓")
    assert passes(lab06.check_hash_link, block_hash, block_size=3, seed=5).startswith("✓")
    prompts = [([1, 2, 3, 4, 5, 6, 7], None), ([1, 2, 3, 4, 5, 6, 8], None), ([1, 2, 3, 9, 5, 6], None),
               ([1, 2, 3, 4, 5, 6], "t")]
    ref = [lab06.reference_block_hashes(ids, 3, s) for ids, s in prompts]
    eng = [engine_chain(ids, 3, s) for ids, s in prompts]
    for a in range(len(prompts)):
        for b in range(len(prompts)):
            for i in range(min(len(ref[a]), len(ref[b]))):
                assert (ref[a][i] == ref[b][i]) == (eng[a][i] == eng[b][i])


# --------------------------------------------------------------------- the checks catch mistakes
def _independent(ids, bs, salt=None):
    return [hash((tuple(ids[i:i + bs]), salt)) for i in range(0, len(ids) - bs + 1, bs)]


def _partial_keyed(ids, bs, salt=None):
    return lab06.reference_block_hashes(list(ids) + [0] * (-len(ids) % bs), bs, salt)


def _no_salt(ids, bs, salt=None):
    return lab06.reference_block_hashes(ids, bs)


def _sum_hash(ids, bs, salt=None):
    keys, parent = [], 0
    for i in range(0, len(ids) - bs + 1, bs):
        parent = hash((parent, sum(ids[i:i + bs]), salt))
        keys.append(parent)
    return keys


def _whole_prompt(ids, bs, salt=None):
    return [hash((tuple(ids), i, salt)) for i in range(len(ids) // bs)]


def _list_keys(ids, bs, salt=None):
    return [list(ids[:i + bs]) for i in range(0, len(ids) - bs + 1, bs)]


_counter = iter(range(10**9))


def _unstable(ids, bs, salt=None):
    return [next(_counter) for _ in range(len(ids) // bs)]


@pytest.mark.parametrize("wrong, message", [
    (_independent, "must cover its parent's key"),
    (_partial_keyed, "the partial last block has no key"),
    (_no_salt, "the salt must enter the key"),
    (_sum_hash, "not their sum or set"),
    (_whole_prompt, "may not depend on anything after its own block"),
    (_list_keys, "cannot be a dict key"),
    (_unstable, "called twice"),
])
def test_block_hash_check_names_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        lab06.check_block_hashes(wrong)


def test_lookup_check_names_the_mistake():
    with pytest.raises(CheckFailed, match="stop at the first miss"):
        lab06.check_lookup(lambda cache, keys: [cache[k] for k in keys if k in cache])
    with pytest.raises(CheckFailed, match="not the keys"):
        lab06.check_lookup(lambda cache, keys: list(keys)[:len(lab06.reference_lookup(cache, keys))])
    with pytest.raises(CheckFailed, match="keep the keys' order"):
        lab06.check_lookup(lambda cache, keys: sorted(lab06.reference_lookup(cache, keys)))


def test_reusable_blocks_check_names_the_mistake(solution):
    chain, lookup = solution["block_hashes"], solution["lookup"]
    with pytest.raises(CheckFailed, match=r"at least the last prompt token must be computed"):
        lab06.check_reusable_blocks(lambda cache, ids, bs, salt=None: lookup(cache, chain(ids, bs, salt)), chain)
    with pytest.raises(CheckFailed, match="pass the salt on"):
        lab06.check_reusable_blocks(lambda cache, ids, bs, salt=None: lookup(cache, chain(ids, bs)[:(len(ids) - 1) // bs]),
                                    chain)


@pytest.mark.parametrize("wrong, message", [
    (lambda p, s, n, write=1.25, read=0.1: n * p * write + n * s, "written once"),
    (lambda p, s, n, write=1.25, read=0.1: p * write + n * p * read + n * s, "only the other n_requests - 1"),
    (lambda p, s, n, write=1.25, read=0.1: p * write + (n - 1) * p * read if n else 0, "suffix_tokens are billed"),
    (lambda p, s, n, write=1.25, read=0.1: lab06.reference_cached_cost(p, s, n), "use the write and read"),
    (lambda p, s, n, write=1.25, read=0.1: p * write + (n - 1) * p * read + n * s, "no requests"),
])
def test_cost_check_names_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        lab06.check_cached_cost(wrong)


def test_stubs_raise_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError()

    for check in (lab06.check_block_hashes, lab06.check_lookup, lab06.check_cached_cost):
        with pytest.raises(NotImplementedError):
            check(stub)


# --------------------------------------------------------------------- the engine and the measurements
def _parent_blind(parent_key, block_token_ids, salt):
    return hash((tuple(block_token_ids), salt))


def test_hash_link_check_names_the_mistake():
    with pytest.raises(CheckFailed, match="must cover its parent's key"):
        lab06.check_hash_link(_parent_blind)
    with pytest.raises(CheckFailed, match="the salt must enter the key"):
        lab06.check_hash_link(lambda parent, ids, salt: hash((parent, tuple(ids))))
    with pytest.raises(CheckFailed, match=r"hash_link\(None, \[.*\], None\) raised TypeError"):
        lab06.check_hash_link(lambda parent, ids, salt: hash((parent, list(ids), salt)))
    with pytest.raises(CheckFailed, match="cannot be a dict key"):
        lab06.check_hash_link(lambda parent, ids, salt: [parent, ids, salt])
    with pytest.raises(CheckFailed, match="returned None"):
        lab06.check_hash_link(lambda parent, ids, salt: None)


def test_salt_check_names_the_mistake():
    with pytest.raises(CheckFailed, match="salt 'alice' and salt 'bob' gave equal keys.*the salt must enter the key"):
        lab06.check_block_hashes_salt(lambda ids, bs, salt=None: lab06.reference_block_hashes(ids, bs))
    with pytest.raises(CheckFailed, match="salt None and salt '' gave equal keys.*is None"):
        lab06.check_block_hashes_salt(lambda ids, bs, salt=None: lab06.reference_block_hashes(ids, bs, salt or None))


def test_engine_on_the_learners_link_matches_cache_off_and_engine_hits(default_llm, solution, experiments, passes):
    prompts = [{"prompt_token_ids": list(range(300, 341))}, {"prompt_token_ids": list(range(300, 333)) + [7, 8]},
               {"prompt_token_ids": list(range(300, 316)) + [9] * 9}]
    run_with_hash = experiments["run_with_hash"]
    run = run_with_hash(default_llm, solution["hash_link"], prompts, max_tokens=2, block_size=8)
    assert passes(lab06.check_hash_run, run).startswith("✓")
    assert run["cached_tokens"] == [0, 32, 16] == run["expected_cached_tokens"]
    assert run["hash_calls"] > 0
    # A different first block: nothing matches, although blocks 1-2 hold the same tokens (the chain).
    repeated = [{"prompt_token_ids": [5] * 8 + list(range(40, 56)) + [1]},
                {"prompt_token_ids": [6] * 8 + list(range(40, 56)) + [2]}]
    good = run_with_hash(default_llm, solution["hash_link"], repeated, max_tokens=1, block_size=8)
    assert good["equal"] and good["cached_tokens"] == [0, 0]
    siblings = run_with_hash(default_llm, solution["hash_link"], lab06.sibling_prompts(8), max_tokens=1, block_size=8)
    assert siblings["cached_tokens"] == [0, 0, 24] == siblings["expected_cached_tokens"]


def test_a_parent_blind_link_loses_hits_in_the_engine(default_llm, experiments):
    """The engine's block manager never serves wrong K/V, but a link that ignores its parent finds fewer blocks:
    the engine-level half of the check can fail."""
    blind = experiments["run_with_hash"](default_llm, _parent_blind, lab06.sibling_prompts(8), max_tokens=1, block_size=8)
    assert blind["equal"] and blind["cached_tokens"] == [0, 0, 8] and blind["expected_cached_tokens"] == [0, 0, 24]
    with pytest.raises(CheckFailed, match="fewer cached tokens"):
        lab06.check_hash_run(blind)


def test_a_stub_link_reaches_the_notebook_as_not_implemented(default_llm, experiments):
    def stub(parent_key, block_token_ids, salt):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        experiments["run_with_hash"](default_llm, stub, lab06.sibling_prompts(8), max_tokens=1, block_size=8)
    with pytest.raises(CheckFailed, match=r"hash_link\(None, .*\(called by the engine\) raised ZeroDivisionError"):
        experiments["run_with_hash"](default_llm, lambda p, ids, salt: 1 / 0, lab06.sibling_prompts(8), max_tokens=1,
                                     block_size=8)


def test_hash_run_check_fails_on_wrong_tokens_or_hits(passes):
    base = {"tokens": [[1], [2]], "expected": [[1], [2]], "equal": True, "cached_tokens": [0, 16],
            "expected_cached_tokens": [0, 16]}
    assert passes(lab06.check_hash_run, base).startswith("✓")
    with pytest.raises(CheckFailed, match="served after a different start"):
        lab06.check_hash_run({**base, "tokens": [[1], [3]], "equal": False})
    with pytest.raises(CheckFailed, match="equal prefixes must give equal keys"):
        lab06.check_hash_run({**base, "cached_tokens": [0, 0]})
    with pytest.raises(CheckFailed, match="no request found a cached block"):
        lab06.check_hash_run({**base, "cached_tokens": [0, 0], "expected_cached_tokens": [0, 0]})


def test_shared_document_measurement_reads_the_document_once(default_llm, experiments):
    doc = lab06.document_ids(default_llm, 64)
    result = experiments["measure_shared_document"](default_llm, lab06.document_questions(default_llm, doc, 3),
                                                    max_tokens=2)
    assert result["identical"] == 3
    assert [r["cached_tokens"] for r in result["off"]] == [0, 0, 0]
    assert [r["cached_tokens"] for r in result["on"]] == [0, 64, 64]   # 4 full blocks of 16
    assert all(r["ttft_s"] > 0 for r in result["on"])
    fig = lab06.shared_document_figure(result)
    assert len(fig.data) == 2 and default_llm.device in figure_subtitle(fig)
    lab06.print_shared_document(result)
    lab06.print_reading(result, lab06.reading_s(result["off"]), lab06.reading_s(result["on"]))


def test_sensitivity_recomputes_from_the_changed_block(default_llm, experiments):
    doc = lab06.document_ids(default_llm, 64, offset=100)
    result = experiments["measure_sensitivity"](default_llm, doc, fractions=(0.25, 0.75))
    # A word at token 16 changes block 1 on: 16 of 64 tokens cached; at token 48, 48 cached.
    assert result["computed"] == {0.25: pytest.approx(0.75), 0.75: pytest.approx(0.25)}
    assert set(result["relative"]) == {0.25, 0.75} and result["first_s"] > 0
    fig = lab06.sensitivity_figure(result, {0.25: 0.8, 0.75: None})
    assert len(fig.data) == 4 and default_llm.device in figure_subtitle(fig)
    lab06.print_sensitivity(result, {0.25: 0.8})


def test_edit_one_token_changes_exactly_one_token(default_llm):
    ids = lab06.document_ids(default_llm, 40)
    edited = lab06.edit_one_token(default_llm, ids, 10)
    assert [i for i, (a, b) in enumerate(zip(ids, edited)) if a != b] == [10] and len(edited) == len(ids)
    assert lab06.edit_one_token(default_llm, edited, 10)[10] != edited[10]


def test_eviction_hit_rate_grows_with_the_pool(default_llm, experiments):
    a, b = lab06.document_ids(default_llm, 48, offset=2000), lab06.document_ids(default_llm, 48, offset=3000)
    rows = experiments["measure_eviction"](default_llm, a, b, (1.0, 3.0), num_requests=4, block_size=16)
    assert rows[0]["hit_rate"] < rows[1]["hit_rate"] and rows[1]["evictions"] == 0
    assert rows[1]["hit_rate"] == pytest.approx(48 / 49)   # every later document read from the cache
    fig = lab06.eviction_figure(rows, default_llm.device)
    assert default_llm.device in figure_subtitle(fig)


def test_cost_figure_uses_the_learners_function(solution):
    fig = lab06.cost_figure(solution["cached_cost"], max_requests=5)
    assert list(fig.data[1].y) == [pytest.approx(solution["cached_cost"](10_000, 0, k)) for k in range(1, 6)]
    assert list(fig.data[0].y) == [10_000 * k for k in range(1, 6)]


# --------------------------------------------------------------------- every graded check fails on plausible mistakes
PARENT_BLIND_CHAIN = """
def block_hashes(token_ids, block_size, salt=None):
    return [hash((tuple(token_ids[i:i + block_size]), salt)) for i in range(0, len(token_ids) - block_size + 1, block_size)]
"""
PARTIAL_BLOCK_KEYED = """
def block_hashes(token_ids, block_size, salt=None):
    keys, parent = [], None
    for start in range(0, len(token_ids), block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size]), salt))
        keys.append(parent)
    return keys
"""
SUMMED_BLOCKS = """
def block_hashes(token_ids, block_size, salt=None):
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, sum(token_ids[start:start + block_size]), salt))
        keys.append(parent)
    return keys
"""
SALT_LEFT_OUT = """
def block_hashes(token_ids, block_size, salt=None):
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys
"""
EMPTY_SALT_AS_NONE = """
def block_hashes(token_ids, block_size, salt=None):
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size]), salt or None))
        keys.append(parent)
    return keys
"""
SALT_IN_FIRST_BLOCK_ONLY = """
def block_hashes(token_ids, block_size, salt=None):
    return [hash((tuple(token_ids[i:i + block_size]), salt if i == 0 else None))
            for i in range(0, len(token_ids) - block_size + 1, block_size)]
"""
SKIPS_MISSES = """
def lookup(cache, keys):
    return [cache[key] for key in keys if key in cache]
"""
RETURNS_KEYS = """
def lookup(cache, keys):
    hits = []
    for key in keys:
        if key not in cache:
            break
        hits.append(key)
    return hits
"""
LAST_TOKEN_CACHED = """
def reusable_blocks(cache, token_ids, block_size, salt=None):
    return lookup(cache, block_hashes(token_ids, block_size, salt))
"""
SALT_NOT_PASSED = """
def reusable_blocks(cache, token_ids, block_size, salt=None):
    return lookup(cache, block_hashes(token_ids, block_size)[:(len(token_ids) - 1) // block_size])
"""
ONE_BLOCK_TOO_FEW = """
def reusable_blocks(cache, token_ids, block_size, salt=None):
    return lookup(cache, block_hashes(token_ids, block_size, salt)[:len(token_ids) // block_size - 1])
"""


def _ttft(loop: str = "for i, prompt in enumerate(prompts):", keep: str = "if i >= warmup:",
          stat: str = "statistics.median(samples)", ratio: str = 'result["off"]["median_s"] / result["on"]["median_s"]',
          start: str = "start = clock()", stop: str = "elapsed = clock() - start") -> str:
    """A time_ttft with one piece changed (the solution with the defaults)."""
    return f"""import statistics
def time_ttft(engines, prompts, params, warmup=1, clock=time.perf_counter):
    result = {{}}
    for name in ("off", "on"):
        samples = []
        {loop}
            {start}
            engines[name].generate(prompt, params, use_tqdm=False)
            {stop}
            {keep}
                samples.append(elapsed)
        result[name] = {{"median_s": {stat}, "min_s": min(samples), "max_s": max(samples), "n": len(samples)}}
    result["speedup"] = {ratio}
    return result
"""


WRITTEN_EVERY_TIME = """
def cached_cost(prefix_tokens, suffix_tokens, n_requests, write=1.25, read=0.1):
    return n_requests * prefix_tokens * write + n_requests * suffix_tokens
"""
SUFFIX_FORGOTTEN = """
def cached_cost(prefix_tokens, suffix_tokens, n_requests, write=1.25, read=0.1):
    if n_requests <= 0:
        return 0.0
    return prefix_tokens * write + (n_requests - 1) * prefix_tokens * read
"""
NO_REQUESTS_BILLED = """
def cached_cost(prefix_tokens, suffix_tokens, n_requests, write=1.25, read=0.1):
    return prefix_tokens * write + (n_requests - 1) * prefix_tokens * read + n_requests * suffix_tokens
"""

MISTAKES = {
    "test_block_hashes_chain": [(PARENT_BLIND_CHAIN, "must cover its parent's key"),
                                (PARTIAL_BLOCK_KEYED, "the partial last block has no key"),
                                (SUMMED_BLOCKS, "not their sum or set")],
    "test_block_hashes_salt": [(SALT_LEFT_OUT, "salt 'alice' and salt 'bob'"),
                               (EMPTY_SALT_AS_NONE, "salt None and salt ''"),
                               (SALT_IN_FIRST_BLOCK_ONLY, "the salt must reach every key")],
    "test_lookup": [(SKIPS_MISSES, "stop at the first miss"), (RETURNS_KEYS, "not the keys")],
    "test_reusable_blocks": [(LAST_TOKEN_CACHED, "at least the last prompt token must be computed"),
                             (SALT_NOT_PASSED, "pass the salt on"),
                             (ONE_BLOCK_TOO_FEW, "the same prompt again")],
    "test_engine_hash": [
        ("def hash_link(parent_key, block_token_ids, salt):\n    return hash((tuple(block_token_ids), salt))\n",
         "must cover its parent's key"),
        ("def hash_link(parent_key, block_token_ids, salt):\n    return hash((parent_key, tuple(block_token_ids)))\n",
         "the salt must enter the key"),
        ("def hash_link(parent_key, block_token_ids, salt):\n    return hash((parent_key, list(block_token_ids), salt))\n",
         "raised TypeError"),
        ("def hash_link(parent_key, block_token_ids, salt):\n    return hash((parent_key, sum(block_token_ids), salt))\n",
         "not their sum or set")],
    "test_measure_time_ttft": [
        (_ttft(keep="if True:"), "warm-up included"),
        (_ttft(stat="statistics.fmean(samples)"), "the mean"),
        (_ttft(stat="min(samples)"), "the minimum"),
        (_ttft(ratio='result["on"]["median_s"] / result["off"]["median_s"]'), "inverted"),
        (_ttft(start="start = time.perf_counter()", stop="elapsed = time.perf_counter() - start"), "never read"),
        (_ttft(loop="for i, prompt in enumerate([prompts] * len(prompts)):"), "one call per prompt"),   # the whole list each time
    ],
    "test_cached_cost": [(WRITTEN_EVERY_TIME, "written once"), (SUFFIX_FORGOTTEN, "suffix_tokens are billed"),
                         (NO_REQUESTS_BILLED, "no requests")],
    "test_answer_break_even": [("answer_break_even = 1", "written and never read"),
                               ("answer_break_even = 3", "already 2 requests pay"),
                               ("answer_break_even = 1.28", "not a whole number")],
}


@pytest.fixture(scope="module")
def graded_namespace(default_llm, experiments) -> dict:
    """What the graded test cells read: the solution cells (measure_reading on STUB_SHARED), the notebook's
    run_with_hash, the model as llm, and hash_run from two chat questions on the solution's hash_link."""
    namespace = run_solution_cells(MASTER, {"lab06": lab06, "shared": STUB_SHARED, "time": time})
    namespace.update(experiments, llm=default_llm, ttft_timing=STUB_TTFT, NUM_QUESTIONS=3)
    prompts = lab06.chat_prompts(default_llm, lab06.system_conversations(
        "You are a careful assistant for a lighthouse museum. Answer in one short sentence, and say so when you do "
        "not know.", ["Who kept the light?", "When?"]))
    namespace["hash_run"] = experiments["run_with_hash"](default_llm, namespace["hash_link"], prompts, max_tokens=1)
    return namespace


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, m, n) for gid, cases in MISTAKES.items() for m, n in cases],
                         ids=[f"{gid}-{i}" for gid, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)


def test_ttft_harness_on_the_engine_figure_and_questions(default_llm, solution, capsys):
    doc = lab06.document_ids(default_llm, 64, offset=300)
    engines = {"off": default_llm.with_levers(prefix_caching=False), "on": default_llm.with_levers(prefix_caching=True)}
    from minillm import SamplingParams

    result = solution["time_ttft"](engines, lab06.document_questions(default_llm, doc, 3), SamplingParams(max_tokens=1))
    assert result["off"]["n"] == result["on"]["n"] == 2 and result["speedup"] > 0
    fig = lab06.ttft_figure(result, "cpu: test device")
    assert len(fig.data) == 2 and "cpu: test device" in figure_subtitle(fig)
    lab06.print_explain_questions(0.5, result)
    assert "50%" in capsys.readouterr().out
    lab06.print_explain_questions(None, None)
