"""Lab 02 (the KV cache): the checks pass the master's solution and name each usual mistake, the
widgets update on slider changes, and the solution plugged into the engine gives its own tokens."""

from __future__ import annotations

from kernel_utils import DEVICE, assert_compiles_for_gpus  # noqa: F401 - first: picks the interpreter before triton is imported

import math
import re
from types import SimpleNamespace

import nbformat
import pytest
import torch

from lab_utils import (assert_check_fails, import_file, nbgrader_cells, notebook_functions, solution_module_fixture,
                       solution_source)

from grading.build import SOURCE_DIR
from minillm.lab import lab02
from minillm.lab.common import CheckFailed

MASTER = SOURCE_DIR / "02_kv_cache" / "02_kv_cache.ipynb"
MODULE_HEADER = """\
import statistics
import time
import torch
import triton
import triton.language as tl
from minillm.lab import common, lab02
"""
LAUNCHER = "def store_kv("  # the code cell that launches the kernel, kept with the solution cells
KERNEL_ID = "store_kv_kernel"  # the @triton.jit exercise: Triton reads its source from a file, so it is imported
solution = solution_module_fixture(MASTER, MODULE_HEADER, LAUNCHER, "lab02_solution")


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The seam and the kv on/off measurement the master notebook defines, as the learner reads them."""
    return notebook_functions(MASTER, "plug_in", "measure_kv_toggle", "summarize_kv_toggle", "run_with_kernel",
                              common=lab02.common)


def _master_namespace() -> dict:
    """The master's solution cells and the markdown specs, executed (markers are comments)."""
    nb = nbformat.read(MASTER, as_version=4)
    namespace: dict = {"torch": torch, "time": __import__("time"), "statistics": __import__("statistics"),
                       "lab02": lab02}
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution") and grade_id != KERNEL_ID:
            exec(compile(cell.source, f"<master:{grade_id}>", "exec"), namespace)
        if cell.cell_type == "markdown":
            for block in re.findall(r"```python\n(.*?)```", cell.source, flags=re.S):
                if "_spec(" in block:
                    exec(compile(block, f"<master:{grade_id}:spec>", "exec"), namespace)
    return namespace


SOLUTION = _master_namespace()
append_kv = SOLUTION["append_kv"]
attend_with_cache = SOLUTION["attend_with_cache"]
kv_cache_bytes_per_token = SOLUTION["kv_cache_bytes_per_token"]
kv_cache_bytes = SOLUTION["kv_cache_bytes"]


# --------------------------------------------------------------------- the master itself
def test_master_has_every_graded_piece_with_hidden_tests():
    nb = nbformat.read(MASTER, as_version=4)
    meta = nbgrader_cells(nb)
    for name in ("append_kv", "attend_with_cache", "kv_cache_bytes_per_token", "kv_cache_bytes"):
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert set(graded) == {"test_append_kv", "test_attend_with_cache", "test_in_engine", "test_store_kv_kernel",
                           "test_measure_kv_step_ratio", "test_kv_cache_bytes_per_token", "test_kv_cache_bytes",
                           "test_answer_users_on_80gb"}
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and graded[gid]["points"] > 0
        assert meta[gid][0].source.startswith("lab02.check_"), f"{gid} does not call its check first"
    assert sum(m["points"] for m in graded.values()) == 17
    assert nb.metadata["minillm"]["kernels"] == {KERNEL_ID: [KERNEL_ID]}
    setup = nb.cells[2].source  # the interpreter must be chosen before the notebook imports triton
    assert setup.index('os.environ["TRITON_INTERPRET"] = "1"') < setup.index("import triton") < setup.index("from minillm")
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "### BEGIN MODEL ANSWER" not in cell.source:
            assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
        elif cell.cell_type == "markdown":  # the learner writes their answers there: a plain markdown cell
            assert "nbgrader" not in cell.metadata and cell.source.startswith("**Your answers**")
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source


# --------------------------------------------------------------------- exercise 1: append_kv
def test_solution_and_spec_pass_append_check(passes):
    assert passes(lab02.check_append_kv, append_kv).startswith("✓ append_kv")
    assert passes(lab02.check_append_kv, SOLUTION["append_kv_spec"], seed=5).startswith("✓")


def _into_first_slots(kc, vc, kn, vn, slots):
    kc[:, : len(slots)] = kn.transpose(0, 1)
    vc[:, : len(slots)] = vn.transpose(0, 1)


def _returns_copy(kc, vc, kn, vn, slots):
    kc = kc.clone()
    kc[:, slots] = kn.transpose(0, 1)
    return kc


def _keys_into_both(kc, vc, kn, vn, slots):
    kc[:, slots] = kn.transpose(0, 1)
    vc[:, slots] = kn.transpose(0, 1)


def _clobbers_slot_0(kc, vc, kn, vn, slots):
    append_kv(kc, vc, kn, vn, slots)
    kc[:, 0] = 0


def _heads_mixed_up(kc, vc, kn, vn, slots):  # token i's head h lands in pool head h, but from the wrong token
    kc[:, slots] = kn.flip(0).transpose(0, 1)
    vc[:, slots] = vn.transpose(0, 1)


@pytest.mark.parametrize("bad, expected", [
    (_into_first_slots, "token i went to slot i; it belongs in slot slots[i] (token 0 -> slot 10"),
    (_returns_copy, "left k_cache and v_cache unchanged: write into them in place"),
    (_keys_into_both, "v_cache holds the keys"),
    (_clobbers_slot_0, "k_cache[kv_head 0, slot 0, dim 0] = 0, expected -1.126: slot 0 is not in slots"),
    (_heads_mixed_up, "(= k_new[token 0, kv_head 0, dim 0]): token 0 belongs in slot slots[0] = 10"),
])
def test_append_check_names_the_mistake(bad, expected):
    with pytest.raises(CheckFailed) as failure:
        lab02.check_append_kv(bad)
    assert expected in str(failure.value)


def test_append_check_refuses_to_mutate_inputs():
    def mutates(kc, vc, kn, vn, slots):
        append_kv(kc, vc, kn, vn, slots)
        kn.zero_()

    with pytest.raises(CheckFailed, match="changed k_new or v_new"):
        lab02.check_append_kv(mutates)


# --------------------------------------------------------------------- exercise 2: attend_with_cache
def test_solution_and_spec_pass_attend_check(passes):
    assert passes(lab02.check_attend_with_cache, attend_with_cache).startswith("✓ attend_with_cache")
    lab02.check_attend_with_cache(attend_with_cache, dtype=torch.bfloat16, seed=3)
    lab02.check_attend_with_cache(SOLUTION["attend_with_cache_spec"], seed=9)


def test_attend_matches_the_hand_example_and_the_engine_backend():
    out = attend_with_cache(torch.ones(2, 1, 1), torch.zeros(1, 3, 1), torch.tensor([[[1.0], [2.0], [3.0]]]), 1.0, 1)
    assert out.flatten().tolist() == [1.5, 2.0]
    from minillm.layers.attention import TorchAttentionBackend

    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 9, 64, generator=gen), torch.randn(3, 10, 64, generator=gen), torch.randn(3, 10, 64, generator=gen)
    torch.testing.assert_close(attend_with_cache(q, k, v, 0.125, 6), TorchAttentionBackend().attend(q, k, v, 0.125, 6))


def _variant(mask="causal", gqa="interleave", scale_op="mul", softmax_dim=-1, transpose_out=True, dtype=None):
    """attend_with_cache with one deliberate mistake."""

    def attend(q, k, v, scale, num_cached):
        num_q, num_heads, _ = q.shape
        group = num_heads // k.shape[0]
        kk = k.repeat_interleave(group, 0) if gqa == "interleave" else k.repeat(group, 1, 1)
        vv = v.repeat_interleave(group, 0) if gqa == "interleave" else v.repeat(group, 1, 1)
        scores = q.transpose(0, 1) @ kk.transpose(1, 2)
        scores = scores * scale if scale_op == "mul" else (scores / scale if scale_op == "div" else scores)
        q_pos = torch.arange(num_q).unsqueeze(1) + (0 if mask == "ignores_num_cached" else num_cached)
        k_pos = torch.arange(k.shape[1]).unsqueeze(0)
        hide = {"causal": k_pos > q_pos, "ignores_num_cached": k_pos > q_pos, "one_ahead": k_pos > q_pos + 1,
                "strict": k_pos >= q_pos, "none": torch.zeros_like(k_pos > q_pos)}[mask]
        weights = torch.softmax(scores.masked_fill(hide, float("-inf")), dim=softmax_dim).nan_to_num(0.0)
        out = weights @ vv
        out = out.transpose(0, 1) if transpose_out else out
        return out.to(dtype) if dtype else out

    return attend


@pytest.mark.parametrize("kwargs, expected", [
    (dict(mask="ignores_num_cached"), "puts query i at position i, but it sits at position num_cached + i (num_cached = 11 here)"),
    (dict(mask="one_ahead"), "let query i see key num_cached+i+1"),
    (dict(mask="none"), "every query saw every key"),
    (dict(mask="strict"), "could not see its own key"),
    (dict(gqa="repeat"), "use repeat_interleave, not repeat"),
    (dict(scale_op="none"), "the scores were not scaled"),
    (dict(scale_op="div"), "you divided the scores by scale"),
    (dict(softmax_dim=1), "the softmax ran over the queries"),
    (dict(transpose_out=False), "returned shape [9, 6, 80], expected [num_q, num_heads, head_dim] = [6, 9, 80]"),
    (dict(dtype=torch.float64), "returned torch.float64, expected q's dtype torch.float32"),
])
def test_attend_check_names_the_mistake(kwargs, expected):
    with pytest.raises(CheckFailed) as failure:
        lab02.check_attend_with_cache(_variant(**kwargs))
    assert expected in str(failure.value), str(failure.value)
    if "shape" not in expected and "dtype" not in expected:
        assert re.search(r"out\[query \d+, head \d+, dim \d+\] = ", str(failure.value))


def test_attend_check_refuses_sdpa_none_and_in_place_changes():
    def via_sdpa(q, k, v, scale, num_cached):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def returns_none(q, k, v, scale, num_cached):
        attend_with_cache(q, k, v, scale, num_cached)

    def scales_q_in_place(q, k, v, scale, num_cached):
        q.mul_(scale)
        return attend_with_cache(q, k, v, 1.0, num_cached)

    for fn, expected in ((via_sdpa, "called F.scaled_dot_product_attention"), (returns_none, "returned None"),
                         (scales_q_in_place, "changed its input q in place")):
        with pytest.raises(CheckFailed, match=re.escape(expected)):
            lab02.check_attend_with_cache(fn)
    # The engine's own SDPA is untouched after the check.
    assert torch.nn.functional.scaled_dot_product_attention.__name__ != "refuse"


def test_unknown_mistakes_still_name_the_element():
    def off_by_a_bit(q, k, v, scale, num_cached):
        return attend_with_cache(q, k, v, scale, num_cached) + 0.01

    with pytest.raises(CheckFailed) as failure:
        lab02.check_attend_with_cache(off_by_a_bit)
    message = str(failure.value)
    assert "out[query 0, head 0, dim 0]" in message and "Likely cause" not in message
    assert "Query 0 sits at position num_cached + 0 = 0" in message


# --------------------------------------------------------------------- part 1: FLOP model
TINY = SimpleNamespace(hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2, intermediate_size=8, num_layers=1, vocab_size=10)


def test_step_flops_by_hand():
    # per layer: qkv 4*(4+2+2)=32, o 4*4=16, mlp 3*4*8=96 -> 144 weights; 288 FLOPs per token
    assert lab02.linear_params_per_layer(TINY) == 144
    # with a cache, context 3: 288 + 16 per key * 3 + logits 2*4*10
    assert lab02.step_flops(TINY, 3, kv_cache=True) == 288 + 48 + 80
    # without: 3 tokens * 288 + 16 * (1 + 2 + 3) + 80
    assert lab02.step_flops(TINY, 3, kv_cache=False) == 864 + 96 + 80
    assert lab02.step_flops(TINY, 1, True) == lab02.step_flops(TINY, 1, False)
    with pytest.raises(ValueError, match="context_len=0"):
        lab02.step_flops(TINY, 0, True)


SMOLLM2 = SimpleNamespace(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                          num_layers=30, vocab_size=49152)


def test_flop_ratio_and_growth_for_smollm2():
    from minillm.models.config import ModelConfig

    cfg = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, None, 8192, True, False, False, False, None, 1, (2,))
    embed_and_norms = cfg.vocab_size * cfg.hidden_size + cfg.hidden_size + cfg.num_layers * 2 * cfg.hidden_size
    assert cfg.num_layers * lab02.linear_params_per_layer(cfg) == cfg.num_params - embed_and_norms
    ratio = lab02.step_flops(cfg, 256, False) / lab02.step_flops(cfg, 256, True)
    assert 190 < ratio < 205
    # total work: linear with the cache, quadratic without
    with_100, with_200 = (lab02.total_flops(cfg, 16, n, True) for n in (100, 200))
    without_100, without_200 = (lab02.total_flops(cfg, 16, n, False) for n in (100, 200))
    assert 1.9 < with_200 / with_100 < 2.1
    assert 3.0 < without_200 / without_100 < 4.0
    rows = lab02.flops_table(cfg, (16, 4096))
    assert [r["context_len"] for r in rows] == [16, 4096] and rows[1]["ratio"] > rows[0]["ratio"]


def test_reveal_predictions_echoes_every_guess(capsys):
    truth = lab02.reveal_predictions(SMOLLM2, 200, "Quadratic", "linear")
    text = capsys.readouterr().out
    assert truth["growth_without_cache"] == "quadratic" and 190 < truth["ratio"] < 205
    assert "at context 256 (counted): you predicted 200x, measured 19" in text and "%, too high)" in text
    assert text.count(": right") == 2
    lab02.reveal_predictions(SMOLLM2, 2, "linear", "cubic")
    text = capsys.readouterr().out
    assert "x too low)" in text and "not this time" in text and "'cubic' is not one of" in text
    lab02.reveal_predictions(SMOLLM2, "lots")
    assert "'lots' is not a number" in capsys.readouterr().out
    lab02.reveal_predictions(SMOLLM2)
    assert capsys.readouterr().out.count("you predicted nothing") == 3


# --------------------------------------------------------------------- part 3: toggle view and summary
def _fake_result():
    contexts = list(range(16, 24))
    return {
        "device": "cpu: test", "prompt_len": 16, "num_steps": 8, "same_tokens": True, "first_different_token": None,
        "with cache": {"context_len": contexts, "duration_s": [0.2] + [0.05] * 7, "kind": ["prefill"] + ["decode"] * 7,
                       "num_tokens": [16] + [1] * 7},
        "without cache": {"context_len": contexts, "duration_s": [0.01 * n for n in contexts],
                          "kind": ["prefill"] + ["decode"] * 7, "num_tokens": contexts},
    }


def test_toggle_view_switches_between_step_time_and_running_total():
    view = lab02.KVToggleView(_fake_result())
    assert [t.name for t in view.figure.data] == ["kv_cache=True", "kv_cache=False"]
    assert list(view.figure.data[0].y) == pytest.approx([200.0] + [50.0] * 7)
    assert "cpu: test" in view.figure.layout.title.subtitle.text
    view.toggle.value = "total time"
    assert list(view.figure.data[0].y) == pytest.approx([0.2 + 0.05 * i for i in range(8)])
    assert view.figure.data[1].y[-1] == pytest.approx(0.01 * sum(range(16, 24)))
    assert view.figure.layout.yaxis.title.text == "seconds since the prompt arrived"
    view.toggle.value = "time per step"
    assert view.figure.data[1].y[0] == pytest.approx(160.0) and view.figure.layout.yaxis.title.text == "ms per step"


def test_summary_reports_slopes_ratios_and_flops(capsys, experiments):
    step_ratio, total_ratio = lab02.reference_kv_speedup(_fake_result())
    summary = experiments["summarize_kv_toggle"](_fake_result(), step_ratio, total_ratio, SMOLLM2)
    assert summary["without cache"]["ms_per_extra_token"] == pytest.approx(10.0)
    assert summary["with cache"]["ms_per_extra_token"] == pytest.approx(0.0, abs=1e-9)
    assert summary["with cache"]["last_context_len"] == 23
    assert summary["last_step_ratio"] == pytest.approx(215 / 50)  # median of the last 4 decode steps: 21, 22 -> 0.215 s
    assert summary["total_ratio"] == pytest.approx(sum(0.01 * n for n in range(16, 24)) / 0.55)
    assert summary["flops_ratio_at_last"] == pytest.approx(lab02.step_flops(SMOLLM2, 23, False) / lab02.step_flops(SMOLLM2, 23, True))
    lab02.print_kv_toggle_summary(summary)
    text = capsys.readouterr().out
    assert "measured on cpu: test" in text and "step at context 23: 50.0 ms with the cache, 215.0 ms without (4.3x)" in text
    assert "the cache changes the cost, not the result" in text
    lab02.print_kv_toggle_summary({**summary, "same_tokens": False, "first_different_token": 5})
    assert "the tokens differ from token 5 on" in capsys.readouterr().out


# --------------------------------------------------------------------- part 4: cache size
def test_cache_size_solution_values():
    assert kv_cache_bytes_per_token(30, 3, 64, 4) == 46_080
    assert kv_cache_bytes_per_token(30, 3, 64, 2) == 23_040
    assert kv_cache_bytes_per_token(32, 32, 128, 2) == 524_288
    assert kv_cache_bytes_per_token(80, 8, 128, 2) == 327_680
    assert kv_cache_bytes_per_token(80, 64, 128, 2) == 8 * 327_680
    assert kv_cache_bytes(16, 4000, 32, 32, 128, 2) == 33_554_432_000
    assert lab02.bytes_to_human(33_554_432_000) == "33.55 GB (31.25 GiB)"


def test_worked_examples_table(capsys):
    rows = lab02.worked_examples(kv_cache_bytes_per_token)
    by_name = {(r["model"], r["dtype"]): r["bytes_per_token"] for r in rows}
    assert by_name[("SmolLM2-135M (GQA 9:3)", "fp32")] == 46_080
    assert by_name[("SmolLM2-135M (GQA 9:3)", "bf16 / fp16")] == 23_040
    assert by_name[("Llama-2-7B (MHA, 32 KV heads)", "bf16 / fp16")] == 524_288
    assert by_name[("Llama-2-70B (GQA 64:8)", "bf16 / fp16")] == 327_680
    assert by_name[("Llama-2-70B without GQA (64 KV heads)", "bf16 / fp16")] == 2_621_440
    lab02.print_worked_examples(rows)
    assert "524,288" in capsys.readouterr().out


def test_size_explorer_updates_on_every_control():
    explorer = lab02.KVSizeExplorer(kv_cache_bytes)
    cache, total, memory, marker = explorer.figure.data
    assert list(marker.y) == pytest.approx([33.554432])  # 16 users x 4,000 tokens on Llama-2-7B, fp16
    assert cache.y[0] == pytest.approx(33.554432 / 16) and len(cache.x) == explorer.MAX_USERS
    assert total.y[0] - cache.y[0] == pytest.approx(6.74e9 * 2 / 1e9)
    memory_bytes, label = lab02.device_memory_bytes()
    assert list(memory.y) == pytest.approx([memory_bytes / 1e9] * 2) and memory.name == label
    assert "33.55 GB (31.25 GiB)" in explorer.readout.value

    explorer.users.value = 32
    assert list(explorer.figure.data[3].y) == pytest.approx([2 * 33.554432])
    explorer.context.value = 8192
    assert list(explorer.figure.data[3].y) == pytest.approx([32 * 8192 * 524_288 / 1e9])
    explorer.model.value = "Llama-2-70B (GQA 64:8)"
    assert list(explorer.figure.data[3].y) == pytest.approx([32 * 8192 * 327_680 / 1e9])
    assert "Llama-2-70B (GQA 64:8)" in explorer.figure.layout.title.text
    explorer.dtype.value = "fp32"
    assert list(explorer.figure.data[3].y) == pytest.approx([32 * 8192 * 655_360 / 1e9])
    assert explorer.figure.data[1].y[0] - explorer.figure.data[0].y[0] == pytest.approx(68.98e9 * 4 / 1e9)
    assert "Does not fit" in explorer.readout.value or memory_bytes > 1e12


def test_size_explorer_surfaces_an_unfinished_exercise():
    def stub(*args):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        lab02.KVSizeExplorer(stub)


def test_decode_traffic_counts_weights_once_and_cache_per_user(capsys):
    shape = lab02.MODEL_SHAPES["Llama-2-7B (MHA, 32 KV heads)"]
    one = lab02.decode_step_traffic(shape, 2, batch=1, context_len=4000)
    sixteen = lab02.decode_step_traffic(shape, 2, batch=16, context_len=4000)
    assert one["weight_gb"] == sixteen["weight_gb"] == pytest.approx(13.48)
    assert sixteen["kv_gb"] == pytest.approx(33.554432) and one["kv_gb"] == pytest.approx(33.554432 / 16)
    assert sixteen["flops_per_byte"] == pytest.approx(16 * 2 * 6.74e9 / (13.48e9 + 33.554432e9))
    rows = lab02.print_decode_traffic()
    assert len(rows) == 6 and "one decode step of Llama-2-7B" in capsys.readouterr().out


# --------------------------------------------------------------------- the real engine
@pytest.fixture(scope="module")
def llm():
    from minillm import LLM

    return LLM(dtype="float32")  # fp32 everywhere: exact token equality holds on a GPU too


@pytest.fixture(scope="module")
def llm_no_cache():
    from minillm import LLM

    return LLM(kv_cache=False, dtype="float32")


PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_reference_solution_in_the_engine_gives_the_engines_own_tokens(llm, passes, experiments):
    from minillm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    builtin = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    backend = experiments["plug_in"](llm, append_kv, attend_with_cache)
    try:
        assert llm.config.attention_backend is backend
        ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.set_attention_backend("torch")
    assert ours == builtin and len(ours[0]) == 6
    message = passes(lab02.check_in_engine, append_kv, attend_with_cache, llm, prompts=PROMPTS, max_tokens=6)
    assert message.startswith("✓") and "kv_cache=True" in message and llm.device in message
    assert llm.config.attention_backend == "torch"


def test_reference_solution_without_a_cache(llm_no_cache, passes):
    message = passes(lab02.check_in_engine, append_kv, attend_with_cache, llm_no_cache, prompts=PROMPTS[:1], max_tokens=3)
    assert "kv_cache=False" in message


def test_engine_check_points_at_the_decode_mask(llm):
    with pytest.raises(CheckFailed) as failure:
        lab02.check_in_engine(append_kv, _variant(mask="ignores_num_cached"), llm, prompts=PROMPTS, max_tokens=6)
    message = str(failure.value)
    assert message.startswith("token 1 of prompt 0 ('The capital of France is') differs (made by decode step 1)")
    assert "a decode step (1 query, num_cached=5)" in message and "sits at position num_cached + i" in message
    assert llm.config.attention_backend == "torch", "a failing check must restore the engine's backend"


def test_engine_check_points_at_a_prefill_mask_and_at_append(llm):
    with pytest.raises(CheckFailed) as failure:
        lab02.check_in_engine(append_kv, _variant(gqa="repeat"), llm, prompts=PROMPTS, max_tokens=6)
    assert "(the first token, made by the prefill)" in str(failure.value)
    assert "attention call #0, a prefill (5 queries, num_cached=0)" in str(failure.value)
    with pytest.raises(CheckFailed, match="after append_kv, k_cache"):
        lab02.check_in_engine(_into_first_slots, attend_with_cache, llm, prompts=PROMPTS, max_tokens=6)


def test_engine_check_forgives_a_near_tie_when_every_call_matched(llm, capsys, passes):
    """A token that flips although every attention call matched the reference is rounding, not a bug."""
    checked = lab02.common.check_engine(llm)  # the check's engine: the same weights, a small KV pool
    key = (id(checked.engine), True, (PROMPTS[0],), 3)
    true_tokens = lab02.reference_tokens(checked, PROMPTS[:1], 3)
    lab02._REFERENCE_TOKENS[key] = [[true_tokens[0][0], true_tokens[0][1], true_tokens[0][2] + 1]]
    try:
        message = passes(lab02.check_in_engine, append_kv, attend_with_cache, llm, prompts=PROMPTS[:1], max_tokens=3)
    finally:
        lab02._REFERENCE_TOKENS[key] = true_tokens
    assert message.startswith("✓") and "a near-tie flipped: token 2 of prompt 0" in message
    with pytest.raises(CheckFailed):  # a real bug is never excused
        lab02._REFERENCE_TOKENS[key] = [[t + 1 for t in true_tokens[0]]]
        try:
            lab02.check_in_engine(append_kv, _variant(mask="none"), llm, prompts=PROMPTS[:1], max_tokens=3)
        finally:
            lab02._REFERENCE_TOKENS[key] = true_tokens


def test_engine_check_lets_not_implemented_through(llm):
    def stub(*args):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        lab02.check_in_engine(stub, attend_with_cache, llm, prompts=PROMPTS[:1], max_tokens=2)
    assert llm.config.attention_backend == "torch"
    # the aborted request left nothing behind: the engine still generates
    from minillm import SamplingParams

    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_kv_toggle_measures_both_modes_step_by_step(llm, llm_no_cache, experiments):
    measure_kv_toggle = experiments["measure_kv_toggle"]
    result = measure_kv_toggle(llm, llm_no_cache, prompt_len=8, num_steps=4)
    assert result["same_tokens"] and result["first_different_token"] is None and result["device"] == llm.device
    assert result["with cache"]["context_len"] == [8, 9, 10, 11] == result["without cache"]["context_len"]
    assert result["with cache"]["num_tokens"] == [8, 1, 1, 1]
    assert result["without cache"]["num_tokens"] == [8, 9, 10, 11]
    assert result["with cache"]["kind"] == ["prefill", "decode", "decode", "decode"]
    assert all(d > 0 for d in result["without cache"]["duration_s"])
    with pytest.raises(ValueError, match="LLM\\(kv_cache=True\\) then an LLM\\(kv_cache=False\\)"):
        measure_kv_toggle(llm_no_cache, llm)
    view = lab02.KVToggleView(result)
    assert view.figure.data[1].x == (8, 9, 10, 11)


def test_cache_formula_matches_the_engines_count(llm):
    from minillm import SamplingParams

    cfg = llm.model_config
    llm.generate([{"prompt_token_ids": list(range(1, 21))}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.stats.peak_kv_bytes == kv_cache_bytes(1, 23, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4)
    assert kv_cache_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4) == 46_080
    assert math.isclose(llm.stats.peak_kv_bytes / 46_080, 23)


# --------------------------------------------------------------------- the graded checks fail on plausible mistakes
_ATTEND = """
def attend_with_cache(q, k, v, scale, num_cached):
    num_q, num_heads, head_dim = q.shape
    group = num_heads // k.shape[0]
    k = k.{expand}(group{dim})
    v = v.{expand}(group{dim})
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)){scale}
    q_pos = {first} + torch.arange(num_q).unsqueeze(1)
    k_pos = torch.arange(k.shape[1]).unsqueeze(0)
    weights = torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
    return (weights @ v){out}
"""


def _attend(expand="repeat_interleave", dim=", dim=0", scale=" * scale", first="num_cached", out=".transpose(0, 1)"):
    return _ATTEND.format(expand=expand, dim=dim, scale=scale, first=first, out=out)


_STEP_RATIO = """
import statistics, time
def kv_step_ratio(step_with_cache, step_without_cache, clock=time.perf_counter, warmup=2, repeats=10):
    def time_steps(step):
        samples = []
        for i in range(warmup + repeats):
            start = {read}
            step()
            elapsed = {read} - start
            if {keep}:
                samples.append(elapsed)
        return {{"median": {stat}(samples), "min": min(samples), "max": max(samples)}}
    fast, slow = time_steps(step_with_cache), time_steps(step_without_cache)
    return {{"with cache": fast, "without cache": slow, "ratio": {ratio}}}
"""


def _step_ratio(read="clock()", keep="i >= warmup", stat="statistics.median", ratio='slow["median"] / fast["median"]'):
    return _STEP_RATIO.format(read=read, keep=keep, stat=stat, ratio=ratio)


KERNEL_LINE = {  # a wrong kernel: the solution with one line changed (old, new)
    "no_mask": [("tl.load(k_new_ptr + src, mask=in_row), mask=in_row)", "tl.load(k_new_ptr + src))"),
                ("tl.load(v_new_ptr + src, mask=in_row), mask=in_row)", "tl.load(v_new_ptr + src))")],
    "mask_off_by_one": [("in_row = dims < head_dim", "in_row = dims <= head_dim")],
    "token_major_pool": [("dst = (head * num_slots + slot) * head_dim + dims", "dst = (slot * num_kv_heads + head) * head_dim + dims")],
    "slot_is_token": [("slot = tl.load(slots_ptr + token)", "slot = token")],
}


def kernel_mistake(name: str) -> str:
    """The learner's notebook with a wrong kernel: the kernel cell, then the launcher cell, re-run."""
    return f"store_kv_kernel = WRONG[{name!r}]\n{LAUNCHER_SOURCE}"


LAUNCHER_SOURCE = next(c.source for c in nbformat.read(MASTER, as_version=4).cells
                       if c.cell_type == "code" and c.source.startswith(LAUNCHER))


MISTAKES = {
    "test_append_kv": [
        ("def append_kv(k_cache, v_cache, k_new, v_new, slots):\n"  # token i into slot i
         "    k_cache[:, :len(slots)] = k_new.transpose(0, 1)\n    v_cache[:, :len(slots)] = v_new.transpose(0, 1)\n",
         "token i went to slot i; it belongs in slot slots[i]"),
        ("def append_kv(k_cache, v_cache, k_new, v_new, slots):\n"  # the keys into both pools
         "    k_cache[:, slots] = k_new.transpose(0, 1)\n    v_cache[:, slots] = k_new.transpose(0, 1)\n",
         "v_cache holds the keys"),
        ("def append_kv(k_cache, v_cache, k_new, v_new, slots):\n"  # slots index the first (head) dimension: crashes
         "    k_cache[slots] = k_new.transpose(0, 1)\n    v_cache[slots] = v_new.transpose(0, 1)\n",
         "Case: prefill of 7 tokens into slots 10..16 (head_dim 80, 3 KV heads) raised RuntimeError"),
    ],
    "test_attend_with_cache": [
        (_attend(first="0"), "sits at position num_cached + i"),  # forgot the cached keys before the queries
        (_attend(expand="repeat", dim=", 1, 1"), "use repeat_interleave, not repeat"),  # head h reads kv head h % n
        (_attend(scale=""), "the scores were not scaled"),
    ],
    "test_in_engine": [
        (_attend(first="0"), "made by decode step"),
        ("def append_kv(k_cache, v_cache, k_new, v_new, slots):\n"
         "    k_cache[:, :len(slots)] = k_new.transpose(0, 1)\n    v_cache[:, :len(slots)] = v_new.transpose(0, 1)\n",
         "after append_kv, k_cache[:, slots] does not hold"),
        (_attend(out=""), "raised RuntimeError: Sizes of tensors must match except in dimension 0. Expected size 5 but "
                          "got size 13 for tensor number 1 in the list. attend_with_cache returned shape [9, 5, 64], "
                          "expected [num_q, num_heads, head_dim]"),  # forgot the final transpose: the engine crashes
    ],
    "test_store_kv_kernel": [
        (kernel_mistake("no_mask"), "lanes past head_dim must be masked"),
        (kernel_mistake("mask_off_by_one"), "Case: one decode token into slot 9, head_dim 80"),
        (kernel_mistake("token_major_pool"), "Note the layouts differ"),
        (kernel_mistake("slot_is_token"), "token i went to slot i"),
    ],
    "test_measure_kv_step_ratio": [
        (_step_ratio(keep="True"), "warm-up included"),
        (_step_ratio(stat="statistics.fmean"), "the mean"),
        (_step_ratio(stat="min"), "the minimum"),
        (_step_ratio(ratio='fast["median"] / slow["median"]'), "upside down"),
        (_step_ratio(read="time.perf_counter()"), "never read `clock`"),
    ],
    "test_kv_cache_bytes_per_token": [
        ("def kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value):\n"
         "    return num_layers * num_kv_heads * head_dim * bytes_per_value\n",
         "kv_cache_bytes_per_token(30, 3, 64, 2) returned 1.152e+04, expected 2.304e+04: SmolLM2-135M, bf16"),
        ("def kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value):\n"
         "    return 2 * num_layers * num_kv_heads * head_dim * 2\n",
         "kv_cache_bytes_per_token(30, 3, 64, 4)"),
        ("def kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value):\n"
         "    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_value * 8\n",
         "not bits"),
    ],
    "test_kv_cache_bytes": [
        ("def kv_cache_bytes(num_users, tokens_per_user, num_layers, num_kv_heads, head_dim, bytes_per_value):\n"
         "    return tokens_per_user * kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value)\n",
         "you left out num_users"),
        ("def kv_cache_bytes(num_users, tokens_per_user, num_layers, num_kv_heads, head_dim, bytes_per_value):\n"
         "    return num_users * tokens_per_user * kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim,"
         " bytes_per_value) / 1e9\n",
         "return bytes, not GB"),
        ("def kv_cache_bytes(num_users, tokens_per_user, num_layers, num_kv_heads, head_dim, bytes_per_value):\n"
         "    return num_users * kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value)\n",
         "you left out tokens_per_user"),
    ],
    "test_answer_users_on_80gb": [
        ("answer_users_on_80gb = 38", "answer_users_on_80gb = 38 is not right: you left out the weights"),
        ("answer_users_on_80gb = 32", "answer_users_on_80gb = 32 is not right: you rounded up"),
        ("answer_users_on_80gb = 34", "answer_users_on_80gb = 34 is not right: 80 GB is 80 x 10^9 bytes"),
        ("answer_users_on_80gb = 31.7", "answer_users_on_80gb = 31.7: a whole number"),
    ],
}


@pytest.fixture(scope="module")
def wrong_kernels(tmp_path_factory) -> dict:
    """Each KERNEL_LINE variant of the solution kernel, imported from its own file (Triton reads the source)."""
    source = solution_source(MASTER, MODULE_HEADER, LAUNCHER)
    folder = tmp_path_factory.mktemp("lab02_wrong")
    kernels = {}
    for name, changes in KERNEL_LINE.items():
        wrong = source
        for old, new in changes:
            assert wrong.count(old) == 1, (name, old)
            wrong = wrong.replace(old, new)
        path = folder / f"lab02_{name}.py"
        path.write_text(wrong)
        kernels[name] = import_file(path, f"lab02_{name}").store_kv_kernel
    return kernels


@pytest.fixture(scope="module")
def graded_namespace(llm, llm_no_cache, solution, wrong_kernels) -> dict:
    """What the graded test cells read: the master's solution cells (imported from a file, for the kernel), the
    launcher, and the setup cell's names (quick mode)."""
    from minillm import SamplingParams

    from minillm.lab import common

    ns = {name: value for name, value in vars(solution).items() if not name.startswith("__")}
    ns.update({"lab02": lab02, "common": common, "torch": torch, "statistics": __import__("statistics"),
               "time": __import__("time"), "SamplingParams": SamplingParams, "WRONG": wrong_kernels,
               "llm": llm, "llm_no_cache": llm_no_cache, "cfg": llm.model_config, "KV_BYTES_PER_VALUE": 4,
               "CHECK_PROMPTS": lab02.DEFAULT_CHECK_PROMPTS[:2], "CHECK_TOKENS": 6})
    exec(compile(LAUNCHER_SOURCE, "<launcher>", "exec"), ns)   # its globals are ns: the kernel is looked up there
    common.check_engine(llm).set_attention_backend("torch")    # as test_in_engine leaves it (llm_backend_restored)
    return ns


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, m, case) for gid, entries in MISTAKES.items() for m, case in entries],
                         ids=[f"{gid}-{i}" for gid, entries in MISTAKES.items() for i in range(len(entries))])
def test_graded_check_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)
    assert llm_backend_restored(graded_namespace)


def llm_backend_restored(namespace) -> bool:
    """The check's engine (the same weights, a small KV pool) has the engine's own backend again."""
    return lab02.common.check_engine(namespace["llm"]).config.attention_backend == "torch"


def test_toggle_speedup_on_made_up_runs():
    step, total = lab02.reference_kv_speedup(lab02.made_up_run([0.5, 0.1, 0.1, 0.3, 0.1], [0.5, 0.6, 0.7, 0.8, 0.9]))
    assert step == pytest.approx(7.5) and total == pytest.approx(3.5 / 1.1)
    assert lab02.reference_kv_speedup(lab02.made_up_run([0.2], [0.3]))[0] is None


# --------------------------------------------------------------------- exercise 3: the kernel; 4: the harness
def test_solution_kernel_passes_every_case(solution, passes):
    assert passes(lab02.check_store_kv, solution.store_kv).startswith("✓ store_kv: all 3")
    assert passes(lab02.check_store_kv, solution.store_kv, lab02.HIDDEN_KERNEL_CASES, 5).startswith("✓ store_kv: all 2")


def test_stub_kernel_raises_not_implemented(tmp_path):
    source = solution_source(MASTER, MODULE_HEADER, LAUNCHER)
    start = source.index("    ### BEGIN SOLUTION\n    slot = tl.load")
    end = source.index("    ### END SOLUTION\n", start)
    stubbed = source[:start] + "    # YOUR CODE HERE\n    raise NotImplementedError()\n" + source[end + len("    ### END SOLUTION\n"):]
    path = tmp_path / "lab02_stub.py"
    path.write_text(stubbed)
    module = import_file(path, "lab02_stub")
    with pytest.raises(NotImplementedError, match="store_kv_kernel is still a stub"):
        module.store_kv(*(torch.zeros(1, 2, 4) for _ in range(4)), torch.tensor([0]))


def test_solution_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """What the interpreter forgives (types, shapes, an int64 slot in the offsets) fails here, without a GPU."""
    path = tmp_path / "lab02_aot.py"
    path.write_text(solution_source(MASTER, MODULE_HEADER, LAUNCHER))
    jobs = [("store_kv_kernel",
             {"k_cache_ptr": "*" + dtype, "v_cache_ptr": "*" + dtype, "k_new_ptr": "*" + dtype,
              "v_new_ptr": "*" + dtype, "slots_ptr": "*i64", "num_kv_heads": "i32", "num_slots": "i32",
              "head_dim": "i32", "BLOCK_D": "constexpr"},
             {"BLOCK_D": 128}) for dtype in ("fp32", "bf16", "fp16")]
    assert_compiles_for_gpus(path, jobs)


def test_engine_runs_the_learner_kernel_with_its_own_tokens(llm, solution, experiments, capsys):
    result = experiments["run_with_kernel"](llm, solution.store_kv, ["The capital of France is"], 2)
    assert result["equal"] and result["kernel_calls"] == 2 * llm.model_config.num_layers, result   # prefill + 1 decode
    lab02.print_kernel_run(result)
    assert "✓ the same as the engine's own backend" in capsys.readouterr().out


def test_kernel_timing_says_so_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU: tests/test_gpu_kernels.py times kernels")
    lab02.print_kernel_timing(lab02.time_store_kv(lambda *args: None))
    assert "No GPU here" in capsys.readouterr().out


def test_step_ratio_check_passes_the_solution_and_the_stepper_runs_the_engine(solution, llm, llm_no_cache, passes):
    assert passes(lab02.check_kv_step_ratio, solution.kv_step_ratio).startswith("✓ kv_step_ratio: all 3")
    ids = lab02.common.prompt_token_ids(llm.tokenizer, 12)
    cached, uncached = lab02.DecodeStepper(llm, ids, 3), lab02.DecodeStepper(llm_no_cache, ids, 3)
    steps_before = len(llm.stats.steps)
    result = solution.kv_step_ratio(cached, uncached, warmup=1, repeats=2)
    assert cached.calls == uncached.calls == 3 and cached.context_len == 15
    assert all(result[k]["min"] <= result[k]["median"] <= result[k]["max"] for k in ("with cache", "without cache"))
    assert result["ratio"] == pytest.approx(result["without cache"]["median"] / result["with cache"]["median"])
    assert not llm.engine.has_unfinished() and not llm_no_cache.engine.has_unfinished()
    with pytest.raises(RuntimeError, match="all 3 decode steps are spent"):
        cached()
    with pytest.raises(ValueError, match="num_steps=0"):
        lab02.DecodeStepper(llm, ids, 0)
    assert steps_before >= 0
    lab02.print_step_ratio(result, 12)
    figure = lab02.plot_step_times(result, "cpu: test")
    assert list(figure.data[0].x) == ["with cache", "without cache"]


def test_users_on_80gb_answer_counts_whole_users(capsys):
    assert lab02.users_that_fit() == 31 and lab02.users_that_fit(memory_bytes=80 * 2**30) == 34
    lab02.check_answer_users_on_80gb(31)
    assert "31 users" in capsys.readouterr().out
    for wrong, why in ((None, "set it"), ("31", "set it"), (63, "a key AND a value"), (15, "not 4"), (20, "GB of cache")):
        with pytest.raises(CheckFailed, match=why):
            lab02.check_answer_users_on_80gb(wrong)
