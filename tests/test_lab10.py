"""Lab 10 (many models, one engine): the master's solutions pass every check; the checks name each usual mistake (every
token on the first token's adapter, adapters off by one, segment index taken as slot, a length taken as an end, the
base model forgotten or counted per adapter, no renormalisation, a bf16 softmax, the routing weight forgotten, gate and
up swapped, one expert per token, an assignment where outputs add up, "8x7B" read as 2 x 7B); every graded test cell
fails on two or more plausible mistakes (MISTAKES, run by lab_utils.assert_check_fails); the engine's parts
(lora_delta, moe_router, moe_experts) give the engine's own tokens with the solutions and refuse what they cannot run;
the experts-touched sweep, the bytes model and the figures come out right. Everything runs on tiny random models
(random:tiny-llama with random adapters, random:tiny-mixtral), not the default model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from lab_utils import (assert_check_fails, assert_master_structure, nbgrader_cells, notebook_functions,
                       run_solution_cells, solution_fixture, student_stubs)

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab10
from minillm.lab.common import CheckFailed, figure_subtitle

MASTER = SOURCE_DIR / "10_many_models" / "10_many_models.ipynb"
EXERCISES = {"lora_delta_gather", "lora_delta_segments", "measure_memory", "route_topk", "moe_dispatch",
             "answer_active_params_b"}
GRADED = {"test_lora_delta_gather": 2, "test_lora_delta_segments": 2, "test_lora_in_engine": 2,
          "test_measure_memory": 2, "test_route_topk": 2, "test_moe_dispatch": 2, "test_answer_active_params_b": 1}
DEVICE = "cpu: test device"

solution = solution_fixture(MASTER, {"lab10": lab10, "torch": torch, "F": F})


@pytest.fixture(scope="module")
def experiments() -> dict:
    from minillm import LLM, SamplingParams
    from minillm.bench import lora as lora_bench

    return notebook_functions(MASTER, "lora_runs", "moe_run", "experts_touched", lab10=lab10, LLM=LLM,
                              SamplingParams=SamplingParams, lora_bench=lora_bench)


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """random:tiny-llama with LoRA on, and three random adapters (ranks 4, 8, 16) large enough to change its tokens."""
    from minillm import LLM
    from minillm.bench.lora import random_adapter
    from minillm.layers.lora import layer_shapes
    from minillm.lora import LoRARequest

    llm = LLM("random:tiny-llama", enable_lora=True, max_loras=3, max_lora_rank=16, seed=0)
    root = tmp_path_factory.mktemp("lab10-adapters")
    requests = [LoRARequest(f"adapter{i}", i + 1, random_adapter(str(root / f"a{i}"), layer_shapes(llm.engine.model),
                                                                    rank=rank, seed=i, std=0.5))
                for i, rank in enumerate((4, 8, 16))]
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, llm.model_config.vocab_size, (4 + 3 * i,), generator=gen).tolist()}
               for i in range(4)]
    return llm, requests, prompts


def test_master_has_every_graded_piece_with_hidden_tests():
    assert_master_structure(MASTER, EXERCISES, GRADED, 13)


def test_student_copy_has_stubs_and_no_solution():
    stubs = student_stubs(REPO_ROOT / "labs" / "10_many_models.ipynb", EXERCISES)
    assert "bmm" not in stubs["lora_delta_gather"] and "index_add_" not in stubs["moe_dispatch"]
    assert "12.9" not in stubs["answer_active_params_b"]


# --------------------------------------------------------------------- the solutions pass
def test_solution_passes_every_check(solution):
    for seed in (0, 1, 2, 3):
        lab10.check_lora_gather(solution["lora_delta_gather"], seed=seed)
        lab10.check_lora_segments(solution["lora_delta_segments"], seed=seed)
        lab10.check_route(solution["route_topk"], seed=seed)
        lab10.check_dispatch(solution["moe_dispatch"], seed=seed)
    rows = [{"num_adapters": 1, "adapter_bytes": 1e6}, {"num_adapters": 3, "adapter_bytes": 5e6}]
    lab10.check_memory(solution["memory_for"], rows, 2e8)
    lab10.check_answer_active_params_b(solution["answer_active_params_b"])
    assert lab10.active_params_b() == pytest.approx(12.9, abs=0.05)


def test_segments_of_builds_the_engine_segments():
    starts, lens, slots = lab10.segments_of([1, 1, 1, 0, 0, 2, 2, 1])
    assert starts.tolist() == [0, 5, 7] and lens.tolist() == [3, 2, 1] and slots.tolist() == [1, 2, 1]
    assert [t.tolist() for t in lab10.segments_of([0, 0])] == [[], [], []]


# --------------------------------------------------------------------- the plug-in points in the engine
def test_lora_runs_on_the_solution_and_on_a_wrong_delta(tiny_lora, solution, experiments, capsys):
    llm, requests, prompts = tiny_lora
    owners = [None, *requests]
    result = experiments["lora_runs"](llm, prompts, owners, solution["lora_delta_gather"],
                                      solution["lora_delta_segments"], 5)
    assert result["plugged"]["gather"] == result["engine"] == result["plugged"]["segments"]
    assert result["merged"] == result["engine"] and result["merged_diff"] < 1e-5
    assert len({tuple(t) for t in result["engine"]}) > 1, "the adapters change the tokens"
    lab10.check_engine_runs(result)
    lab10.print_engine_runs(result)
    assert "4 of 4 requests" in capsys.readouterr().out

    def shifted(x, a, b, seg_starts, seg_lens, seg_slots):   # segment i on slot i + 1
        return solution["lora_delta_segments"](x, a, b, seg_starts, seg_lens,
                                               torch.arange(1, len(seg_slots) + 1, dtype=torch.int32))

    wrong = experiments["lora_runs"](llm, prompts, [requests[2], requests[0], None, requests[1]],
                                     solution["lora_delta_gather"], shifted, 5)
    with pytest.raises(CheckFailed, match="your segments delta in the engine"):
        lab10.check_engine_runs(wrong)
    # the engine's own delta is back after a plugged run, and after one that raised
    again = experiments["lora_runs"](llm, prompts, owners, solution["lora_delta_gather"], shifted, 5)
    assert again["engine"] == result["engine"]

    def broken(x, a, b, seg_starts, seg_lens, seg_slots):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        experiments["lora_runs"](llm, prompts, owners, solution["lora_delta_gather"], broken, 3)
    assert experiments["lora_runs"](llm, prompts, owners, solution["lora_delta_gather"],
                                    solution["lora_delta_segments"], 5)["engine"] == result["engine"]


def test_the_lora_delta_part_refuses_what_it_cannot_run(tiny_lora):
    from minillm import LLM, SamplingParams

    llm, requests, prompts = tiny_lora
    with pytest.raises(ValueError, match="lora_delta= needs enable_lora=True"):
        LLM("random:tiny-llama", lora_delta=lambda x, a, b, batch: None)
    with pytest.raises(ValueError, match="lora_delta=3 is not callable; a LoRADelta is a function lora_delta"
                                         r"\(x, a, b, batch\)"):
        llm.with_levers(lora_delta=3)
    with pytest.raises(ValueError, match=r"cannot be called as lora_delta\(x, a, b, batch\)"):
        llm.with_levers(lora_delta=lambda x, a, b: None)
    wrong = llm.with_levers(lora_delta=lambda x, a, b, batch: torch.zeros(x.shape[0], 1))
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(\d+, \d+\)"):
        wrong.generate(prompts[:1], SamplingParams(max_tokens=2), lora_request=requests[0])
    assert len(llm.generate(prompts[:1], SamplingParams(max_tokens=2), lora_request=requests[0])[0].outputs[0].token_ids) == 2


def test_moe_run_on_the_solution_and_on_a_wrong_dispatch(solution, experiments):
    result = experiments["moe_run"](solution["route_topk"], solution["moe_dispatch"], num_prompts=3, max_tokens=6)
    assert result["equal"] and result["num_experts"] == 4
    lab10.check_moe_run(result)

    def no_weights(x, weights, ids, w13, w2):
        return solution["moe_dispatch"](x, torch.ones_like(weights), ids, w13, w2)

    wrong = experiments["moe_run"](solution["route_topk"], no_weights, num_prompts=3, max_tokens=6)
    assert not wrong["equal"]
    with pytest.raises(CheckFailed, match="parts from the engine's own tokens"):
        lab10.check_moe_run(wrong)
    with pytest.raises(CheckFailed, match="run the cell above"):
        lab10.check_moe_run(None)


def test_the_moe_parts_refuse_models_they_cannot_run():
    from minillm import LLM

    route = lambda logits, k: None  # noqa: E731
    with pytest.raises(ValueError, match="moe_router: this model has no mixture-of-experts layers"):
        LLM("random:tiny-llama", moe_router=route)
    with pytest.raises(ValueError, match="moe_router: Mixtral-style MoE only"):
        LLM("random:tiny-qwen2-moe", moe_router=route)
    with pytest.raises(ValueError, match="moe_experts='loop' is not callable"):
        LLM("random:tiny-mixtral", moe_experts="loop")


def test_experts_touched_follow_the_uniform_model_and_the_bytes_figure(experiments, capsys):
    from minillm import LLM

    llm = LLM(lab10.register_moe_preset(), seed=0, max_num_seqs=8)
    rows = experiments["experts_touched"](llm, (1, 4, 8), 5)
    assert rows[0]["experts_touched"] == 2.0 and all(r["steps"] == 4 for r in rows)
    for row in rows[1:]:   # a random router: near E(1 - (1 - k/E)^B), not on it
        expected = lab10.experts_model(8, 2, [row["batch"]])[0]
        assert abs(row["experts_touched"] - expected) < 1.5, (row, expected)
    lab10.print_touched(rows, 8, 2, DEVICE)
    assert "E(1-(1-k/E)^B)" in capsys.readouterr().out
    table = lab10.bytes_rows(rows)
    for r in table:
        assert r["dense_active"] <= r["moe_measured"] <= r["dense_total"]
    assert table[0]["moe_measured"] == pytest.approx(table[0]["dense_active"])
    fig = lab10.bytes_figure(table, DEVICE)
    assert len(fig.data) == 4 and DEVICE in figure_subtitle(fig)


def test_throughput_and_memory_printouts(capsys, solution):
    rows = [{"num_adapters": 1, "batched_tok_s": 20.0, "swap_tok_s": 10.0, "adapter_bytes": 2 ** 20,
             "merged_copies_bytes": 500 * 2 ** 20},
            {"num_adapters": 4, "batched_tok_s": 18.0, "swap_tok_s": 6.0, "adapter_bytes": 4 * 2 ** 20,
             "merged_copies_bytes": 2000 * 2 ** 20}]
    lab10.print_throughput(rows, DEVICE)
    assert "3.00x" in capsys.readouterr().out
    fig = lab10.throughput_figure(rows, DEVICE)
    assert [list(t.y) for t in fig.data] == [[20.0, 18.0], [10.0, 6.0]]
    memory = solution["memory_for"](rows, 500 * 2 ** 20, 100)
    assert memory["ratio"] == pytest.approx(100 * 500 / (500 + 100))
    lab10.print_memory(memory, 500 * 2 ** 20)
    assert "83x less memory" in capsys.readouterr().out
    lab10.print_param_counts()
    assert "12.88B" in capsys.readouterr().out


def test_adapter_paths_in_quick_mode_never_train(tiny_lora, tmp_path, monkeypatch):
    from minillm import adapters

    def no_training(*args, **kwargs):
        raise AssertionError("quick mode trained an adapter")

    monkeypatch.setattr(adapters, "build_adapter", no_training)
    monkeypatch.setattr(adapters, "train_adapter", no_training)
    llm, _requests, _prompts = tiny_lora   # a random model: none of the trained adapters fit it, all random
    paths = lab10.adapter_paths(llm, train=False, workdir=str(tmp_path))
    assert list(paths) == ["random1", "random2", "random3"]
    assert all(os.path.isfile(os.path.join(p, "adapter_config.json")) for p in paths.values())


# --------------------------------------------------------------------- every graded cell fails on plausible mistakes
GATHER_FIRST = '''def lora_delta_gather(x, a, b, token_slots):   # every token on the first token's adapter
    s = int(token_slots[0])
    return (x @ a[s].T) @ b[s].T
'''
GATHER_OFF_BY_ONE = '''def lora_delta_gather(x, a, b, token_slots):   # slot s taken as a[s - 1]
    slots = (token_slots - 1).clamp(min=0)
    return torch.bmm(b[slots], torch.bmm(a[slots], x.unsqueeze(2))).squeeze(2)
'''
GATHER_SHRINK_ONLY = '''def lora_delta_gather(x, a, b, token_slots):   # stops after x A^T
    return torch.bmm(a[token_slots], x.unsqueeze(2)).squeeze(2)
'''
_SEG = '''def lora_delta_segments(x, a, b, seg_starts, seg_lens, seg_slots):
    delta = torch.zeros(x.shape[0], b.shape[1])
    for i, (start, length, slot) in enumerate(zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist())):
        rows = slice(start, start + length)
        delta[rows] = (x[rows] @ a[slot].T) @ b[slot].T
    return delta
'''
SEG_INDEX_AS_SLOT = "# segment i on slot i + 1\n" + _SEG.replace("a[slot].T) @ b[slot].T", "a[i + 1].T) @ b[i + 1].T")
SEG_LEN_AS_END = "# seg_lens read as ends\n" + _SEG.replace("slice(start, start + length)", "slice(start, length)")
SEG_SKIPS_LAST = "# the last segment forgotten\n" + _SEG.replace(
    "zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist())",
    "zip(seg_starts.tolist()[:-1], seg_lens.tolist(), seg_slots.tolist())")
_MEM = '''def memory_for(rows, model_bytes, num_adapters=100):
    largest = max(rows, key=lambda row: row["num_adapters"])
    per_adapter = largest["adapter_bytes"] / largest["num_adapters"]
    lora_bytes = model_bytes + num_adapters * per_adapter
    merged_bytes = num_adapters * model_bytes
    return {"bytes_per_adapter": per_adapter, "lora_bytes": lora_bytes, "merged_bytes": merged_bytes,
            "ratio": merged_bytes / lora_bytes}
'''
_ROUTE = '''def route_topk(router_logits, top_k):
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids
'''
_DISPATCH = '''def moe_dispatch(x, weights, ids, w13, w2):
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        rows, cols = (ids == e).nonzero(as_tuple=True)
        if len(rows) == 0:
            continue
        gate, up = (x[rows] @ w13[e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].T * weights[rows, cols, None]
        out.index_add_(0, rows, y.to(x.dtype))
    return out
'''

MISTAKES = {
    "test_lora_delta_gather": [
        (GATHER_FIRST, "every token used the first token's adapter"),
        (GATHER_OFF_BY_ONE, "off by one"),
        (GATHER_SHRINK_ONLY, "lora_delta_gather(x [5, 6], a [4, 3, 6], b [4, 5, 3], token_slots) returned shape"),
    ],
    "test_lora_delta_segments": [
        (SEG_INDEX_AS_SLOT, "seg_slots[i], not slot i + 1"),
        (SEG_LEN_AS_END, "three segments covering every token"),
        (SEG_SKIPS_LAST, "three segments covering every token"),
    ],
    "test_lora_in_engine": [
        (GATHER_FIRST, "x W^T + your delta differs from x (W + B A)^T"),
        (SEG_INDEX_AS_SLOT, "your segments delta in the engine"),
    ],
    "test_measure_memory": [
        ("# no base model\n" + _MEM.replace("lora_bytes = model_bytes + num_adapters", "lora_bytes = num_adapters"),
         "ONE copy of the base model"),
        ("# the first row\n" + _MEM.replace("largest = max(rows, key=lambda row: row[\"num_adapters\"])",
                                            "largest = rows[0]"), "the row with the most adapters"),
        ("# the last row\n" + _MEM.replace("largest = max(rows, key=lambda row: row[\"num_adapters\"])",
                                           "largest = rows[-1]"), "the row with the most adapters"),
        ("# a base model per adapter\n" + _MEM.replace("lora_bytes = model_bytes + num_adapters * per_adapter",
                                                       "lora_bytes = num_adapters * (model_bytes + per_adapter)"),
         "ONE copy of the base model"),
    ],
    "test_route_topk": [
        ("# not renormalised\n" + _ROUTE.replace("weights / weights.sum(dim=-1, keepdim=True), ids", "weights, ids"),
         "renormalise"),
        ("# softmax in the logits' dtype\n" + _ROUTE.replace("dim=-1, dtype=torch.float32)", "dim=-1).float()"),
         "bf16 logits: the softmax in fp32"),
        ("# softmax over the tokens\n" + _ROUTE.replace("torch.softmax(router_logits, dim=-1,",
                                                        "torch.softmax(router_logits, dim=0,"), "softmax over the experts (dim=-1"),
    ],
    "test_moe_dispatch": [
        ("# the routing weight forgotten\n" + _DISPATCH.replace(" * weights[rows, cols, None]", ""),
         "routing weight"),
        ("# up rows taken first\n" + _DISPATCH.replace("gate, up =", "up, gate ="), "gate rows first"),
        ("# only each token's first expert\n" + _DISPATCH.replace("(ids == e)", "(ids[:, :1] == e)"),
         "all k columns of ids"),
        ("# an assignment: the last expert wins\n" + _DISPATCH.replace("out.index_add_(0, rows, y.to(x.dtype))",
                                                                         "out[rows] = y.to(x.dtype)"), "add up"),
    ],
    "test_answer_active_params_b": [
        ("answer_active_params_b = 46.7 * 2 / 8   # a quarter of everything\n", "only the experts are sparse"),
        ("answer_active_params_b = 2 * 7.0   # two 7B experts\n", "'8x7B' is a name"),
        ("answer_active_params_b = 46.7\n", "that is the total"),
        ("answer_active_params_b = None\n", "set it to a number"),
    ],
}


@pytest.fixture(scope="module")
def graded_namespace(tiny_lora, experiments) -> dict:
    """What the graded test cells read: the master's solution cells, a tiny LoRA engine with its requests and prompts,
    the notebook's experiments, and the state the run cells leave (the mixed batch, throughput rows, the MoE run)."""
    llm, requests, prompts = tiny_lora
    ns = run_solution_cells(MASTER, {"lab10": lab10, "torch": torch, "F": F})
    ns.update(llm=llm, requests=requests, mixed_prompts=prompts, lora_runs=experiments["lora_runs"],
              moe_run=experiments["moe_run"],
              lora_rows=[{"num_adapters": 1, "adapter_bytes": 2_000_000}, {"num_adapters": 3, "adapter_bytes": 9_000_000}])
    ns["mixed"] = ns["lora_runs"](llm, prompts, [None, *requests], ns["lora_delta_gather"], ns["lora_delta_segments"], 4)
    ns["moe"] = ns["moe_run"](ns["route_topk"], ns["moe_dispatch"], num_prompts=2, max_tokens=4)
    return ns


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, m, case) for gid, cases in MISTAKES.items() for m, case in cases],
                         ids=[f"{gid}-{i}" for gid, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)
