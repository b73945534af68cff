"""Shared fixtures for the engine tests.

Loading the default model costs a few seconds and ~540 MB each time, so the engine
instances every test file needs are session-scoped and shared. Tests that change an
engine's settings restore them (monkeypatch) and leave no request behind.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# ---------------------------------------------------------------- running in parallel
# `make test` runs the suite in pytest-xdist workers (-n 2 --dist loadfile). Each worker gets its share
# of the cores for torch's threads and for every process it starts (notebook kernels, servers, compilers):
# two workers with two OpenMP threads each on two cores slow each other down many times over.
WORKER_COUNT = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    WORKER_THREADS = max(1, len(os.sched_getaffinity(0)) // WORKER_COUNT)
    os.environ["OMP_NUM_THREADS"] = str(WORKER_THREADS)
    torch.set_num_threads(WORKER_THREADS)

# Test files whose tests take longest, longest first: a worker starts on them, so both end together.
LONGEST_FIRST = ("test_course.py", "test_kernels.py", "test_combinations.py", "test_kv_quant.py", "test_browser.py",
                 "test_prefix_caching.py", "test_quality.py", "test_triton_backend.py", "test_paged.py")


NO_CUDA_REASON = ("gpu test: needs a CUDA GPU (torch.cuda.is_available() is False here); on a machine with one, "
                  "run `pytest -m gpu` (MINILLM_GPU_TESTS_INTERPRET=1 runs them here, on tiny shapes in Triton's "
                  "interpreter)")


def pytest_collection_modifyitems(config, items):
    """The longest files first (make test runs --dist loadfile: each file stays on one worker, so its
    module-scoped fixtures, a model or an nbgrader round trip, are built once). Tests marked gpu are
    skipped without CUDA, unless MINILLM_GPU_TESTS_INTERPRET=1 (tests/kernel_utils.py)."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
    if os.environ.get("MINILLM_GPU_TESTS_INTERPRET") != "1":
        no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON)
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(no_gpu)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted default model (converts once into MINILLM_CACHE / ~/.cache/minillm)."""
    from minillm import default_model_path

    return default_model_path(progress=False)


@pytest.fixture(scope="session")
def default_llm(default_model_dir):
    """LLM() on the default model, kv_cache on (the baseline engine)."""
    from minillm import LLM

    return LLM()


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    """The reference: transformers' own Llama on the same directory, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture
def passes(capsys):
    """`passes(lab04.check_append, cls)`: run a lab's check_* helper, which must return None (nbgrader reads
    the value a test cell ends on as a partial score) and print a ✓ verdict; returns what it printed.
    Output printed before the call stays in capsys for the test to read."""

    def run(check, *args, **kwargs) -> str:
        before = capsys.readouterr()
        result = check(*args, **kwargs)
        during = capsys.readouterr()
        print(before.out + during.out, end="")
        print(before.err + during.err, end="", file=sys.stderr)
        assert result is None, f"{check.__name__} returned {result!r}: a check prints its verdict and returns None"
        assert "✓" in during.out, f"{check.__name__} printed no ✓ verdict: {during.out!r}"
        return during.out.strip()

    return run


def chi_square_p_value(counts: torch.Tensor, p: torch.Tensor, min_df: int = 1) -> float:
    """Pearson's chi-square of token counts against the distribution p over a whole vocabulary: the bins expecting
    under 5 draws merged into one. Asserts that no draw fell where p is 0 and that the test keeps min_df degrees of
    freedom; returns the p-value."""
    expected = p * counts.sum()
    assert counts[p == 0].sum() == 0, "a token the distribution never draws"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    assert df >= min_df, (counts[p > 0].tolist(), expected[p > 0].tolist())
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def assert_engine_idle(llm) -> None:
    """Nothing queued or running, and every KV block back in the pool."""
    engine = llm.engine
    assert not engine.has_unfinished(), (list(engine.scheduler.waiting), list(engine.scheduler.running))
    bm = engine.block_manager
    if bm is not None:
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
        assert bm.num_reserved_tokens == 0
        assert all(bm.is_free) and not any(bm.ref_count)
        bm.check()


@pytest.fixture
def idle_check():
    """Use as `idle_check(llm)` inside a test; also re-checked at teardown."""
    engines = []

    def check(llm):
        engines.append(llm)
        assert_engine_idle(llm)

    yield check
    for llm in engines:
        assert_engine_idle(llm)


def tokenizer_files(model_dir: str) -> list[str]:
    """Tokenizer files of a model directory (to give tiny test models a tokenizer)."""
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    return [os.path.join(model_dir, n) for n in names if os.path.isfile(os.path.join(model_dir, n))]
