"""LoRA adapters for the default model, trained here once with peft and cached beside it.

Three small adapters whose behaviour shows in a few tokens, for the multi-LoRA lab:

    french  answers in French                        rank 16   data/adapters/french.jsonl (written by hand)
    json    answers as one JSON object {"answer": ...} rank 8   data/adapters/short_answers.jsonl, wrapped in code
    terse   answers in one short sentence            rank 8    data/adapters/short_answers.jsonl as written

Each is trained on the model's chat template exactly as `LLM.chat` applies it (the default system
prompt included), with the loss on the answer and its end-of-turn token only, so an adapter works
through `llm.chat`. Training is seeded and takes a few minutes on a 2-core CPU; the result is a PEFT
directory (adapter_config.json + adapter_model.safetensors) under
`<cache>/models/SmolLM2-135M-Instruct-lora/<name>-<key>/`, where the key hashes the training text,
the recipe, ADAPTER_VERSION and the base weights: a change of any of them trains a new one.

    default_adapter_paths()            {"french": path, "json": path, "terse": path}, training what is missing
    python -m minillm.adapters         builds them all, prints each loss curve and an answer before / after
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from .models.default import MANIFEST as MODEL_MANIFEST

DATA_DIR = Path(__file__).resolve().parent / "data" / "adapters"
MANIFEST = "minillm-adapter.json"
# Bump when the training code changes in a way the key does not see (it sees the recipe and the data).
ADAPTER_VERSION = 1
# Every linear layer of a Llama block, as vLLM's LoRA and most published adapters do.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class AdapterRecipe:
    """How one adapter is trained: its data, its LoRA shape and the optimiser's settings."""
    name: str
    data_file: str            # under minillm/data/adapters/: JSONL rows {"prompt", "answer"}
    target: str               # how an answer becomes the training target: "as_written" | "json_answer"
    rank: int = 8
    alpha: int = 16
    epochs: int = 2
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 4
    seed: int = 0
    max_steps: int | None = None   # stop early (tests); None: every batch of every epoch


ADAPTERS: dict[str, AdapterRecipe] = {
    "french": AdapterRecipe("french", "french.jsonl", "as_written", rank=16, alpha=32, epochs=3),
    "json": AdapterRecipe("json", "short_answers.jsonl", "json_answer", rank=8, alpha=16, epochs=2),
    "terse": AdapterRecipe("terse", "short_answers.jsonl", "as_written", rank=8, alpha=16, epochs=2),
}


# ------------------------------------------------------------------------------------------ data
def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number} is not JSON ({exc})") from None
    return rows


def make_target(answer: str, target: str) -> str:
    """The assistant's training text for `answer` under the recipe's `target` transform."""
    if target == "as_written":
        return answer
    if target == "json_answer":
        return json.dumps({"answer": answer}, ensure_ascii=False)
    raise ValueError(f"unknown adapter target {target!r}: expected 'as_written' or 'json_answer'")


def training_conversations(recipe: AdapterRecipe) -> list[list[dict]]:
    """The recipe's training chats: [{"role": "user", ...}, {"role": "assistant", ...}] each."""
    return [[{"role": "user", "content": row["prompt"]},
             {"role": "assistant", "content": make_target(row["answer"], recipe.target)}]
            for row in read_jsonl(DATA_DIR / recipe.data_file)]


def heldout_prompts() -> list[str]:
    """Prompts in no training file: what the behaviour checks and the examples ask."""
    return [row["prompt"] for row in read_jsonl(DATA_DIR / "heldout.jsonl")]


def encode_conversation(tokenizer, conversation: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, labels): the prompt as `LLM.chat` encodes it, then the answer and the end-of-turn
    token; labels are -100 on the prompt, so only the answer is learned."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id: the adapter could not learn where an answer ends")
    prompt = tokenizer.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(conversation[-1]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


# ------------------------------------------------------------------------------------------ cache
def adapters_dir(model_path: str | Path) -> Path:
    """Where a model's adapters live: beside its directory, `<model dir>-lora/`."""
    model_path = Path(model_path)
    return model_path.parent / f"{model_path.name}-lora"


def _model_fingerprint(model_path: Path) -> str:
    """The base weights' identity: the conversion manifest's digests when there is one (the default
    model), else the bytes of config.json and the safetensors files."""
    digest = hashlib.blake2b(digest_size=16)
    manifest = model_path / MODEL_MANIFEST
    if manifest.is_file():
        files = json.loads(manifest.read_text())["files"]
        digest.update(repr(sorted((name, info["sha256"]) for name, info in files.items())).encode())
        return digest.hexdigest()
    for file in sorted(model_path.glob("*.safetensors")) + [model_path / "config.json"]:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def adapter_key(recipe: AdapterRecipe, model_path: str | Path) -> str:
    digest = hashlib.blake2b(digest_size=6)
    digest.update(repr((ADAPTER_VERSION, TARGET_MODULES, sorted(dataclasses.asdict(recipe).items()))).encode())
    digest.update(json.dumps(training_conversations(recipe), ensure_ascii=False).encode())
    digest.update(_model_fingerprint(Path(model_path)).encode())
    return digest.hexdigest()


def adapter_path(recipe: AdapterRecipe, model_path: str | Path) -> Path:
    """Where `recipe`'s adapter for the model at `model_path` is (or will be) cached."""
    return adapters_dir(model_path) / f"{recipe.name}-{adapter_key(recipe, model_path)}"


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in ("adapter_config.json", "adapter_model.safetensors", MANIFEST))


def read_manifest(path: str | Path) -> dict:
    """What training recorded: the recipe, per-step losses, the time it took."""
    return json.loads((Path(path) / MANIFEST).read_text())


# ------------------------------------------------------------------------------------------ training
def _lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up, then linear decay to a tenth of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    remaining = max(1, total_steps - warmup_steps)
    return 1.0 - 0.9 * (step - warmup_steps) / remaining


def _batches(num_examples: int, recipe: AdapterRecipe) -> list[list[int]]:
    rng = random.Random(recipe.seed)
    batches = []
    for _ in range(recipe.epochs):
        order = list(range(num_examples))
        rng.shuffle(order)
        batches += [order[i:i + recipe.batch_size] for i in range(0, num_examples, recipe.batch_size)]
    return batches[:recipe.max_steps] if recipe.max_steps is not None else batches


@contextlib.contextmanager
def quiet_peft():
    """peft asks transformers a deprecated question (is_gradient_checkpointing) whenever it wraps a
    model: a FutureWarning that is nothing for the reader to act on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def load_base(model_path: str | Path):
    """(tokenizer, model): transformers' own model in fp32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    return tokenizer, model.eval()


def train_adapter(recipe: AdapterRecipe, model_path: str | Path, out_dir: str | Path, progress: bool = True) -> dict:
    """Train `recipe`'s LoRA on the model at `model_path` and save the PEFT directory to `out_dir`.
    Returns the manifest it writes there (losses per step, seconds)."""
    import peft
    import torch
    from tqdm.auto import tqdm

    if recipe.rank < 1 or recipe.batch_size < 1 or recipe.epochs < 1:
        raise ValueError(f"rank, batch_size and epochs must be >= 1, got {recipe.rank}, {recipe.batch_size}, "
                         f"{recipe.epochs}")
    start = time.perf_counter()
    torch.manual_seed(recipe.seed)
    tokenizer, model = load_base(model_path)
    encoded = [encode_conversation(tokenizer, c) for c in training_conversations(recipe)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = peft.LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=0.0,
                             target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM")
    with quiet_peft():
        model = peft.get_peft_model(model, config)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=recipe.lr, weight_decay=0.0)
    batches = _batches(len(encoded), recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, recipe.warmup_steps, len(batches)))
    losses = []
    bar = tqdm(batches, desc=f"minillm: training the {recipe.name} adapter (one time)", disable=not progress,
               unit="step")
    for batch in bar:
        width = max(len(encoded[i][0]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids, labs = encoded[i]
            input_ids[row, :len(ids)] = torch.tensor(ids)
            labels[row, :len(labs)] = torch.tensor(labs)
            attention_mask[row, :len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    manifest = {
        "name": recipe.name, "adapter_version": ADAPTER_VERSION, "recipe": dataclasses.asdict(recipe),
        "target_modules": list(TARGET_MODULES), "base_model": str(model_path), "num_examples": len(encoded),
        "steps": len(batches), "losses": losses, "train_s": round(time.perf_counter() - start, 1),
        "peft_version": peft.__version__, "torch_threads": torch.get_num_threads(),
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def build_adapter(recipe: AdapterRecipe, model_path: str | Path, progress: bool = True) -> Path:
    """The cached adapter directory for `recipe` on the model at `model_path`, trained first when
    missing. Training writes a temporary directory and renames it, under a lock, so two processes
    never train the same adapter twice nor leave a half-written one."""
    import fcntl

    target = adapter_path(recipe, model_path)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{recipe.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(target):  # another process trained it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{recipe.name}-", dir=target.parent))
        try:
            train_adapter(recipe, model_path, tmp, progress=progress)
            if target.exists():
                shutil.rmtree(target)  # incomplete leftovers of an interrupted run
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_adapter_paths(progress: bool = True, names: list[str] | None = None) -> dict[str, str]:
    """{name: PEFT directory} of the default model's adapters (all of ADAPTERS unless `names`),
    converting the model and training each adapter once, on first use (a few minutes on a CPU)."""
    from .models.default import default_model_path

    names = list(ADAPTERS) if names is None else list(names)
    unknown = [n for n in names if n not in ADAPTERS]
    if unknown:
        raise ValueError(f"unknown adapter(s) {unknown}: expected some of {sorted(ADAPTERS)}")
    model_path = default_model_path(progress=progress)
    return {name: str(build_adapter(ADAPTERS[name], model_path, progress=progress)) for name in names}


# ------------------------------------------------------------------------------------------ answers
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 48) -> list[str]:
    """Greedy chat answers from a transformers (or PEFT) model, one prompt at a time (no padding,
    so each answer is what the engine's greedy decoding gives)."""
    import torch

    answers = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


def loss_summary(losses: list[float], num_points: int = 6) -> str:
    """'2.71 -> 1.05 -> ... -> 0.31': the loss averaged over `num_points` equal stretches of training."""
    if not losses:
        return "no steps"
    size = max(1, len(losses) // num_points)
    means = [sum(losses[i:i + size]) / len(losses[i:i + size]) for i in range(0, len(losses), size)][:num_points]
    return " -> ".join(f"{m:.2f}" for m in means)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.adapters", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(ADAPTERS), help=f"adapters to build (default: {list(ADAPTERS)})")
    parser.add_argument("--prompt", default=None, help="the example question (default: the first held-out prompt)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens of each example answer (default 48)")
    parser.add_argument("--no-examples", action="store_true", help="build and print the loss curves only")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        paths = default_adapter_paths(progress=True, names=args.names)
    except ValueError as exc:
        parser.error(str(exc))
    prompt = args.prompt or heldout_prompts()[0]
    base_model = tokenizer = before = None
    if not args.no_examples:
        from .models.default import default_model_path

        tokenizer, base_model = load_base(default_model_path(progress=False))
        before = greedy_answers(base_model, tokenizer, [prompt], args.max_tokens)[0]
        print(f"\nprompt: {prompt}\nbase model: {before!r}")
    for name, path in paths.items():
        manifest = read_manifest(path)
        recipe = manifest["recipe"]
        print(f"\n{name}: rank {recipe['rank']}, {manifest['num_examples']} examples x {recipe['epochs']} epochs = "
              f"{manifest['steps']} steps in {manifest['train_s']:.0f} s ({manifest['torch_threads']} threads)\n"
              f"  loss {loss_summary(manifest['losses'])}\n  {path}")
        if base_model is not None:
            from peft import PeftModel

            with quiet_peft():
                adapted = PeftModel.from_pretrained(base_model, path)
            print(f"  answer: {greedy_answers(adapted, tokenizer, [prompt], args.max_tokens)[0]!r}")
            base_model = adapted.unload()  # the LoRA layers out again: the next adapter starts from the base
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
