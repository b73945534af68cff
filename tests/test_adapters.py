"""The default model's LoRA adapters (minillm/adapters.py): the shipped data, a few training steps on a
tiny random Llama (a PEFT directory that loads and changes the output; the cache and its key; seeded),
and, marked slow, the real adapters' behaviours on held-out prompts with transformers + peft greedy."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import tokenizer_files
from minillm import adapters
from minillm.adapters import ADAPTERS, DATA_DIR, TARGET_MODULES

ACCENTS = set("éèêëàâîïôûùçœÉÈÀÇ")
FRENCH_WORDS = {"le", "la", "les", "de", "des", "du", "est", "et", "un", "une", "en", "pour", "qui", "que", "dans",
                "sont", "au", "aux", "il", "elle", "vous", "nous", "pas", "sur", "avec", "par", "plus", "ce", "se"}


def french_score(text: str) -> int:
    """Common French words in `text`, plus one when it holds a French accent."""
    words = re.findall(r"[a-zà-ÿœ]+", text.lower())
    return sum(w in FRENCH_WORDS for w in words) + bool(ACCENTS & set(text))


# ------------------------------------------------------------------------------------------ data
def test_the_data_files_parse_with_their_fields_and_sizes():
    french = adapters.read_jsonl(DATA_DIR / "french.jsonl")
    short = adapters.read_jsonl(DATA_DIR / "short_answers.jsonl")
    heldout = adapters.heldout_prompts()
    assert len(french) >= 100 and len(short) >= 100, (len(french), len(short))
    assert len(heldout) == 5
    for name, rows in (("french", french), ("short_answers", short)):
        for row in rows:
            assert set(row) == {"prompt", "answer"}, (name, row)
            assert isinstance(row["prompt"], str) and row["prompt"].strip(), (name, row)
            assert isinstance(row["answer"], str) and row["answer"].strip(), (name, row)
        prompts = [row["prompt"] for row in rows]
        assert len(set(prompts)) == len(prompts), f"{name}: duplicate prompts"
    training_prompts = {row["prompt"].lower() for row in french + short}
    assert not training_prompts & {p.lower() for p in heldout}, "a held-out prompt is in the training data"
    # a few hundred chat pairs in all: french, then short_answers twice (json and terse)
    assert sum(len(adapters.training_conversations(r)) for r in ADAPTERS.values()) >= 300
    # what each adapter is to learn is really in its data
    assert all(french_score(row["answer"]) >= 2 for row in french), [r for r in french if french_score(r["answer"]) < 2]
    assert sum(french_score(row["answer"]) >= 2 for row in short) == 0, "the English short answers read as French"
    assert max(len(row["answer"].split()) for row in short) <= 20, "a terse answer is over 20 words"
    assert all(len(re.findall(r"[.!?](\s|$)", row["answer"])) == 1 for row in short), "an answer is not one sentence"
    assert len({row["prompt"].split()[0] for row in french + short}) >= 10, "the prompts should vary in form"


def test_each_recipe_makes_its_targets():
    json_chats = adapters.training_conversations(ADAPTERS["json"])
    terse_chats = adapters.training_conversations(ADAPTERS["terse"])
    short = adapters.read_jsonl(DATA_DIR / "short_answers.jsonl")
    assert len(json_chats) == len(terse_chats) == len(short)
    for chat_j, chat_t, row in zip(json_chats, terse_chats, short):
        assert [m["role"] for m in chat_j] == ["user", "assistant"]
        assert chat_j[0]["content"] == chat_t[0]["content"] == row["prompt"]
        assert json.loads(chat_j[1]["content"]) == {"answer": row["answer"]}
        assert chat_t[1]["content"] == row["answer"]
    with pytest.raises(ValueError, match="'yaml'.*as_written"):
        adapters.make_target("x", "yaml")


def test_batches_cover_every_example_once_per_epoch_and_are_seeded():
    recipe = dataclasses.replace(ADAPTERS["json"], epochs=3, batch_size=8)
    batches = adapters._batches(21, recipe)
    assert len(batches) == 3 * 3 and [len(b) for b in batches[:3]] == [8, 8, 5]
    for epoch in range(3):
        assert sorted(i for b in batches[3 * epoch:3 * epoch + 3] for i in b) == list(range(21))
    assert batches == adapters._batches(21, recipe)
    assert batches != adapters._batches(21, dataclasses.replace(recipe, seed=1))
    assert len(adapters._batches(21, dataclasses.replace(recipe, max_steps=2))) == 2
    factors = [adapters._lr_factor(s, 4, 20) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[-1] == pytest.approx(1 - 0.9 * 15 / 16)
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))


def test_unknown_adapter_names_are_refused():
    with pytest.raises(ValueError, match=r"\['klingon'\].*french"):
        adapters.default_adapter_paths(progress=False, names=["french", "klingon"])
    with pytest.raises(SystemExit):
        adapters.main(["--max-tokens", "0"])


# ------------------------------------------------------------------------------------------ training (tiny model)
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    """A 2-layer random Llama with the default model's tokenizer and chat template, in a tmp 'cache'."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("cache") / "models" / "tiny-chat"
    model.save_pretrained(path)
    for file in tokenizer_files(default_model_dir):
        shutil.copy(file, path)
    return path


TINY_RECIPE = dataclasses.replace(ADAPTERS["french"], batch_size=4, max_steps=3, lr=1e-2, warmup_steps=1)


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir):
    return adapters.build_adapter(TINY_RECIPE, tiny_model_dir, progress=False)


def test_training_uses_the_chat_template_as_llm_chat_does(tiny_model_dir):
    from minillm import LLM

    llm = LLM(str(tiny_model_dir))
    tokenizer = llm.tokenizer
    conversation = adapters.training_conversations(ADAPTERS["french"])[0]
    input_ids, labels = adapters.encode_conversation(tokenizer, conversation)
    prompt_ids = llm.chat_token_ids(conversation[:1])
    assert input_ids[:len(prompt_ids)] == prompt_ids
    assert labels[:len(prompt_ids)] == [-100] * len(prompt_ids)
    answer = labels[len(prompt_ids):]
    assert answer == input_ids[len(prompt_ids):] and answer[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(answer[:-1]) == conversation[1]["content"]


def test_a_few_steps_make_a_peft_directory_that_changes_the_output(tiny_model_dir, tiny_adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert tiny_adapter.parent == tiny_model_dir.parent / "tiny-chat-lora"
    assert tiny_adapter.name.startswith("french-")
    config = json.loads((tiny_adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == TINY_RECIPE.rank == 16
    assert config["lora_alpha"] == TINY_RECIPE.alpha and set(config["target_modules"]) == set(TARGET_MODULES)
    weights = load_file(tiny_adapter / "adapter_model.safetensors")
    assert len(weights) == 2 * len(TARGET_MODULES) * 2  # A and B, every module, both layers
    assert all(w.shape[0] == 16 for k, w in weights.items() if "lora_A" in k)
    manifest = adapters.read_manifest(tiny_adapter)
    assert manifest["steps"] == len(manifest["losses"]) == 3 and all(math.isfinite(x) for x in manifest["losses"])

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 400, 2000, 31, 7, 9000]])
    with torch.no_grad():
        base_logits = base(ids).logits
        with adapters.quiet_peft():
            model = PeftModel.from_pretrained(base, tiny_adapter).eval()
        lora_logits = model(ids).logits
        with model.disable_adapter():
            off_logits = model(ids).logits
    assert torch.equal(off_logits, base_logits)
    assert (lora_logits - base_logits).abs().max() > 1e-3, "the adapter leaves the output unchanged"


def test_the_cache_is_reused_and_keyed_by_recipe_and_data(tiny_model_dir, tiny_adapter, monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("a cached adapter was trained again")

    monkeypatch.setattr(adapters, "train_adapter", refuse)
    assert adapters.build_adapter(TINY_RECIPE, tiny_model_dir, progress=False) == tiny_adapter
    assert adapters.adapter_path(dataclasses.replace(TINY_RECIPE, lr=2e-2), tiny_model_dir) != tiny_adapter
    assert adapters.adapter_path(dataclasses.replace(TINY_RECIPE, rank=8), tiny_model_dir) != tiny_adapter
    data = tmp_path / "data"
    shutil.copytree(DATA_DIR, data)
    rows = (data / "french.jsonl").read_text(encoding="utf-8").splitlines()
    rows[0] = rows[0].replace("Berlin", "Berlin, bien sûr")
    (data / "french.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    monkeypatch.setattr(adapters, "DATA_DIR", data)
    assert adapters.adapter_path(TINY_RECIPE, tiny_model_dir) != tiny_adapter


def test_training_is_seeded(tiny_model_dir, tiny_adapter, tmp_path):
    recipe = dataclasses.replace(TINY_RECIPE, max_steps=2)
    first = adapters.train_adapter(recipe, tiny_model_dir, tmp_path / "a", progress=False)
    second = adapters.train_adapter(recipe, tiny_model_dir, tmp_path / "b", progress=False)
    assert first["losses"] == second["losses"]
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cached = load_file(tiny_adapter / "adapter_model.safetensors")  # three steps, not two: other weights
    assert any(not torch.equal(a[k], cached[k]) for k in a)


# ------------------------------------------------------------------------------------------ the real adapters
@pytest.mark.slow
def test_the_real_adapters_show_their_behaviour_on_heldout_prompts(default_model_dir):
    """Trains the three adapters (a few minutes on 2 cores) or loads them from the cache, then asks each
    the five held-out prompts, greedy, through transformers + peft."""
    from peft import PeftModel

    paths = adapters.default_adapter_paths(progress=False)
    assert set(paths) == set(ADAPTERS)
    prompts = adapters.heldout_prompts()
    tokenizer, base = adapters.load_base(default_model_dir)
    max_new_tokens = 64
    base_answers = adapters.greedy_answers(base, tokenizer, prompts, max_new_tokens)
    answers = {}
    for name, path in paths.items():
        with adapters.quiet_peft():
            model = PeftModel.from_pretrained(base, path).eval()
        answers[name] = adapters.greedy_answers(model, tokenizer, prompts, max_new_tokens)
        base = model.unload()
    report = json.dumps({"base": base_answers, **answers}, indent=1, ensure_ascii=False)
    print(report)

    # french: most answers read as French; the base model's do not (the detector can fail)
    assert sum(french_score(a) >= 2 for a in answers["french"]) >= 4, report
    assert sum(french_score(a) >= 2 for a in base_answers) <= 1, report
    # json: every answer is one JSON object with a non-empty "answer"; the base model's are not JSON
    for answer in answers["json"]:
        value = json.loads(answer)
        assert isinstance(value, dict) and isinstance(value.get("answer"), str) and value["answer"].strip(), answer
    assert not any(a.lstrip().startswith("{") for a in base_answers), report
    # terse: one short sentence each, and under half the base model's length on average
    lengths = {key: [len(tokenizer.encode(a, add_special_tokens=False)) for a in texts]
               for key, texts in (("base", base_answers), ("terse", answers["terse"]))}
    assert max(lengths["terse"]) <= 32, (lengths, report)
    assert sum(lengths["terse"]) <= 0.5 * sum(lengths["base"]), (lengths, report)
