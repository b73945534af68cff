"""Lab 10 (many models, one engine): the checks of the LoRA delta (gather and segmented forms), the learner's delta
in the engine, the learner's SGMV shrink / expand Triton kernels (against the torch spec, and in the engine), the
learner's throughput harness (with a fake clock), the memory of 100 adapters, Mixtral's routing and expert dispatch
(an expert no token chose must cost nothing: matrix products counted), active parameters; the printouts and figures
of the adapter, kernel, throughput and bytes-per-step experiments.

Every check calls the learner's function through `call_learner` on the stated cases and on fresh random inputs of
odd shapes, compares with the engine's own reference (kernels/lora.py, kernels/fused_moe.py, models/moe.py route),
and names the usual mistake when it recognises one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..kernels.fused_moe import experts_reference
from ..kernels.lora import lora_delta_reference, token_slots_from_segments
from ..models.moe import decode_step_bytes, expected_experts_touched, route
from ..models.presets import PRESETS
from .common import CheckFailed, call_learner, echo_prediction, new_figure, passed  # noqa: F401 - echo for the notebook
from .common import random_tokens  # noqa: F401 - the notebook's inputs, as lab10.random_tokens
from .common import FakeClock, require_kernel  # noqa: F401 - the notebook's launchers and tests, as lab10.*

GIB = 2 ** 30
MIB = 2 ** 20
ATOL = 1e-5

# The prompts of section 4's mixed batch: one per adapter, and the base model's.
ADAPTER_PROMPTS = ["What is the capital of Japan?", "Why is the sky blue?", "Name a fruit that is red.",
                   "How many legs does a spider have?"]


MOE_PRESET = "lab10-mixtral-8e"   # tiny-mixtral with Mixtral's 8 experts, top-2: section 10's measurements


def register_moe_preset() -> str:
    """`random:lab10-mixtral-8e`: the tiny random Mixtral with 8 experts (top-2), as Mixtral 8x7B routes."""
    import dataclasses

    from ..models.presets import register_preset

    register_preset(MOE_PRESET, dataclasses.replace(PRESETS["tiny-mixtral"], num_experts=8))
    return f"random:{MOE_PRESET}"


# =================================================================== adapters
def adapter_paths(llm, train: bool, workdir: str) -> dict[str, str]:
    """{name: PEFT directory}: the default model's trained adapters (french, json, terse); train=True trains the
    missing ones (minillm.adapters, a few minutes on a CPU the first time), train=False takes those already built
    and fills the rest with random adapters of rank 8 written in code (quick mode: no training)."""
    import os

    from .. import adapters
    from ..bench.lora import random_adapter
    from ..layers.lora import layer_shapes

    if train:
        return adapters.default_adapter_paths()
    paths = {}
    for i, (name, recipe) in enumerate(adapters.ADAPTERS.items()):
        try:
            path = adapters.adapter_path(recipe, llm.engine.model_path)
        except (OSError, ValueError):
            path = None
        if path is not None and adapters.is_complete(path):
            paths[name] = str(path)
        else:
            paths[f"random{i + 1}"] = random_adapter(os.path.join(workdir, f"random{i + 1}"),
                                                     layer_shapes(llm.engine.model), rank=8, seed=i)
    return paths


# =================================================================== inputs
def random_lora_stack(num_slots: int, rank: int, in_features: int, out_features: int, seed: int = 0):
    """A [num_slots, rank, in] and B [num_slots, out, rank] (fp32) as the engine stacks them: slot 0 all zeros
    (no adapter), the others random (B scaled so a delta is about the size of x)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, rank, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(num_slots, out_features, rank, generator=gen) / rank ** 0.5
    a[0], b[0] = 0.0, 0.0
    return a, b


def segments_of(token_slots: Sequence[int]):
    """(seg_starts, seg_lens, seg_slots) int32 of the runs of equal non-zero slots, as the engine builds them."""
    segments: list[list[int]] = []
    for t, slot in enumerate(token_slots):
        if slot and segments and segments[-1][2] == slot and segments[-1][0] + segments[-1][1] == t:
            segments[-1][1] += 1
        elif slot:
            segments.append([t, 1, slot])
    columns = list(zip(*segments)) if segments else [(), (), ()]
    return tuple(torch.tensor(list(c), dtype=torch.int32) for c in columns)


# =================================================================== 2. the gather form
def _as_delta(got, num_tokens: int, out_features: int, call: str) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{call} returned {type(got).__name__}; expected a tensor [{num_tokens}, {out_features}]")
    if tuple(got.shape) != (num_tokens, out_features):
        hint = (": one row per token, out_features columns (x A^T is [T, r], times B^T is [T, out])"
                if got.dim() != 2 else ": did you multiply by B instead of B^T, or return [T, r]?")
        raise CheckFailed(f"{call} returned shape {tuple(got.shape)}, expected ({num_tokens}, {out_features}){hint}")
    return got.float()


def _delta_hint(got: torch.Tensor, x, a, b, slots: torch.Tensor) -> str:
    """The usual mistake behind a wrong delta, when one of them gives exactly what the learner returned."""
    first = slots[0].expand_as(slots)
    if torch.allclose(got, lora_delta_reference(x, a, b, first), atol=ATOL):
        return "every token used the first token's adapter: gather A and B per token, a[token_slots]"
    shifted = (slots - 1).clamp(min=0)
    if torch.allclose(got, lora_delta_reference(x, a, b, shifted), atol=ATOL):
        return "the adapters are off by one: slot s is a[s] (slot 0 is the zero adapter, it is not skipped)"
    if torch.allclose(got, (x.float() @ a[1].t()) @ b[1].t(), atol=ATOL):
        return "every token used slot 1: gather per token"
    return "each token's delta is (x[t] @ A[s]^T) @ B[s]^T with s = token_slots[t]"


def _gather_cases():
    """(x, a, b, token_slots, what) of the stated cases, then random ones of odd shapes."""
    cases = []
    a, b = random_lora_stack(4, 3, 6, 5, seed=1)
    x = random_tokens(5, 6, seed=1)
    cases.append((x, a, b, torch.tensor([0, 0, 0, 0, 0]), "every token on slot 0 (no adapter): a zero delta"))
    cases.append((x, a, b, torch.tensor([2, 2, 2, 2, 2]), "every token on slot 2"))
    cases.append((x, a, b, torch.tensor([1, 3, 0, 3, 2]), "token_slots [1, 3, 0, 3, 2]: each token its own adapter"))
    return cases


def _random_gather_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_slots = int(torch.randint(3, 7, (1,), generator=gen))
    rank = int(torch.randint(1, 17, (1,), generator=gen))
    in_f, out_f, tokens = (int(v) for v in torch.randint(5, 70, (3,), generator=gen))
    a, b = random_lora_stack(num_slots, rank, in_f, out_f, seed=seed)
    slots = torch.randint(0, num_slots, (tokens,), generator=gen)
    return random_tokens(tokens, in_f, seed), a, b, slots, (
        f"random case {seed}: {tokens} tokens, {num_slots} slots, rank {rank}, in {in_f}, out {out_f}")


def _check_gather_case(fn, x, a, b, slots, what) -> None:
    x_before, a_before = x.clone(), a.clone()
    call = f"lora_delta_gather(x [{x.shape[0]}, {x.shape[1]}], a {list(a.shape)}, b {list(b.shape)}, token_slots)"
    got = _as_delta(call_learner(fn, (x, a, b, slots), call), x.shape[0], b.shape[1], call)
    if not torch.equal(x, x_before) or not torch.equal(a, a_before):
        raise CheckFailed(f"{call} ({what}) changed its inputs: the engine still reads x and the slots afterwards")
    want = lora_delta_reference(x, a, b, slots)
    if not torch.allclose(got, want, atol=ATOL, rtol=1e-4):
        bad = int((got - want).abs().max(dim=1).values.argmax())
        raise CheckFailed(f"{call} ({what}): token {bad} (slot {int(slots[bad])}) differs by "
                          f"{float((got[bad] - want[bad]).abs().max()):.3g}: {_delta_hint(got, x, a, b, slots)}")


def check_lora_gather(fn: Callable, seed: int = 0, num_random: int = 6) -> None:
    """The gather form against kernels/lora.py's reference on the stated cases and random ones."""
    cases = _gather_cases() + [_random_gather_case(seed * 100 + i) for i in range(num_random)]
    for x, a, b, slots, what in cases:
        _check_gather_case(fn, x, a, b, slots, what)
    passed("lora_delta_gather", len(cases))


# =================================================================== 2. the segmented form
def _segment_cases():
    a, b = random_lora_stack(4, 4, 7, 6, seed=2)
    x = random_tokens(8, 7, seed=2)
    cases = []
    for slots, what in (([1, 1, 1, 2, 2, 3, 3, 3], "three segments covering every token"),
                        ([0, 0, 2, 2, 2, 0, 1, 0], "tokens outside every segment (slot 0) get a zero delta"),
                        ([3, 3, 3, 3, 3, 3, 3, 3], "one segment of 8 tokens")):
        cases.append((x, a, b, torch.tensor(slots), what))
    return cases


def _check_segment_case(fn, x, a, b, slots, what) -> None:
    starts, lens, seg_slots = segments_of(slots.tolist())
    call = (f"lora_delta_segments(x [{x.shape[0]}, {x.shape[1]}], a, b, seg_starts={starts.tolist()}, "
            f"seg_lens={lens.tolist()}, seg_slots={seg_slots.tolist()})")
    got = _as_delta(call_learner(fn, (x, a, b, starts, lens, seg_slots), call), x.shape[0], b.shape[1], call)
    want = lora_delta_reference(x, a, b, slots)
    if torch.allclose(got, want, atol=ATOL, rtol=1e-4):
        return
    bad = int((got - want).abs().max(dim=1).values.argmax())
    if not torch.isfinite(got).all() or (slots == 0).any() and not torch.allclose(got[slots == 0], want[slots == 0]):
        hint = "a token outside every segment gets a zero delta: start from torch.zeros, not torch.empty"
    elif torch.allclose(got, lora_delta_reference(x, a, b, token_slots_from_segments(
            x.shape[0], starts, lens, torch.arange(1, len(starts) + 1, dtype=torch.int32))), atol=ATOL):
        hint = "segment i uses adapter seg_slots[i], not slot i + 1"
    elif torch.allclose(got[bad], torch.zeros_like(got[bad])):
        hint = "a segment is tokens seg_starts[i] .. seg_starts[i] + seg_lens[i] - 1 (a length, not an end)"
    else:
        hint = "within segment i every token uses the adapter seg_slots[i]"
    raise CheckFailed(f"{call} ({what}): token {bad} (slot {int(slots[bad])}) differs by "
                      f"{float((got[bad] - want[bad]).abs().max()):.3g}: {hint}")


def check_lora_segments(fn: Callable, seed: int = 0, num_random: int = 6) -> None:
    """The segmented form against the same reference, on segments built from the stated and random slots (runs)."""
    cases = _segment_cases()
    for i in range(num_random):
        x, a, b, slots, what = _random_gather_case(seed * 100 + 50 + i)
        runs = torch.repeat_interleave(slots[: max(1, len(slots) // 4)], 4)[: len(slots)]   # runs of 4 tokens
        cases.append((x[: len(runs)], a, b, runs, what + ", in runs of 4 tokens"))
    for x, a, b, slots, what in cases:
        _check_segment_case(fn, x, a, b, slots, what)
    passed("lora_delta_segments", len(cases))


# =================================================================== 3. in the engine, against merged weights
def merged_check(delta: Callable, adapter, layer: int = 0, module: str = "q_proj", weight=None, seed: int = 0):
    """One adapted module: x W^T + your delta against x (W + scale B A)^T, the merged weights (the scale is in B).
    Returns the largest difference (relative to the output's size)."""
    a, b = adapter.weights[(layer, module)]
    gen = torch.Generator().manual_seed(seed)
    out_f, in_f = b.shape[0], a.shape[1]
    weight = torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5 if weight is None else weight.float()
    x = torch.randn(9, in_f, generator=gen)
    merged = x @ (weight + b.float() @ a.float()).t()
    a_stack = torch.stack([torch.zeros_like(a), a]).float()
    b_stack = torch.stack([torch.zeros_like(b), b]).float()
    slots = torch.tensor([1, 1, 0, 1, 1, 0, 1, 1, 1])
    plugged = x @ weight.t() + delta(x, a_stack, b_stack, slots).float()
    merged[slots == 0] = (x @ weight.t())[slots == 0]
    return float((plugged - merged).abs().max() / merged.abs().max())


def print_engine_runs(result: dict) -> None:
    """The mixed batch on the engine's own delta, on each plugged function, and on merged weights."""
    print(f"{len(result['owners'])} requests, adapters {result['owners']}, {result['max_tokens']} greedy tokens each")
    for name in result["plugged"]:
        equal = result["plugged"][name] == result["engine"]
        print(f"  your {name:<8} delta in the engine: {'✓ the engine’s own tokens' if equal else '✗ not the engine’s tokens'}")
    agree = sum(m == e for m, e in zip(result["merged"], result["engine"]))
    print(f"  merged weights (W + B A, one adapter at a time): {agree} of {len(result['engine'])} requests give the "
          "same greedy tokens (merging rounds differently: a near-tie may flip)")
    print(f"  merged-weights check of one module (layer 0 q_proj): largest relative difference "
          f"{result['merged_diff']:.2g}")


def check_engine_runs(result: dict | None) -> None:
    if result is None:
        raise CheckFailed("mixed is None: run the cell above (it needs both of your functions)")
    if not result["merged_diff"] < 1e-4:
        raise CheckFailed(f"x W^T + your delta differs from x (W + B A)^T by {result['merged_diff']:.3g} (relative): "
                          "the delta must equal what merging the adapter into the weights adds")
    for name, tokens in result["plugged"].items():
        for i, (mine, want) in enumerate(zip(tokens, result["engine"])):
            if mine != want:
                j = next((t for t, (p, q) in enumerate(zip(mine, want)) if p != q), min(len(mine), len(want)))
                raise CheckFailed(f"your {name} delta in the engine: request {i} (adapter {result['owners'][i]}) parts "
                                  f"from the engine's own tokens at output token {j}: run the checks of exercise "
                                  f"{1 if name == 'gather' else 2}")
    passed("your deltas in the engine", len(result["plugged"]) * len(result["engine"]) + 1)


def print_answers(rows: Sequence[dict]) -> None:
    """Section 4: each request of the mixed batch, its adapter and its answer."""
    for row in rows:
        print(f"[{row['adapter']:>6}] {row['prompt']}\n         {row['text'][:110]!r}")


# =================================================================== 5. throughput and memory
def throughput_row(num_adapters: int, adapter_bytes: int, model_bytes: int, measured: dict | None) -> dict:
    """One row of the sweep: the adapters' bytes, and (when your harness ran) its medians, spreads and ratio."""
    row = {"num_adapters": num_adapters, "adapter_bytes": adapter_bytes, "merged_copies_bytes": model_bytes * num_adapters}
    if measured is not None:
        for way in ("batched", "swap"):
            tokens = measured[way]["tok_s"] * measured[way]["median_s"]
            row.update({f"{way}_tok_s": measured[way]["tok_s"], f"{way}_tok_s_low": tokens / measured[way]["max_s"],
                        f"{way}_tok_s_high": tokens / measured[way]["min_s"]})
        row["ratio"] = measured["ratio"]
    return row


def print_throughput(rows: Sequence[dict], device: str) -> None:
    print(f"{'adapters':>8} {'batched tok/s':>14} {'merge+swap tok/s':>17} {'ratio':>6} {'adapters MiB':>13} "
          f"{'merged copies MiB':>18}   ({device}; medians)")
    for r in rows:
        timed = "batched_tok_s" in r
        print(f"{r['num_adapters']:>8} " + (f"{r['batched_tok_s']:>14.1f} {r['swap_tok_s']:>17.1f} "
                                           f"{r['batched_tok_s'] / r['swap_tok_s']:>5.2f}x " if timed
                                           else f"{'-':>14} {'-':>17} {'-':>6} ")
              + f"{r['adapter_bytes'] / MIB:>13.1f} {r['merged_copies_bytes'] / MIB:>18.0f}")


def throughput_figure(rows: Sequence[dict], device: str):
    fig = new_figure("Many adapters: one mixed batch vs merge-and-swap", "adapters in the workload",
                     "output tokens/s (median; bars: fastest and slowest run)", device)
    rows = [r for r in rows if "batched_tok_s" in r]
    n = [r["num_adapters"] for r in rows]
    for way, label in (("batched", "batched (one batch, per-token delta)"),
                       ("swap", "merge and swap (one adapter at a time)")):
        y = [r[f"{way}_tok_s"] for r in rows]
        error = {}
        if all(f"{way}_tok_s_low" in r for r in rows):
            error = {"error_y": {"type": "data", "symmetric": False,
                                 "array": [r[f"{way}_tok_s_high"] - v for r, v in zip(rows, y)],
                                 "arrayminus": [v - r[f"{way}_tok_s_low"] for r, v in zip(rows, y)]}}
        fig.add_scatter(x=n, y=y, name=label, **error)
    return fig


def reference_memory(rows: Sequence[dict], model_bytes: int, num_adapters: int = 100) -> dict:
    largest = max(rows, key=lambda r: r["num_adapters"])
    per_adapter = largest["adapter_bytes"] / largest["num_adapters"]
    lora = model_bytes + num_adapters * per_adapter
    merged = num_adapters * model_bytes
    return {"bytes_per_adapter": per_adapter, "lora_bytes": lora, "merged_bytes": merged, "ratio": merged / lora}


def check_memory(fn: Callable, rows: Sequence[dict] | None, model_bytes: int) -> None:
    """memory_for against the reference on the measured rows (and on a stub of two rows)."""
    if not rows:
        raise CheckFailed("lora_rows is empty: run the throughput cell above first")
    stub = [{"num_adapters": 1, "adapter_bytes": 3_000_000}, {"num_adapters": 4, "adapter_bytes": 10_000_000},
            {"num_adapters": 2, "adapter_bytes": 5_500_000}]   # not in order: the largest row is not the last
    for case_rows, case_bytes, what, n in ((list(rows), model_bytes, "your measured rows", 100),
                                           (stub, 500_000_000, "three rows: 1 adapter 3 MB, 4 adapters 10 MB, "
                                                               "2 adapters 5.5 MB", 100),
                                           (stub, 500_000_000, "the same rows, 10 adapters", 10)):
        call = f"memory_for({what}, model_bytes={case_bytes}, num_adapters={n})"
        got = call_learner(fn, (case_rows, case_bytes, n), call)
        want = reference_memory(case_rows, case_bytes, n)
        if not isinstance(got, dict) or set(got) != set(want):
            raise CheckFailed(f"{call} returned {got!r}; expected a dict with the keys {sorted(want)}")
        for key, value in want.items():
            if not isinstance(got[key], (int, float)) or not math.isclose(got[key], value, rel_tol=1e-6):
                hints = {"bytes_per_adapter": "the row with the most adapters, its adapter_bytes / num_adapters",
                         "lora_bytes": "ONE copy of the base model plus every adapter",
                         "merged_bytes": "one whole model per adapter",
                         "ratio": "merged_bytes / lora_bytes"}
                raise CheckFailed(f"{call}[{key!r}] = {got[key]!r}, expected {value:.6g}: {hints[key]}")
    passed("memory_for", 3)


def print_memory(memory: dict, model_bytes: int, num_adapters: int = 100) -> None:
    print(f"base model {model_bytes / MIB:.0f} MiB, one adapter {memory['bytes_per_adapter'] / MIB:.2f} MiB (measured)")
    print(f"{num_adapters} adapters on one base: {memory['lora_bytes'] / GIB:.2f} GiB;  {num_adapters} merged models: "
          f"{memory['merged_bytes'] / GIB:.1f} GiB  -> {memory['ratio']:.0f}x less memory")


# =================================================================== 6. routing
def _route_cases():
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 2, "logits [2, 1, 0, -1], top_k 2"),
        (torch.tensor([[0.0, 0.0, 5.0, 0.0, 1.0, 0.0, 0.0, 0.0]]), 1, "one expert (top_k 1): its weight is 1"),
        (torch.randn(5, 8, generator=gen).to(torch.bfloat16), 2, "bf16 logits: the softmax in fp32"),
        (torch.randn(7, 8, generator=gen) * 3, 8, "top_k = E: every expert"),
    ]


def check_route(fn: Callable, seed: int = 0, num_random: int = 6) -> None:
    """route_topk against the model's route (softmax in fp32, top-k, renormalised) on stated and random cases."""
    gen = torch.Generator().manual_seed(seed)
    cases = _route_cases()
    for i in range(num_random):
        experts = int(torch.randint(2, 65, (1,), generator=gen))
        top_k = int(torch.randint(1, min(experts, 8) + 1, (1,), generator=gen))
        tokens = int(torch.randint(1, 40, (1,), generator=gen))
        cases.append((torch.randn(tokens, experts, generator=gen) * 2, top_k,
                      f"random case {i}: {tokens} tokens, {experts} experts, top_k {top_k}"))
    for logits, top_k, what in cases:
        before = logits.clone()
        call = f"route_topk(router_logits {list(logits.shape)} {str(logits.dtype).replace('torch.', '')}, {top_k})"
        got = call_learner(fn, (logits, top_k), call)
        if not isinstance(got, tuple) or len(got) != 2:
            raise CheckFailed(f"{call} returned {type(got).__name__}; expected (weights [T, k], expert ids [T, k])")
        weights, ids = got
        want_w, want_ids = route(logits, top_k, normalize=True, weights_in_logits_dtype=False)
        shape = (logits.shape[0], top_k)
        if not isinstance(weights, torch.Tensor) or not isinstance(ids, torch.Tensor) \
                or tuple(weights.shape) != shape or tuple(ids.shape) != shape:
            raise CheckFailed(f"{call} ({what}) returned shapes {getattr(weights, 'shape', None)} / "
                              f"{getattr(ids, 'shape', None)}; expected {shape} each: one row per token, k columns")
        if not torch.equal(logits, before):
            raise CheckFailed(f"{call} ({what}) changed the router logits it was given")
        if weights.dtype != torch.float32:
            raise CheckFailed(f"{call} ({what}) returned {weights.dtype} weights: Mixtral keeps them in float32 "
                              "(softmax(..., dtype=torch.float32))")
        if not torch.equal(ids.long().sort(dim=1).values, want_ids.sort(dim=1).values):
            hint = ("the k experts with the highest router logits of each token: softmax over the experts (dim=-1, "
                    "each token's row), then topk over the experts")
            raise CheckFailed(f"{call} ({what}): expert ids {ids[:2].tolist()} ..., expected {want_ids[:2].tolist()} "
                              f"...: {hint}")
        got_w = weights.gather(1, ids.long().argsort(dim=1))
        want_sorted = want_w.gather(1, want_ids.argsort(dim=1))
        if not torch.allclose(got_w, want_sorted, atol=1e-6):
            full = torch.softmax(logits.float(), dim=-1).gather(1, want_ids).gather(1, want_ids.argsort(dim=1))
            if torch.allclose(got_w, full, atol=1e-6):
                hint = "renormalise: divide the k weights by their sum (Mixtral's weights sum to 1)"
            elif logits.dtype != torch.float32:
                hint = "take the softmax in float32 (dtype=torch.float32), not in the logits' bf16"
            else:
                hint = "weights = softmax(logits) of the chosen experts, divided by their sum"
            raise CheckFailed(f"{call} ({what}): weights {got_w[0].tolist()} (by expert id), expected "
                              f"{want_sorted[0].tolist()}: {hint}")
    passed("route_topk", len(cases))


# =================================================================== 6. dispatch
def random_experts(num_experts: int, hidden: int, inter: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return w13, w2


def reference_dispatch(x, weights, ids, w13, w2) -> torch.Tensor:
    return experts_reference(x, weights, ids, w13.shape[0], lambda e: (w13[e], w2[e]))


def _dispatch_hint(got, x, weights, ids, w13, w2) -> str:
    def close(other):
        return torch.allclose(got, other, atol=1e-4, rtol=1e-4)

    if close(reference_dispatch(x, torch.ones_like(weights), ids, w13, w2)):
        return "multiply each expert's output by the token's routing weight for it"
    if close(reference_dispatch(x, weights, ids, torch.cat([w13[:, w13.shape[1] // 2:], w13[:, :w13.shape[1] // 2]], 1), w2)):
        return "w13 holds the gate rows first, then the up rows: gate, up = (x @ w13[e].T).chunk(2, dim=-1)"
    if close(reference_dispatch(x, weights[:, :1], ids[:, :1], w13, w2)):
        return "each token has top_k experts: loop over all k columns of ids, not only the first"
    if ids.shape[1] > 1 and close(_last_write_wins(x, weights, ids, w13, w2)):
        return "a token's k expert outputs add up: index_add_ (or +=), not an assignment that keeps the last one"
    return "out[t] = sum over the token's k experts e of weight * (silu(x W_gate^T) * (x W_up^T)) W_down^T"


def _last_write_wins(x, weights, ids, w13, w2):
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        rows, cols = (ids == e).nonzero(as_tuple=True)
        if len(rows):
            gate, up = (x[rows] @ w13[e].t()).chunk(2, dim=-1)
            out[rows] = (F.silu(gate) * up) @ w2[e].t() * weights[rows, cols, None]
    return out


def _dispatch_case(tokens, experts, top_k, hidden, inter, seed, what):
    w13, w2 = random_experts(experts, hidden, inter, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = route(torch.randn(tokens, experts, generator=gen) * 2, top_k, True, False)
    return x, weights, ids, w13, w2, what


_MATMULS = None


def _matmul_functions() -> set:
    global _MATMULS
    if _MATMULS is None:
        _MATMULS = {torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum, torch.mv,
                    torch.tensordot, F.linear, torch.Tensor.matmul, torch.Tensor.__matmul__,
                    torch.Tensor.__rmatmul__, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.mv}
    return _MATMULS


def count_matmuls(fn: Callable, *args) -> tuple[object, int]:
    """(fn(*args), the matrix products it ran): torch calls seen by a TorchFunctionMode, counted if a matmul."""
    from torch.overrides import TorchFunctionMode

    matmuls = _matmul_functions()

    class Count(TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in matmuls:
                Count.count += 1
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn(*args)
    return out, Count.count


def check_idle_experts_cost_nothing(fn: Callable, num_experts: int = 8, tokens: int = 6) -> None:
    """An expert no token chose costs nothing: 6 tokens that all chose experts 1 and 5 of 8 must run at most 2/8 of
    the matrix products that 6 tokens spread over all 8 experts run (counted with a TorchFunctionMode)."""
    w13, w2 = random_experts(num_experts, 8, 12, seed=4)
    x = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(4))
    weights = torch.full((tokens, 2), 0.5)
    two = torch.tensor([[1, 5]] * tokens)
    spread = torch.tensor([[(2 * t) % num_experts, (2 * t + 1) % num_experts] for t in range(tokens)])
    call = f"moe_dispatch(x [{tokens}, 8], weights, ids, w13 [{num_experts}, 24, 8], w2 [{num_experts}, 8, 12])"
    idle = [e for e in range(num_experts) if e not in (1, 5)]
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    poisoned13[idle], poisoned2[idle] = float("nan"), float("nan")   # computing an idle expert shows up as NaN
    got = call_learner(fn, (x, weights, two, poisoned13, poisoned2), call)
    if isinstance(got, torch.Tensor) and not torch.isfinite(got.float()).all():
        raise CheckFailed(f"{call} (every token on experts 1 and 5; the 6 others' weights are NaN): your output has NaN, "
                          "so you computed experts no token chose and masked them out: an expert no token chose must "
                          "cost nothing (loop over the experts that have tokens)")
    _, ops_two = count_matmuls(lambda *a: call_learner(fn, a, call), x, weights, two, w13, w2)
    _, ops_all = count_matmuls(lambda *a: call_learner(fn, a, call), x, weights, spread, w13, w2)
    if ops_all == 0:
        return   # no torch matmul to count (e.g. a custom op): the values were checked above
    if ops_two * num_experts > ops_all * 2:
        raise CheckFailed(f"{call}: with every token on experts 1 and 5 your dispatch ran {ops_two} matrix products, "
                          f"with the tokens spread over all {num_experts} experts {ops_all}: an expert no token chose "
                          f"must cost nothing (skip it; at most 2/{num_experts} of the work, not "
                          f"{ops_two / ops_all:.0%})")


def check_dispatch(fn: Callable, seed: int = 0, num_random: int = 4) -> None:
    """moe_dispatch against the engine's expert loop (kernels/fused_moe.py experts_reference)."""
    gen = torch.Generator().manual_seed(seed)
    cases = [_dispatch_case(6, 4, 2, 8, 12, 1, "6 tokens, 4 experts, top_k 2"),
             _dispatch_case(5, 8, 1, 8, 12, 2, "top_k 1: one expert per token"),
             _dispatch_case(1, 8, 2, 16, 20, 3, "one token (a decode step of batch 1): two experts hit, six idle")]
    for i in range(num_random):
        experts = int(torch.randint(2, 12, (1,), generator=gen))
        top_k = int(torch.randint(1, min(experts, 4) + 1, (1,), generator=gen))
        tokens, hidden, inter = (int(v) for v in torch.randint(1, 40, (3,), generator=gen))
        cases.append(_dispatch_case(tokens, experts, top_k, hidden + 2, inter + 2, 100 * seed + i,
                                    f"random case {i}: {tokens} tokens, {experts} experts, top_k {top_k}"))
    for x, weights, ids, w13, w2, what in cases:
        call = f"moe_dispatch(x {list(x.shape)}, weights, ids {list(ids.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)})"
        got = call_learner(fn, (x, weights, ids, w13, w2), call)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(x.shape):
            raise CheckFailed(f"{call} ({what}) returned {getattr(got, 'shape', type(got).__name__)}; expected "
                              f"{tuple(x.shape)}: one hidden vector per token")
        want = reference_dispatch(x, weights, ids, w13, w2)
        if not torch.allclose(got.float(), want, atol=1e-4, rtol=1e-4):
            raise CheckFailed(f"{call} ({what}) differs from the engine's expert loop by "
                              f"{float((got.float() - want).abs().max()):.3g}: {_dispatch_hint(got.float(), x, weights, ids, w13, w2)}")
    check_idle_experts_cost_nothing(fn)
    passed("moe_dispatch", len(cases) + 1)


def print_moe_run(result: dict) -> None:
    print(f"random tiny Mixtral ({result['num_experts']} experts, top-{result['top_k']}, {result['num_layers']} layers): "
          f"{len(result['engine'])} prompts x {result['max_tokens']} greedy tokens")
    print("  your routing + dispatch in the engine: " + ("✓ the engine's own tokens" if result["equal"]
                                                          else "✗ not the engine's tokens"))
    print(f"  first prompt: {result['mine'][0]}")


def check_moe_run(result: dict | None) -> None:
    if result is None:
        raise CheckFailed("moe_run is None: run the cell above (it needs route_topk and moe_dispatch)")
    for i, (mine, want) in enumerate(zip(result["mine"], result["engine"])):
        if mine != want:
            j = next((t for t, (p, q) in enumerate(zip(mine, want)) if p != q), min(len(mine), len(want)))
            raise CheckFailed(f"your routing and dispatch in the tiny Mixtral: prompt {i} parts from the engine's own "
                              f"tokens at output token {j}: run the checks of exercises 6 and 7")
    passed("your MoE in the engine", len(result["engine"]))


# =================================================================== 7. active vs total
def print_param_counts(names: Sequence[str] = ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "tiny-mixtral")) -> None:
    print(f"{'model':<20} {'experts':>8} {'top-k':>5} {'total params':>13} {'active':>10} {'active share':>12}")
    for name in names:
        cfg = PRESETS[name]
        print(f"{name:<20} {cfg.num_experts:>8} {cfg.num_experts_per_tok:>5} {_count(cfg.num_params):>13} "
              f"{_count(cfg.num_active_params):>10} {cfg.num_active_params / cfg.num_params:>12.0%}")


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def active_params_b() -> float:
    """Mixtral 8x7B's active parameters (billions): the answer (a declared reference, not in the sandbox)."""
    return PRESETS["mixtral-8x7b"].num_active_params / 1e9


def check_answer_active_params_b(value) -> None:
    cfg = PRESETS["mixtral-8x7b"]
    want = active_params_b()   # the declared reference: computed only where the grader runs
    case = "answer_active_params_b (Mixtral 8x7B, top-2 of 8 experts, in billions)"
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"{case} is {value!r}; set it to a number of billions (a float, e.g. 20.0)")
    if abs(value - want) <= 0.15:
        passed("answer_active_params_b", 1)
        return
    total = cfg.num_params / 1e9
    if abs(value - total * cfg.num_experts_per_tok / cfg.num_experts) < 0.3:
        hint = "only the experts are sparse: attention, norms, routers and embeddings run for every token"
    elif abs(value - 2 * 7) < 0.3:
        hint = "'8x7B' is a name, not 8 models of 7B: the experts share the attention and the embeddings"
    elif abs(value - total) < 0.3:
        hint = "that is the total: a token runs through only 2 of the 8 experts of each layer"
    else:
        hint = "active = everything but the experts + 32 layers x 2 experts x 3 x 4096 x 14336"
    raise CheckFailed(f"{case} = {value!r} is not it: {hint}")


# =================================================================== 8. bytes per decode step
def experts_model(num_experts: int, top_k: int, batches: Sequence[int]) -> list[float]:
    return [expected_experts_touched(num_experts, top_k, b) for b in batches]


def print_touched(rows: Sequence[dict], num_experts: int, top_k: int, device: str) -> None:
    print(f"experts read per MoE layer per decode step ({num_experts} experts, top-{top_k}; {device})")
    print(f"{'batch':>5} {'measured':>9} {'E(1-(1-k/E)^B)':>15}")
    for r in rows:
        print(f"{r['batch']:>5} {r['experts_touched']:>9.2f} {expected_experts_touched(num_experts, top_k, r['batch']):>15.2f}")


def bytes_rows(rows: Sequence[dict], preset: str = "mixtral-8x7b", context_len: int = 512) -> list[dict]:
    """Bytes one decode step of Mixtral 8x7B (bf16) reads per batch size: with the experts touched measured on the
    tiny model (same E and k), modelled, and for dense models of the total and the active size."""
    cfg = PRESETS[preset]
    out = []
    for r in rows:
        b = r["batch"]
        out.append({"batch": b,
                    "moe_measured": decode_step_bytes(cfg, b, context_len, experts_touched=r["experts_touched"])["total"],
                    "moe_model": decode_step_bytes(cfg, b, context_len)["total"],
                    "dense_total": decode_step_bytes(cfg, b, context_len, experts_touched=cfg.num_experts)["total"],
                    "dense_active": decode_step_bytes(cfg, b, context_len,
                                                      experts_touched=cfg.num_experts_per_tok)["total"]})
    return out


def bytes_figure(rows: Sequence[dict], device: str):
    fig = new_figure("Bytes one decode step reads: Mixtral 8x7B (bf16) vs dense", "batch size (sequences)",
                     "GiB read per decode step", f"measured experts touched on {device}; bytes modelled", log_x=True)
    b = [r["batch"] for r in rows]
    for key, name, dash in (("dense_total", "dense 46.7B (every expert)", "dot"),
                            ("moe_measured", "MoE, experts touched measured", None),
                            ("moe_model", "MoE, E(1-(1-k/E)^B)", "dash"),
                            ("dense_active", "dense 12.9B (only k experts)", "dot")):
        fig.add_scatter(x=b, y=[r[key] / GIB for r in rows], name=name, line=dict(dash=dash) if dash else None)
    return fig


# =================================================================== 4b. the SGMV kernels (exercise 3)
SGMV_CASES = [   # (segments as (start, length, slot), tokens, slots, rank, in, out, what)
    ([(0, 3, 1)], 4, 3, 4, 8, 8, "one segment of 3 tokens on slot 1; token 3 in none"),
    ([(0, 2, 2), (3, 5, 1), (9, 1, 2)], 11, 3, 5, 20, 12,
     "segments (0, 2, slot 2), (3, 5, slot 1), (9, 1, slot 2); tokens 2, 8 and 10 in none; rank 5, in 20, out 12"),
    ([(0, 4, 0), (4, 3, 3)], 8, 4, 3, 9, 7, "a segment on slot 0 (no adapter: no delta), then (4, 3, slot 3)"),
]
HIDDEN_SGMV_CASES = [
    ([(1, 17, 2), (18, 2, 0), (20, 3, 1)], 24, 3, 7, 37, 70, "a segment of 17 tokens (two tiles of 16), rank 7"),
    ([(0, 1, 1), (1, 1, 3), (2, 1, 2), (3, 1, 1)], 5, 4, 16, 64, 130, "a decode step: one token per segment, rank 16"),
]


def make_sgmv_inputs(segments, num_tokens: int, num_slots: int, rank: int, in_features: int, out_features: int,
                     seed: int = 0, device: str = "cpu"):
    """x [T, in], a [S, r, in], b [S, out, r] (fp32, every slot random, slot 0 too: a kernel must skip it, as the
    engine's slot 0 holds zeros) and the segments as int32 tensors (seg_starts, seg_lens, seg_slots)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)
    a = torch.randn(num_slots, rank, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(num_slots, out_features, rank, generator=gen) / rank ** 0.5
    seg = [torch.tensor([s[i] for s in segments], dtype=torch.int32) for i in range(3)]
    return tuple(t.to(device) for t in (x, a, b, *seg))


def sgmv_reference(x, a, b, seg_starts, seg_lens, seg_slots, shrink_only: bool = False, **slips) -> torch.Tensor:
    """The spec in torch: for each segment on a slot s > 0, its rows of x times A[s]^T (the shrink, [T, r]) then
    B[s]^T (the expand, [T, out]); every other row 0. `slips` are the usual kernel mistakes, for the hints."""
    x, a, b = x.float().cpu(), a.float().cpu(), b.float().cpu()
    out = torch.zeros(x.shape[0], a.shape[1] if shrink_only else b.shape[1])
    for i, (start, length, slot) in enumerate(zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist())):
        if slips.get("segment_as_slot"):
            slot = i
        if slot == 0 and not slips.get("slot_0_not_skipped"):
            continue
        end = min(x.shape[0], start + length + (1 if slips.get("one_row_too_many") else 0))
        mid = x[start:end] @ a[slot].t()
        out[start:end] = mid if shrink_only else mid @ b[slot].t()
    return out


def _sgmv_hint(got, x, a, b, starts, lens, slots, shrink_only) -> str:
    def close(**slips):
        want = sgmv_reference(x, a, b, starts, lens, slots, shrink_only, **slips)
        return bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4))

    if got.isnan().any():
        return ("NaN: the launcher fills the segments' rows with NaN, so this output was never stored (a store mask "
                "that drops valid rows or columns, or a loop that misses the tail of a segment)")
    if close(slot_0_not_skipped=True):
        return "a segment on slot 0 has no adapter: its program returns at once (vLLM's lora id -1), nothing stored"
    if close(segment_as_slot=True):
        return "segment i uses the adapter seg_slots[i], not slot i: load the slot from seg_slot_ptr + seg"
    if close(one_row_too_many=True):
        return "a row past the segment's end was written: the rows of segment i are rows < seg_lens[i] (mask <, not <=)"
    return ("compare with the torch spec above, one segment at a time: the token is seg_starts[i] + row, A[slot] "
            "starts at slot * R * IN, B[slot] at slot * OUT * R")


def _check_sgmv(fn, cases, seed, shrink_only: bool, name: str, device: str | None) -> None:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    for i, (segments, tokens, num_slots, rank, in_f, out_f, what) in enumerate(cases):
        x, a, b, starts, lens, slots = make_sgmv_inputs(segments, tokens, num_slots, rank, in_f, out_f, seed + i, device)
        args = (x, a) if shrink_only else (x, a, b)
        shapes = f"x [{tokens}, {in_f}], a {list(a.shape)}" + ("" if shrink_only else f", b {list(b.shape)}")
        call = (f"{name}({shapes}, seg_starts={starts.tolist()}, seg_lens={lens.tolist()}, "
                f"seg_slots={slots.tolist()})")
        got = call_learner(fn, (*args, starts, lens, slots), call)
        width = rank if shrink_only else out_f
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (tokens, width):
            raise CheckFailed(f"{call} ({what}) returned {getattr(got, 'shape', type(got).__name__)}; expected "
                              f"[{tokens}, {width}]")
        got = got.float().cpu()
        want = sgmv_reference(x, a, b, starts, lens, slots, shrink_only)
        close = (got - want).abs() <= 1e-4 + 1e-4 * want.abs()
        if bool(close.all()):
            continue
        r, c = (int(v) for v in (~close).nonzero()[0])
        raise CheckFailed(f"{call} ({what}): row {r}, column {c} is {float(got[r, c]):.5g}, expected "
                          f"{float(want[r, c]):.5g} — {_sgmv_hint(got, x, a, b, starts, lens, slots, shrink_only)}")
    passed(name, len(cases))


def check_sgmv_shrink(shrink: Callable, cases=SGMV_CASES, seed: int = 0, device: str | None = None) -> None:
    """Your shrink kernel (through its launcher `sgmv_shrink(x, a, seg_starts, seg_lens, seg_slots)`) against the
    torch spec on fresh random inputs: [T, r], each segment's rows x A[slot]^T, every other row 0."""
    _check_sgmv(shrink, cases, seed, True, "sgmv_shrink", device)


def check_sgmv_delta(delta: Callable, cases=SGMV_CASES, seed: int = 0, device: str | None = None) -> None:
    """Both kernels (through `sgmv_delta(x, a, b, seg_starts, seg_lens, seg_slots)`: your shrink, then your expand)
    against the torch spec on fresh random inputs: [T, out]."""
    _check_sgmv(delta, cases, seed, False, "sgmv_delta", device)


def kernel_part(sgmv_delta: Callable, counter: dict | None = None) -> Callable:
    """The engine part lora_delta=fn(x, a, b, batch) running `sgmv_delta` on the step's segments; `counter` gets
    the calls, their seconds, and per step kind the tokens and segments the kernels saw."""
    from .common import Stopwatch

    def fn(x, a, b, batch):
        with Stopwatch() as sw:
            delta = sgmv_delta(x, a, b, batch.seg_starts, batch.seg_lens, batch.seg_slots)
        if counter is not None:
            counter["calls"] = counter.get("calls", 0) + 1
            counter["kernel_s"] = counter.get("kernel_s", 0.0) + sw.seconds
            shapes = counter.setdefault("steps", {})
            shapes[(x.shape[0], len(batch.seg_slots))] = shapes.get((x.shape[0], len(batch.seg_slots)), 0) + 1
        return delta
    return fn


def tiny_lora_setup(workdir: str, num_prompts: int = 4):
    """(engine, three LoRARequests, prompts) for the kernels' engine run under the interpreter: random:tiny-llama
    (2 layers, hidden 64) with LoRA on and three random adapters (ranks 4, 8, 16, large enough to change its
    greedy tokens), and random prompts of 4 to 13 tokens."""
    import os

    from .. import LLM
    from ..bench.lora import random_adapter
    from ..layers.lora import layer_shapes
    from ..lora import LoRARequest

    llm = LLM("random:tiny-llama", enable_lora=True, max_loras=3, max_lora_rank=16, seed=0)
    shapes = layer_shapes(llm.engine.model)
    requests = [LoRARequest(f"tiny{i}", 200 + i, random_adapter(os.path.join(workdir, f"tiny{i}"), shapes, rank=rank,
                                                                seed=i, std=0.5))
                for i, rank in enumerate((4, 8, 16))]
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, llm.model_config.vocab_size, (4 + 3 * i,), generator=gen).tolist()}
               for i in range(num_prompts)]
    return llm, requests, prompts


def print_kernel_engine_run(result: dict) -> None:
    from .common import print_kernel_run

    print(f"{len(result['owners'])} requests, adapters {result['owners']}")
    print_kernel_run(result, [("the engine's own LoRA path", result["engine"], "")], result["calls"],
                     "lora_delta calls (one shrink + one expand launch each)")
    for (tokens, segments), calls in sorted(result["steps"].items(), reverse=True):
        print(f"  a step of {tokens} tokens in {segments} segments: {calls} calls")


def check_kernel_engine_run(result: dict | None) -> None:
    if result is None:
        raise CheckFailed("kernel_run is None: run the cell above (it needs your two kernels)")
    if result["calls"] == 0:
        raise CheckFailed("your kernels never ran in the engine: the plugged part was not called")
    for i, (mine, want) in enumerate(zip(result["tokens"], result["engine"])):
        if mine != want:
            j = next((t for t, (p, q) in enumerate(zip(mine, want)) if p != q), min(len(mine), len(want)))
            raise CheckFailed(f"your SGMV kernels in the engine: request {i} (adapter {result['owners'][i]}) parts "
                              f"from the engine's own LoRA tokens at output token {j}: run the kernel checks above")
    passed("your SGMV kernels in the engine", len(result["engine"]))


def time_sgmv(sgmv_delta: Callable, num_tokens: int = 256, num_segments: int = 8, rank: int = 16,
              in_features: int = 4096, out_features: int = 4096, num_slots: int = 9) -> dict:
    """On a GPU: your two kernels on an 8B-shaped layer (a batch of num_tokens in num_segments runs) against the
    gather form in torch (each token's A and B copied, then bmm) and the engine's own SGMV kernels."""
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    from .common import gpu_seconds

    length = num_tokens // num_segments
    segments = [(i * length, length, 1 + i % (num_slots - 1)) for i in range(num_segments)]
    x, a, b, starts, lens, slots = make_sgmv_inputs(segments, num_tokens, num_slots, rank, in_features,
                                                    out_features, device="cuda")
    token_slots = token_slots_from_segments(num_tokens, starts, lens, slots)

    def engine():
        from ..kernels.lora import sgmv_expand, sgmv_shrink

        y = torch.zeros(num_tokens, out_features, device="cuda")
        sgmv_expand(sgmv_shrink(x, a, starts, lens, slots, length), b, y, starts, lens, slots, length)

    try:
        engine_s = gpu_seconds(engine)
    except Exception:  # noqa: BLE001 - where the engine's kernels are not reachable (the grading sandbox)
        engine_s = None
    return {"device": torch.cuda.get_device_name(),
            "shape": f"{num_tokens} tokens in {num_segments} segments, rank {rank}, {in_features} -> {out_features}",
            "yours_s": gpu_seconds(lambda: sgmv_delta(x, a, b, starts, lens, slots)),
            "gather_s": gpu_seconds(lambda: torch.bmm(b[token_slots], torch.bmm(a[token_slots], x.unsqueeze(2)))),
            "engine_s": engine_s}


def print_sgmv_timing(result: dict) -> None:
    from .common import format_seconds, print_no_gpu_timing

    if result["device"] == "cpu":
        print_no_gpu_timing("on an 8B-shaped layer (256 tokens in 8 segments) against the gather form in torch "
                            "and the engine's own SGMV kernels")
        return
    print(f"{result['shape']} — {result['device']}")
    for name in ("yours", "engine", "gather"):
        if result[name + "_s"] is not None:
            print(f"  {name:>7}: {format_seconds(result[name + '_s'])}")
    print(f"  the gather form over yours: {result['gather_s'] / result['yours_s']:.1f}x")


# =================================================================== 5. the learner's throughput harness
# The course's reference run of the harness, full mode's largest N: the master's measure_lora_throughput (the same
# code as reference_throughput) on the notebook's lora_ways(llm, 8 adapters, 16 requests, 24 tokens), warmup=1,
# repeats=3, on the default model with random adapters of rank 8 to 16 (LLM(enable_lora=True, max_loras=8,
# max_lora_rank=16, max_num_seqs=16)), recorded on a shared 2-core machine: batched 14.8 tok/s (median 25.9 s a run,
# 23.5 to 28.1 s), merge-and-swap 5.2 tok/s (median 73.8 s, 69.1 to 80.7 s).
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
REFERENCE_COMMAND = ("section 6's sweep cell in full mode at N = 8: measure_lora_throughput(*lora_ways(llm, 8 adapters, "
                     "16, 24), 16 * 24, warmup=1, repeats=3) on the default model")
REFERENCE_LORA_RATIO = 2.85     # batched tok/s / merge-and-swap tok/s at 8 adapters
REFERENCE_LORA_ADAPTERS = 8
HARNESS_TOKENS = 96             # the fake runs' output tokens


def reference_throughput(run_batched: Callable, run_swapped: Callable, tokens: int, clock: Callable,
                         warmup: int = 1, repeats: int = 3) -> dict:
    """The harness's reference: warm-up calls untimed, each timed call between two reads of `clock`, the median and
    the spread of each way, tokens/s from the medians, the ratio batched over merge-and-swap."""
    import statistics

    result = {}
    for name, run in (("batched", run_batched), ("swap", run_swapped)):
        for _ in range(warmup):
            run()
        samples = []
        for _ in range(repeats):
            start = clock()
            run()
            samples.append(clock() - start)
        median = statistics.median(samples)
        result[name] = {"median_s": median, "min_s": min(samples), "max_s": max(samples), "tok_s": tokens / median}
    result["ratio"] = result["batched"]["tok_s"] / result["swap"]["tok_s"]
    return result


class _FakeRun:
    """A fake engine run: each call moves the clock by the next scripted cost."""

    def __init__(self, clock, costs):
        self.clock, self.costs, self.calls = clock, list(costs), 0

    def __call__(self):
        if self.calls >= len(self.costs):
            raise CheckFailed(f"the harness called a run {self.calls + 1} times; warmup + repeats = {len(self.costs)}")
        self.clock.advance(self.costs[self.calls])
        self.calls += 1


def check_throughput_harness(fn: Callable) -> None:
    """measure_lora_throughput with a FakeClock and fake runs of known costs (warm-up calls 20x slower, one
    outlier): warm-up dropped, the median and spread of each way, tokens/s and the ratio. Never real times."""
    from .common import FakeClock, scripted_costs, timing_mistake, timing_summary

    for warmup, repeats, base_b, base_s, seed in ((1, 5, 0.4, 1.1, 0), (2, 4, 0.25, 0.9, 1), (0, 3, 0.5, 0.6, 2)):
        clock = FakeClock()
        costs = {"batched": scripted_costs(base_b, warmup, repeats, seed),
                 "swap": scripted_costs(base_s, warmup, repeats, seed + 10)}
        runs = {name: _FakeRun(clock, c) for name, c in costs.items()}
        call = (f"measure_lora_throughput(fake batched run, fake merge-and-swap run, tokens={HARNESS_TOKENS}, "
                f"clock=FakeClock, warmup={warmup}, repeats={repeats})")
        got = call_learner(lambda: fn(runs["batched"], runs["swap"], HARNESS_TOKENS, clock=clock, warmup=warmup,
                                      repeats=repeats), (), call)
        if clock.reads == 0:
            raise CheckFailed(f"{call}: the clock passed in was never read: time with `clock()`, not "
                              "time.perf_counter() (the default argument is perf_counter; the check passes a fake)")
        for name, run in runs.items():
            if run.calls != warmup + repeats:
                raise CheckFailed(f"{call}: the {name} run was called {run.calls} times; expected warmup + repeats = "
                                  f"{warmup + repeats}")
        way_keys = {"median_s", "min_s", "max_s", "tok_s"}
        if not isinstance(got, dict) or set(got) != {"batched", "swap", "ratio"} or any(
                not isinstance(got[k], dict) or set(got[k]) != way_keys for k in ("batched", "swap")):
            raise CheckFailed(f"{call} returned {got!r}; expected {{'batched': {{...}}, 'swap': {{...}}, 'ratio': ...}} "
                              "with median_s, min_s, max_s, tok_s in each")
        for name in ("batched", "swap"):
            stats = timing_summary(costs[name][warmup:])
            for key, value in (("median_s", stats["median"]), ("min_s", stats["min"]), ("max_s", stats["max"]),
                               ("tok_s", HARNESS_TOKENS / stats["median"])):
                value_got = got[name][key]
                if isinstance(value_got, (int, float)) and math.isclose(value_got, value, rel_tol=1e-6):
                    continue
                why = ""
                if key == "median_s" and isinstance(value_got, (int, float)):
                    why = timing_mistake(value_got, costs[name], warmup)
                if key == "tok_s" and isinstance(value_got, (int, float)):
                    mistake = timing_mistake(HARNESS_TOKENS / value_got, costs[name], warmup) if value_got else ""
                    why = f"tokens / the {mistake}" if mistake else "tokens / the median seconds of one run"
                raise CheckFailed(f"{call}[{name!r}][{key!r}] = {value_got!r}, expected {value:.6g}"
                                  + (f": {why}" if why else ""))
        ratio = got["batched"]["tok_s"] / got["swap"]["tok_s"]
        if not isinstance(got["ratio"], (int, float)) or not math.isclose(got["ratio"], ratio, rel_tol=1e-6):
            inverted = isinstance(got["ratio"], (int, float)) and got["ratio"] and math.isclose(
                1 / got["ratio"], ratio, rel_tol=1e-6)
            raise CheckFailed(f"{call}['ratio'] = {got['ratio']!r}, expected {ratio:.6g}: "
                              + ("inverted: batched tok/s OVER merge-and-swap tok/s" if inverted
                                 else "batched tok/s / merge-and-swap tok/s"))
    passed("measure_lora_throughput", 3)


def print_reference_ratio(rows: Sequence[dict]) -> None:
    """The ratio at the most adapters of your sweep beside the course's reference run."""
    from .common import print_beside_reference

    row = max(rows, key=lambda r: r["num_adapters"])
    if "ratio" not in row:
        return
    print_beside_reference(f"batched / merge-and-swap tok/s at {row['num_adapters']} adapters", row["ratio"],
                           REFERENCE_LORA_RATIO, REFERENCE_HARDWARE, unit="x", digits=3)
    if row["num_adapters"] != REFERENCE_LORA_ADAPTERS:
        print(f"  (the reference is at {REFERENCE_LORA_ADAPTERS} adapters, 16 requests x 24 tokens: full mode; "
              "quick mode's runs are shorter, so the fixed costs weigh more)")


def compile_kernels(shrink_kernel, expand_kernel, targets: Sequence[int] = (80, 90), timeout_s: int = 600) -> str:
    """Compile your two kernels ahead of time for each CUDA compute capability (no GPU needed: Triton ships the PTX
    assembler) in a fresh process without the interpreter, which forgives what a GPU compiler does not;
    CheckFailed with the compiler's last lines if one does not compile."""
    import inspect
    import os
    import subprocess
    import sys
    import tempfile
    import textwrap

    require_kernel(shrink_kernel)
    require_kernel(expand_kernel)
    sources = [textwrap.dedent(inspect.getsource(getattr(k, "fn", k))) for k in (shrink_kernel, expand_kernel)]
    segments = {"seg_start_ptr": "*i32", "seg_len_ptr": "*i32", "seg_slot_ptr": "*i32"}
    jobs = [("sgmv_shrink_kernel", {"x_ptr": "*fp32", "a_ptr": "*fp32", "mid_ptr": "*fp32", **segments, "IN": "i32",
                                    "R": "i32", "BLOCK_M": "constexpr", "BLOCK_R": "constexpr", "BLOCK_K": "constexpr"},
             {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 32}),
            ("sgmv_expand_kernel", {"mid_ptr": "*fp32", "b_ptr": "*fp32", "delta_ptr": "*fp32", **segments,
                                    "OUT": "i32", "R": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                                    "BLOCK_R": "constexpr"},
             {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_R": 16})]
    with tempfile.TemporaryDirectory(prefix="lab10-aot-") as tmp:
        path = os.path.join(tmp, "lab10_kernels.py")
        with open(path, "w") as f:
            f.write("import triton\nimport triton.language as tl\n\n\n" + "\n\n".join(sources))
        script = textwrap.dedent(f"""
            import importlib.util
            import triton
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource
            spec = importlib.util.spec_from_file_location("lab10_kernels", {path!r})
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            for cc in {tuple(targets)!r}:
                for name, signature, constexprs in {jobs!r}:
                    triton.compile(ASTSource(fn=getattr(module, name), signature=signature, constexprs=constexprs),
                                   target=GPUTarget("cuda", cc, 32))
                print("sm_%d ok" % cc, flush=True)
        """)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise CheckFailed("your kernels do not compile for the GPU (the interpreter forgave it):\n" + "\n".join(lines[-12:]))
    ok = [line.split()[0] for line in done.stdout.split("\n") if line.endswith(" ok")]
    return "✓ sgmv_shrink_kernel and sgmv_expand_kernel compile for " + " and ".join(ok)
