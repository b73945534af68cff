"""minillm.distill's sweep, memory budget and on-device rows: the pick rule, the Pareto front, the timing harness,
the memory table's arithmetic, a tiny sweep's rows, the draft comparison's rows and the llama.cpp row."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minillm.distill import memory, ondevice, sweep
from minillm.distill.student import TOKENIZER_FILES, build_student, load_teacher, save_student


def _point(name: str, score: float, cost: float):
    return SimpleNamespace(name=name, score=score, usd_per_mtok=cost)


POINTS = [_point("teacher fp32", 0.90, 1.00), _point("teacher int8", 0.89, 0.60), _point("s6 fp32", 0.80, 0.30),
          _point("s6 int8", 0.86, 0.20), _point("s4 int4", 0.50, 0.05), _point("s4 int8", 0.45, 0.08)]


# ------------------------------------------------------------------------------------------ the pick rule
def test_pick_is_the_cheapest_point_within_the_margin():
    byname = {p.name: p for p in POINTS}
    assert sweep.pick_point(POINTS, 0.90, 0.05) is byname["s6 int8"]        # 0.86 >= 0.85, cheapest such
    assert sweep.pick_point(POINTS, 0.90, 0.02) is byname["teacher int8"]   # 0.86 < 0.88: only the teacher's left
    assert sweep.pick_point(POINTS, 0.90, 0.40) is byname["s4 int4"]        # 0.50 meets 0.50 exactly
    assert sweep.pick_point(POINTS, 0.90, 0.0) is byname["teacher fp32"]
    tie = [_point("worse", 0.86, 0.2), _point("better", 0.88, 0.2)]
    assert sweep.pick_point(tie, 0.90, 0.05).name == "better"                # equal cost: the higher score


def test_pick_says_so_when_no_point_meets_the_bar():
    students = [p for p in POINTS if not p.name.startswith("teacher")]
    assert sweep.pick_point(students, 0.90, 0.01) is None
    line = sweep.pick_line(None, 0.90, 0.01)
    assert "no point scores within 1.0% of the teacher's 90.0%" in line and "bar: 89.0%" in line
    with pytest.raises(ValueError, match=r"margin=1.5 is outside 0\.\.1"):
        sweep.pick_point(POINTS, 0.9, 1.5)


def test_pareto_front_keeps_the_points_nothing_beats():
    front = [p.name for p in sweep.pareto_front(POINTS)]
    # s4 int8 is dearer and worse than s4 int4; s6 fp32 dearer and worse than s6 int8
    assert front == ["s4 int4", "s6 int8", "teacher int8", "teacher fp32"]
    same_cost = [_point("a", 0.5, 1.0), _point("b", 0.7, 1.0), _point("c", 0.7, 2.0)]
    assert [p.name for p in sweep.pareto_front(same_cost)] == ["b"]
    assert [p.name for p in sweep.pareto_front(POINTS, cost=lambda p: -p.score, score=lambda p: -p.usd_per_mtok)] \
        == ["teacher fp32", "teacher int8", "s6 int8", "s4 int4"]


def test_repeat_median_discards_the_warmup_and_keeps_the_median():
    values = iter([100.0, 90.0, 3.0, 1.0, 2.0, 50.0, 2.5])     # two warm-up calls, then five timed ones

    def sample():
        return {"ttft_s": next(values)}

    got = sweep.repeat_median(sample, warmup=2, repeats=5)
    assert got == {"ttft_s": {"median": 2.5, "min": 1.0, "max": 50.0, "n": 5}}
    with pytest.raises(ValueError, match="repeats=0"):
        sweep.repeat_median(sample, 0, 0)


# ------------------------------------------------------------------------------------------ the memory budget
def test_memory_table_arithmetic():
    model = memory.ModelMemory("m", weight_bytes=1_000_000_000, kv_bytes_per_token=2 * 10 * 4 * 16 * 4)
    assert memory.kv_bytes_per_token(10, 4, 16, 4) == 5120 == model.kv_bytes_per_token
    assert memory.kv_bytes_per_token(30, 3, 64, 2) == 23040               # SmolLM2-135M's in fp16
    big = memory.ModelMemory("big", weight_bytes=5 * memory.GIB, kv_bytes_per_token=0)
    small_device = memory.Device("4 GB", 4 * memory.GIB, 20e9, "test")
    large_device = memory.Device("8 GB", 8 * memory.GIB, 50e9, "test")
    rows = memory.memory_table([model, big], [small_device, large_device], context=1000)
    first = rows[0]
    assert first["kv_bytes"] == 5_120_000 and first["resident_bytes"] == 1_005_120_000
    assert first["devices"]["4 GB"] == {"fits": True, "bound_tok_s": pytest.approx(20e9 / 1_005_120_000)}
    assert first["devices"]["8 GB"]["bound_tok_s"] == pytest.approx(50e9 / 1_005_120_000)
    assert rows[1]["devices"]["4 GB"] == {"fits": False, "bound_tok_s": None}
    assert rows[1]["devices"]["8 GB"]["bound_tok_s"] == pytest.approx(50e9 / (5 * memory.GIB))
    text = memory.format_memory_table(rows, [small_device, large_device], 1000)
    assert "1005.1" in text and text.splitlines()[3].split()[-2] == "-"
    with pytest.raises(ValueError, match="context=0"):
        memory.memory_table([model], [small_device], context=0)
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        memory.kv_bytes_per_token(1, 0, 16, 2)


def test_this_machine_reads_its_ram_from_the_system():
    ram = memory.machine_ram_bytes()
    with open("/proc/meminfo") as f:
        want = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert ram == want
    device = memory.this_machine(bandwidth=12e9)
    assert device.ram_bytes == want and device.bandwidth == 12e9 and device.name == "this machine"
    assert [d.ram_bytes for d in memory.REFERENCE_DEVICES] == [4 * memory.GIB, 8 * memory.GIB, 16 * memory.GIB]


# ------------------------------------------------------------------------------------------ a tiny sweep
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, default_model_dir):
    """A 4-layer random Llama with the default model's tokenizer, and its 2-layer student (layers 0 and 3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, initializer_range=0.3)
    teacher_dir = tmp_path_factory.mktemp("tiny-teacher")
    LlamaForCausalLM(config).save_pretrained(teacher_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(default_model_dir) / name).is_file():
            shutil.copyfile(Path(default_model_dir) / name, teacher_dir / name)
    student = build_student(load_teacher(teacher_dir), [0, 3])
    return teacher_dir, save_student(student, teacher_dir, tmp_path_factory.mktemp("tiny-student"))


def test_tiny_sweep_rows(tiny_pair):
    teacher_dir, student_dir = tiny_pair
    points = sweep.run_sweep({"teacher": teacher_dir, "student 2": student_dir}, task="intent", num_heldout=2,
                             dtypes=("fp32", "int8"), context=100, decode_tokens=4, warmup=1, repeats=2,
                             hourly_usd=3.6, progress=False)
    assert [(p.model, p.weight_dtype, p.layers, p.is_teacher) for p in points] == [
        ("teacher", "fp32", 4, True), ("teacher", "int8", 4, True),
        ("student 2", "fp32", 2, False), ("student 2", "int8", 2, False)]
    for p in points:
        assert 0.0 <= p.score <= 1.0 and 0.0 <= p.valid_json <= 1.0
        assert p.decode_tok_s > 0 and p.ttft_s > 0 and p.timing["decode_tok_s"]["n"] == 2
        assert p.usd_per_mtok == pytest.approx(3.6 / 3600 / p.decode_tok_s * 1e6)
        assert p.kv_bytes == 2 * p.layers * 2 * 16 * 4 * 100      # fp32 KV: 2 x layers x kv heads x head dim x 4 B
    by = {p.name: p for p in points}
    assert by["student 2 fp32"].weight_bytes < by["teacher fp32"].weight_bytes
    assert by["teacher int8"].weight_bytes < by["teacher fp32"].weight_bytes
    ref = sweep.reference_point(points)
    assert ref is by["teacher fp32"]
    front = sweep.pareto_front(points)
    pick = sweep.pick_point([p for p in points if p is not ref], ref.score, 1.0)
    assert pick is min((p for p in points if p is not ref), key=lambda p: (p.usd_per_mtok, -p.score))
    text = sweep.format_sweep(points, front, pick, 1.0, 100, "intent")
    assert "<- pick" in text and "intent acc" in text and f"pick: {pick.name}" in text
    figure = sweep.sweep_figure(points, front, pick, 1.0)
    assert {t.name for t in figure.data} >= {"fp32", "int8", "Pareto front", f"pick: {pick.name}"}
    assert [row["name"] for row in sweep.sweep_rows(points)] == [p.name for p in points]
    with pytest.raises(ValueError, match="'int3' is not one of"):
        sweep.run_sweep({"teacher": teacher_dir}, dtypes=("int3",), progress=False)
    with pytest.raises(ValueError, match="have no 'teacher'"):
        sweep.run_sweep({"student": student_dir}, progress=False)


def test_draft_comparison_rows(tiny_pair):
    teacher_dir, student_dir = tiny_pair
    result = ondevice.draft_comparison(teacher_dir, student_dir, task="intent", num_requests=2, k=2, self_layers=1)
    rows = result["rows"]
    assert [r["proposer"] for r in rows] == ["off", "n-gram", "self-draft", "student draft"]
    assert [r["label"] for r in rows] == ["off", "ngram k=2", "self k=2", "student k=2"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[0]["acceptance_rate"] is None
    for row in rows[1:]:
        assert row["identical"] == 2, row       # greedy speculation is lossless
        assert row["speedup"] == pytest.approx(row["decode_tok_per_s"] / rows[0]["decode_tok_per_s"])
    for row in rows[2:]:                        # the model drafts always propose
        assert 0.0 <= row["acceptance_rate"] <= 1.0 and 1.0 <= row["tokens_per_pass"] <= 3.0
    text = ondevice.format_draft_table(result)
    assert "student draft" in text and "self-draft" in text and "2/2" in text
    with pytest.raises(ValueError, match="k=0"):
        ondevice.draft_settings(student_dir, 0)


# ------------------------------------------------------------------------------------------ llama.cpp
def test_llama_cpp_row_without_the_package_says_how_to_install(monkeypatch, tiny_pair):
    monkeypatch.setattr(ondevice, "_importable", lambda module: False)
    row = ondevice.llama_cpp_side_by_side(tiny_pair[1], "q8_0")
    assert row == {"skipped": ondevice.LLAMA_CPP_INSTALL}
    assert "pip install llama-cpp-python" in ondevice.format_llama_cpp(row)
    with pytest.raises(ValueError, match="'q5_k' is not one of"):
        ondevice.llama_cpp_side_by_side(tiny_pair[1], "q5_k")


def test_side_by_side_row_compares_tokens_with_minillm():
    engines = {"minillm fp32": {"decode_tok_s": 50.0, "ttft_ms": 10.0, "weight_bytes": 4e6, "tokens": [1, 2, 3, 4]},
               "llama.cpp F16": {"decode_tok_s": 100.0, "ttft_ms": 5.0, "weight_bytes": 2e6, "tokens": [1, 2, 9, 4]}}
    row = ondevice.side_by_side_row(engines, "s.F16.gguf", 4)
    assert row["engines"]["minillm fp32"]["same_prefix"] == 4 and row["engines"]["llama.cpp F16"]["same_prefix"] == 2
    assert row["engines"]["llama.cpp F16"]["vs_minillm"] == 2.0
    text = ondevice.format_llama_cpp(row)
    assert "2/4" in text and "2.00x" in text
