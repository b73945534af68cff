"""The calibration text and the on-disk calibration cache, and the two calibrations kept there
(weight_calibration="autoround" and "gptq-tuned": a first stage, then tune_int4_grids).

A cache entry is keyed by the model's float weights, the calibration tokens and a recipe (the
settings the computation reads), so another model, text or setting is another entry, never a stale
read. The recipes' values are passed to the calibrations from the key itself.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from ...quant.int4 import pack_int4, unpack_int4
from ..llama import LlamaForCausalLM
from .autoround import AUTOROUND_BATCH_TOKENS, AUTOROUND_STEPS, calibrate_autoround
from .common import HEAD_INT4_GROUP_SIZE
from .gptq import GPTQ_OPTIONS, GPTQ_TOKENS, calibrate_gptq
from .rotate import down_rotated, int4_rotated
from .tune import E2E_BATCH_TOKENS, E2E_LR, E2E_STEPS, tune_int4_grids

CALIBRATION_TEXT = Path(__file__).resolve().parents[2] / "data" / "calibration.txt"


def calibration_token_ids(tokenizer, num_tokens: int = 512, vocab_size: int | None = None) -> list[int]:
    """The first `num_tokens` tokens of minillm/data/calibration.txt: original prose kept apart
    from data/corpus.txt, which the quality harness scores, so calibration never sees the
    evaluation text. (Fixed pseudo-random ids for random-weight presets, which have no tokenizer.)"""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size or 2, (num_tokens,), generator=g).tolist()
    return tokenizer.encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)[:num_tokens]


GENERATED_CALIBRATION_TEXT = CALIBRATION_TEXT.with_name("calibration_generated.txt")


def autoround_token_ids(tokenizer, vocab_size: int | None = None) -> list[int]:
    """weight_calibration="autoround"'s calibration tokens: data/calibration.txt, then
    data/calibration_generated.txt (128 essays the default model wrote at temperature 1,
    scripts/make_calibration_text.py): learned rounding overfits calibration.txt alone
    (docs/notes/performance-history.md). (2,048 fixed pseudo-random ids for random-weight presets.)"""
    if tokenizer is None:
        return calibration_token_ids(None, 2048, vocab_size)
    text = CALIBRATION_TEXT.read_text() + "\n\n" + GENERATED_CALIBRATION_TEXT.read_text()
    return tokenizer.encode(text, add_special_tokens=False)


CALIBRATION_CACHE_VERSION = 2  # bumped whenever a calibration's algorithm changes: the key does not cover the code


def calibration_cache_dir() -> Path:
    from ..default import cache_root

    return cache_root() / "calibration"


def calibration_cache_path(name: str, model: LlamaForCausalLM, token_ids: list[int], recipe: dict) -> Path:
    """Where cached_calibration keeps (or will keep) this calibration: the file name is keyed by the
    model's float weights, the calibration tokens and the recipe."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((CALIBRATION_CACHE_VERSION, name, sorted(recipe.items()))).encode())
    digest.update(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return calibration_cache_dir() / f"{name}-{digest.hexdigest()}.pt"


def cached_calibration(name: str, model: LlamaForCausalLM, token_ids: list[int], recipe: dict, compute):
    """compute() -> (input_scales, int4 parts), kept on disk at calibration_cache_path(): a
    calibration that takes tens of minutes on a CPU runs once per model and setting. Parts are
    stored packed, two weights per byte."""
    path = calibration_cache_path(name, model, token_ids, recipe)
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        return saved["scales"], {k: (unpack_int4(q), scale, zero) for k, (q, scale, zero) in saved["parts"].items()}
    scales, parts = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"scales": {k: v.cpu() for k, v in scales.items()},
                "parts": {k: (pack_int4(q), scale.cpu(), zero.cpu()) for k, (q, scale, zero) in parts.items()}}, tmp)
    os.replace(tmp, path)
    return scales, parts


def autoround_recipe(group_size: int) -> dict:
    """calibrate_autoround's cache recipe (the first stage of weight_calibration="autoround"). One entry
    serves both heads: the int4 head's GPTQ (HEAD_INT4_GROUP_SIZE) is always computed, in seconds,
    and dropped under an int8 head."""
    return dict(group_size=group_size, steps=AUTOROUND_STEPS, batch_tokens=AUTOROUND_BATCH_TOKENS,
                head_group_size=HEAD_INT4_GROUP_SIZE,
                relative="above-median",      # the cache key's name for relative=True
                rotation="hadamard-down")     # down_proj's input rotated first (rotate_down_proj)


def tuned_autoround_recipe(group_size: int) -> dict:
    """weight_calibration="autoround"'s cache recipe: AutoRound's, then tune_int4_grids'."""
    return dict(autoround_recipe(group_size), e2e_steps=E2E_STEPS, e2e_lr=E2E_LR, e2e_batch_tokens=E2E_BATCH_TOKENS)


def autoround_cache_path(model: LlamaForCausalLM, tokenizer, group_size: int = 128) -> Path:
    """The cache entry weight_calibration="autoround" at group_size reads (or will write)."""
    ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
    return calibration_cache_path("autoround-tuned", down_rotated(model, group_size), ids,
                                  tuned_autoround_recipe(group_size))


def autoround_is_cached(model: LlamaForCausalLM, tokenizer, group_size: int = 128) -> bool:
    """Whether weight_calibration="autoround" at group_size would read its calibration from the cache
    (False: building it runs calibrate_autoround and tune_int4_grids, which takes the better part of
    an hour on a small CPU, less when AutoRound's own stage is cached)."""
    return autoround_cache_path(model, tokenizer, group_size).is_file()


def autoround_calibration(model: LlamaForCausalLM, tokenizer, group_size: int = 128
                          ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """weight_calibration="autoround"'s (input_scales, parts), from the cache or computed (and cached):
    calibrate_autoround (cached on its own, so a change to the tuning reruns only the tuning), then
    tune_int4_grids on the same calibration tokens. The parts are for the model with down_proj's input
    rotated (rotate_down_proj; quantize_for_config rotates the model it quantizes): an unrotated
    `model` is calibrated through a rotated shallow copy, and left as it was."""
    model = down_rotated(model, group_size)
    ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
    recipe = tuned_autoround_recipe(group_size)   # the calls below read the key's values: they cannot drift apart

    def layer_by_layer():
        return cached_calibration("autoround", model, ids, autoround_recipe(group_size),
                                  lambda: calibrate_autoround(model, ids, recipe["group_size"], steps=recipe["steps"],
                                                              batch_tokens=recipe["batch_tokens"],
                                                              head_group_size=recipe["head_group_size"]))

    def tuned():
        scales, parts = layer_by_layer()
        return tune_int4_grids(model, ids, scales, parts, steps=recipe["e2e_steps"], lr=recipe["e2e_lr"],
                               batch_tokens=recipe["e2e_batch_tokens"])

    return cached_calibration("autoround-tuned", model, ids, recipe, tuned)


def gptq_tuned_recipe(group_size: int) -> dict:
    """weight_calibration="gptq-tuned"'s cache recipe: "gptq"'s calibration, then tune_int4_grids with the
    input scales learned too and the int8 head in the student. One entry serves both heads, as for
    autoround: the int4 head's GPTQ (before the tuning) is kept and dropped under an int8 head."""
    return dict(group_size=group_size, gptq_tokens=GPTQ_TOKENS, **GPTQ_OPTIONS, head_group_size=HEAD_INT4_GROUP_SIZE,
                rotation="hadamard-down+norms", e2e_steps=E2E_STEPS, e2e_lr=E2E_LR, e2e_batch_tokens=E2E_BATCH_TOKENS,
                tune_input_scales=True, student_head="int8")


def gptq_tuned_cache_path(model: LlamaForCausalLM, tokenizer, group_size: int = 128) -> Path:
    """The cache entry weight_calibration="gptq-tuned" at group_size reads (or will write)."""
    ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
    return calibration_cache_path("gptq-tuned", int4_rotated(model, group_size), ids, gptq_tuned_recipe(group_size))


def gptq_tuned_calibration(model: LlamaForCausalLM, tokenizer, group_size: int = 128
                           ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """weight_calibration="gptq-tuned"'s (input_scales, parts), from the cache or computed (and cached:
    tens of minutes on a CPU): calibrate_gptq as weight_calibration="gptq" runs it
    (the first GPTQ_TOKENS calibration tokens), then tune_int4_grids on all of autoround_token_ids,
    the input scales learned too, against the int8 head the engine serves. The parts are for the
    model with down_proj's input and the norm outputs rotated (int4_rotated); an unrotated `model`
    is calibrated through a rotated shallow copy, and left as it was."""
    model = int4_rotated(model, group_size)
    ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
    recipe = gptq_tuned_recipe(group_size)   # the calls below read the key's values: they cannot drift apart

    def compute():
        scales, parts = calibrate_gptq(model, ids[:recipe["gptq_tokens"]], recipe["group_size"],
                                       head_group_size=recipe["head_group_size"], **{k: recipe[k] for k in GPTQ_OPTIONS})
        return tune_int4_grids(model, ids, scales, parts, steps=recipe["e2e_steps"], lr=recipe["e2e_lr"],
                               batch_tokens=recipe["e2e_batch_tokens"], tune_input_scales=recipe["tune_input_scales"],
                               head_dtype=recipe["student_head"])

    return cached_calibration("gptq-tuned", model, ids, recipe, compute)
