"""minillm.distill: the loss against its reference, layer selection, the student's weights and files, the tasks and
their scores, and a small distillation that must beat its baselines (the real teacher's comparison is marked slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minillm.distill.evaluate import score_answers
from minillm.distill.loss import distillation_loss, distillation_loss_parts, reference_distillation_loss
from minillm.distill.student import TOKENIZER_FILES, build_student, save_student, select_layers
from minillm.distill.tasks import INTENTS, make_examples, prompt_text


# ------------------------------------------------------------------------------------------ the loss
def _fresh(seed: int, shape=(3, 5, 37)):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(shape, generator=generator) * 3
    teacher = torch.randn(shape, generator=generator) * 3
    labels = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    labels[0, :2] = -100                       # ignored positions count for nothing
    return student, teacher, labels


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_loss_matches_the_reference_on_fresh_logits(temperature, alpha):
    student, teacher, labels = _fresh(int(temperature * 10 + alpha * 100))
    got = float(distillation_loss(student, teacher, labels, temperature, alpha))
    want = reference_distillation_loss(student, teacher, labels, temperature, alpha)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_kl_part_carries_the_temperature_squared_scale():
    student, teacher, labels = _fresh(7)
    keep = labels != -100
    for temperature in (1.0, 2.0, 3.0):
        plain_kl = torch.distributions.kl_divergence(
            torch.distributions.Categorical(logits=teacher[keep] / temperature),
            torch.distributions.Categorical(logits=student[keep] / temperature)).mean()
        kl_only = distillation_loss(student, teacher, labels, temperature, alpha=1.0)
        assert float(kl_only) == pytest.approx(temperature ** 2 * float(plain_kl), rel=1e-5)


def test_each_part_switches_off():
    student, teacher, labels = _fresh(11)
    # alpha=0: exactly cross-entropy on the labels, whatever the teacher says
    ce_only = distillation_loss(student, teacher, labels, 2.0, alpha=0.0)
    assert float(ce_only) == pytest.approx(float(F.cross_entropy(student.reshape(-1, 37), labels.reshape(-1))), rel=1e-6)
    assert float(distillation_loss(student, teacher * 5 + 1, labels, 2.0, 0.0)) == pytest.approx(float(ce_only), rel=1e-6)
    # alpha=1: the labels play no part; a student equal to its teacher has zero loss
    other_labels = (labels + 1) % 37
    other_labels[labels == -100] = -100
    assert float(distillation_loss(student, teacher, labels, 2.0, 1.0)) == pytest.approx(
        float(distillation_loss(student, teacher, other_labels, 2.0, 1.0)), rel=1e-6)
    assert float(distillation_loss(teacher, teacher, labels, 2.0, 1.0)) == pytest.approx(0.0, abs=1e-6)
    parts = distillation_loss_parts(student, teacher, labels, 2.0, 0.25)
    assert float(parts.total) == pytest.approx(0.25 * float(parts.kl) + 0.75 * float(parts.ce), rel=1e-6)


def test_loss_gradient_reaches_the_student_only():
    student, teacher, labels = _fresh(3)
    student.requires_grad_(True)
    teacher.requires_grad_(True)
    distillation_loss(student, teacher, labels, 2.0, 0.5).backward()
    assert student.grad is not None and float(student.grad.abs().sum()) > 0
    assert teacher.grad is None
    assert float(student.grad[0, :2].abs().sum()) == 0.0      # the ignored positions


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
    ({"alpha": 1.5}, "alpha=1.5 must be in [0, 1]"),
    ({"alpha": -0.1}, "alpha=-0.1 must be in [0, 1]"),
])
def test_loss_refuses_bad_settings(kwargs, words):
    student, teacher, labels = _fresh(1)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        distillation_loss(student, teacher, labels, **kwargs)


def test_loss_refuses_bad_shapes():
    student, teacher, labels = _fresh(1)
    with pytest.raises(ValueError, match=r"\(3, 5, 36\)"):
        distillation_loss(student, teacher[..., :36], labels)
    with pytest.raises(ValueError, match="labels"):
        distillation_loss(student, teacher, labels[:, :4])
    with pytest.raises(ValueError, match="ignore_index=-100"):
        distillation_loss(student, teacher, torch.full_like(labels, -100))


# ------------------------------------------------------------------------------------------ layers
def test_select_layers():
    assert select_layers(30, 6) == [0, 6, 12, 17, 23, 29]
    assert select_layers(30, 30) == list(range(30))
    assert select_layers(30, 2) == [0, 29]
    assert select_layers(30, 1) == [29]
    assert select_layers(10, 3, "first") == [0, 1, 2]
    assert select_layers(10, 3, "last") == [7, 8, 9]
    for n, k in ((30, 4), (30, 7), (12, 5)):
        chosen = select_layers(n, k)
        assert len(set(chosen)) == k and chosen == sorted(chosen) and chosen[0] == 0 and chosen[-1] == n - 1
    with pytest.raises(ValueError, match=r"num_keep=31 is outside 1\.\.30"):
        select_layers(30, 31)
    with pytest.raises(ValueError, match=r"num_keep=0 is outside 1\.\.30"):
        select_layers(30, 0)
    with pytest.raises(ValueError, match="'middle' is not one of"):
        select_layers(30, 4, "middle")


# ------------------------------------------------------------------------------------------ a tiny teacher
@pytest.fixture(scope="module")
def tiny_teacher_dir(tmp_path_factory, default_model_dir) -> Path:
    """A 4-layer Llama with the default model's tokenizer and random, seeded weights (peaky enough to have opinions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, initializer_range=0.3)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-teacher")
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(default_model_dir) / name).is_file():
            shutil.copyfile(Path(default_model_dir) / name, path / name)
    return path


def test_student_keeps_the_chosen_layers_weights(tiny_teacher_dir):
    from minillm.distill.student import load_teacher

    teacher = load_teacher(tiny_teacher_dir)
    student = build_student(teacher, [0, 3])
    assert student.config.num_hidden_layers == 2
    assert torch.equal(student.model.layers[1].self_attn.q_proj.weight, teacher.model.layers[3].self_attn.q_proj.weight)
    assert torch.equal(student.model.layers[0].mlp.down_proj.weight, teacher.model.layers[0].mlp.down_proj.weight)
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight)
    # every layer kept: the student is the teacher
    ids = torch.tensor([[5, 17, 300, 9000, 42]])
    whole = build_student(teacher, [0, 1, 2, 3])
    with torch.no_grad():
        torch.testing.assert_close(whole(ids).logits, teacher(ids).logits, rtol=0, atol=0)
    # narrower MLPs keep the largest channels, the same ones in gate, up and down
    narrow = build_student(teacher, [1, 2], intermediate_size=48)
    mlp, source = narrow.model.layers[0].mlp, teacher.model.layers[1].mlp
    assert tuple(mlp.gate_proj.weight.shape) == (48, 64) and tuple(mlp.down_proj.weight.shape) == (64, 48)
    rows = [int((source.gate_proj.weight == row).all(dim=1).nonzero()) for row in mlp.gate_proj.weight]
    assert rows == sorted(rows)
    assert torch.equal(mlp.up_proj.weight, source.up_proj.weight[rows])
    assert torch.equal(mlp.down_proj.weight, source.down_proj.weight[:, rows])
    with pytest.raises(ValueError, match=r"index outside 0\.\.3"):
        build_student(teacher, [0, 4])
    with pytest.raises(ValueError, match=r"intermediate_size=500 is outside 1\.\.128"):
        build_student(teacher, [0], intermediate_size=500)
    with pytest.raises(ValueError, match="ascending"):
        build_student(teacher, [2, 1])


def test_saved_student_loads_in_minillm_and_transformers_with_the_same_greedy_tokens(tiny_teacher_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minillm import LLM, SamplingParams
    from minillm.distill.student import load_teacher

    student = build_student(load_teacher(tiny_teacher_dir), [0, 2])
    path = save_student(student, tiny_teacher_dir, tmp_path / "student", {"keep_layers": [0, 2]})
    assert json.loads((path / "minillm-distill.json").read_text())["keep_layers"] == [0, 2]
    prompt = prompt_text("intent", make_examples("intent", "heldout", 1)[0].message)
    ours = LLM(str(path)).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tokenizer = AutoTokenizer.from_pretrained(path)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert reloaded.config.num_hidden_layers == 2
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = reloaded.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:]
    assert list(ours[0].outputs[0].token_ids) == theirs.tolist()


def test_prefix_cached_teacher_logits_equal_a_whole_forward(tiny_teacher_dir):
    from transformers import AutoTokenizer

    from minillm.distill.student import load_teacher
    from minillm.distill.teacher import teacher_items

    teacher = load_teacher(tiny_teacher_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_teacher_dir)
    examples = make_examples("extract", "train", 2)
    answers = [tokenizer.encode(" " + e.answer + "\n") for e in examples]
    items = teacher_items(teacher, tokenizer, "extract", examples, answers, progress=False)
    for item, example, answer in zip(items, examples, answers):
        full = tokenizer.encode(prompt_text("extract", example.message)) + answer
        with torch.no_grad():
            logits = teacher(torch.tensor([full])).logits[0, len(full) - len(answer) - 1: len(full) - 1]
        assert item.teacher_logits.shape == (len(answer), 49152)
        torch.testing.assert_close(item.teacher_logits.float(), logits.half().float(), atol=2e-2, rtol=1e-3)
        assert item.input_ids[item.answer_start:] == answer
        assert len(item.input_ids) < len(full) - 60           # the student's prompt drops the solved examples


# ------------------------------------------------------------------------------------------ tasks and scores
def test_heldout_split_never_shares_a_message_with_training():
    for task in ("extract", "intent"):
        train = make_examples(task, "train", 400)
        heldout = make_examples(task, "heldout", 200)
        assert not {e.message for e in train} & {e.message for e in heldout}
        assert len({e.message for e in heldout}) == 200
        assert make_examples(task, "heldout", 200) == heldout          # seeded: the same every time
        assert {e.intent for e in train} == set(INTENTS)
        for e in heldout[:20]:
            assert json.loads(e.answer) and e.fields["order_id"] in e.message and e.fields["name"] in e.message
    with pytest.raises(ValueError, match="'summarize' is not one of"):
        make_examples("summarize", "train", 3)
    with pytest.raises(ValueError, match=r"num_examples=0 is outside 1\.\.5000"):
        make_examples("intent", "train", 0)
    with pytest.raises(ValueError, match="'test' is not one of"):
        make_examples("intent", "test", 3)


def test_scores_count_fields_intents_and_valid_json():
    examples = make_examples("extract", "heldout", 3)
    right = examples[0].answer
    half = json.dumps({**examples[1].fields, "product": "nothing", "order_id": "X"})
    scores = score_answers("extract", examples, [right, half, "{not json"])
    assert scores == {"score": pytest.approx(4 / 9), "valid_json": pytest.approx(2 / 3), "exact": pytest.approx(1 / 3)}
    intents = make_examples("intent", "heldout", 4)
    wrong = next(i for i in INTENTS if i != intents[1].intent)
    scores = score_answers("intent", intents, [intents[0].answer, json.dumps({"intent": wrong}), "[1]", "refund"])
    assert scores == {"score": 0.25, "valid_json": 0.5, "exact": 0.25}


# ------------------------------------------------------------------------------------------ distillation works
@pytest.fixture(scope="module")
def two_layer_teacher_dir(tmp_path_factory, default_model_dir) -> Path:
    """The default model cut to its first and last layers: real embeddings, real habits, cheap enough for a quick test."""
    from minillm.distill.student import load_teacher

    teacher = load_teacher(default_model_dir)
    return save_student(build_student(teacher, [0, 29]), default_model_dir, tmp_path_factory.mktemp("teacher2"))


def test_distilled_student_beats_its_baselines_quickly(two_layer_teacher_dir, tmp_path):
    """A quick version of the comparison (the default model's is test_distilled_student_beats_its_baselines, slow):
    a 2-layer teacher whose answers are its own odd text, so the measure is top-1 agreement with the teacher on the
    held-out messages. The distilled 1-layer student must agree more than the same student untrained and the one
    trained on the task's true labels, by 10 points. Measured on a 2-core CPU: 71.9% for the distilled student, 0.0%
    for the untrained and the labels-only ones (the teacher's answers are not the task's)."""
    from minillm.distill.pipeline import DistillRecipe, distill

    recipe = DistillRecipe(task="intent", teacher=str(two_layer_teacher_dir), num_layers=1, num_train=16,
                           num_heldout=8, steps=8, batch_size=8, lr=1e-3, temperature=2.0, alpha=0.5, seed=0,
                           max_answer_tokens=8)
    result = distill(recipe, tmp_path / "student", compare=True, progress=False, generate=False)
    rows = result.rows
    assert rows["student distilled"]["score"] is None    # generate=False: agreement only
    distilled, pruned, labelled = (rows[f"student {n}"]["agreement"] for n in ("distilled", "pruned", "labels only"))
    message = f"\n{result.report}"
    assert distilled >= pruned + 0.10, message
    assert distilled >= labelled + 0.10, message
    assert result.histories["distilled"][-1]["loss"] < result.histories["distilled"][0]["loss"], message
    assert (result.path / "model.safetensors").is_file()


def test_a_loss_and_a_layer_choice_of_your_own_plug_into_the_same_loop(tiny_teacher_dir, tmp_path):
    """distill(loss_fn=, layer_picker=) is lab 12's seam: the built-in loss passed as loss_fn trains the same student
    step for step; the picker decides the layers; a loss without a gradient and a bad picker are refused."""
    from minillm.distill.loss import distillation_loss
    from minillm.distill.pipeline import DistillRecipe, distill, prepare

    recipe = DistillRecipe(task="intent", teacher=str(tiny_teacher_dir), num_layers=2, num_train=4, num_heldout=2,
                           steps=3, batch_size=2, max_answer_tokens=4)
    data = prepare(recipe, progress=False)
    built_in = distill(recipe, tmp_path / "a", progress=False, generate=False, data=data)
    calls = []

    def mine(s, t, labels, temperature, alpha):
        calls.append((tuple(s.shape), temperature, alpha))
        return distillation_loss(s, t, labels, temperature, alpha)

    plugged = distill(recipe, tmp_path / "b", progress=False, generate=False, data=data, loss_fn=mine,
                      layer_picker=lambda n, k: [n - 2, n - 1])
    assert plugged.keep_layers == [2, 3] and built_in.keep_layers == [0, 3]
    assert len(calls) == 3 and all(c[1:] == (2.0, 0.5) for c in calls)
    assert all(h["kl"] is None for h in plugged.histories["distilled"])
    same = distill(recipe, tmp_path / "c", progress=False, generate=False, data=data, loss_fn=distillation_loss)
    assert [h["loss"] for h in same.histories["distilled"]] == pytest.approx(
        [h["loss"] for h in built_in.histories["distilled"]], rel=1e-5)
    with pytest.raises(ValueError, match="carries no gradient"):
        distill(recipe, tmp_path / "d", progress=False, generate=False, data=data,
                loss_fn=lambda s, t, labels, temperature, alpha: torch.tensor(1.0))
    with pytest.raises(ValueError, match="expected a scalar tensor"):
        distill(recipe, tmp_path / "e", progress=False, generate=False, data=data,
                loss_fn=lambda s, t, labels, temperature, alpha: F.cross_entropy(s, labels, reduction="none"))
    with pytest.raises(ValueError, match=r"layer_picker\(4, 2\) returned \[3, 1\]; expected 2 distinct"):
        distill(recipe, tmp_path / "f", progress=False, generate=False, data=data, layer_picker=lambda n, k: [3, 1])


# ------------------------------------------------------------------------------------------ the command
@pytest.mark.parametrize("argv, words", [
    (["--layers", "0"], "--layers 0 is outside 1..1000"),
    (["--alpha", "1.5"], "--alpha 1.5 is outside 0.0..1.0"),
    (["--steps", "many"], "--steps 'many' is not a number (1..100000)"),
    (["--task", "summarize"], "invalid choice: 'summarize' (choose from 'extract', 'intent')"),
])
def test_command_refuses_bad_values(argv, words, capsys):
    from minillm.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["distill", *argv])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_command_exports_a_gguf_and_refuses_a_folder_without_a_model(tiny_teacher_dir, tmp_path, capsys):
    from minillm.cli import main

    assert main(["distill", "export", str(tiny_teacher_dir), "--type", "f16", "--out", str(tmp_path / "out"),
                 "--name", "tiny"]) == 0
    assert (tmp_path / "out" / "tiny.F16.gguf").is_file() and (tmp_path / "out" / "Modelfile").is_file()
    assert "tiny.F16.gguf" in capsys.readouterr().out
    assert main(["distill", "export", str(tmp_path), "--type", "q8_0"]) == 2
    assert f"{str(tmp_path)!r} is not a Hugging Face directory (no config.json)" in capsys.readouterr().err


@pytest.mark.slow
def test_distilled_student_beats_its_baselines(tmp_path):
    """The comparison on the default model (minutes on 2 cores): a 6-layer student on the extraction task, scored on
    32 held-out messages. Measured on a 2-core CPU (13 min, seed 0): teacher 93.8% fields right, 100% valid JSON;
    distilled 16.7% / 78.1% / top-1 agreement 84.0%; labels only 4.2% / 93.8% / 69.9%; pruned untrained 0 / 0 / 0.
    The student is far from the bar at this budget (64 messages, 48 steps); the margins over its baselines are what
    this test holds."""
    from minillm import LLM
    from minillm.distill.evaluate import generate_answers, score_answers
    from minillm.distill.pipeline import DistillRecipe, distill
    from minillm.distill.tasks import make_examples

    recipe = DistillRecipe(task="extract", num_layers=6, num_train=64, num_heldout=32, steps=48, batch_size=8, lr=1e-3,
                           seed=0)
    result = distill(recipe, tmp_path / "student", compare=True, progress=False)
    rows, message = result.rows, f"\n{result.report}"
    distilled, pruned, labelled = (rows[f"student {n}"] for n in ("distilled", "pruned", "labels only"))
    assert distilled["score"] >= labelled["score"] + 0.08, message
    assert distilled["agreement"] >= labelled["agreement"] + 0.08, message
    assert distilled["score"] >= pruned["score"] + 0.10 and distilled["agreement"] >= pruned["agreement"] + 0.5, message
    assert rows["teacher"]["score"] >= 0.85, message
    # the saved student answers the same through minillm's engine after a reload
    heldout = make_examples("extract", "heldout", 32)
    again = score_answers("extract", heldout, generate_answers(LLM(str(result.path)), "extract", heldout))
    assert again["score"] == pytest.approx(distilled["score"]), message
