"""Lab 11 (scale out): the checks of the column / row split of a linear layer and of a tensor-parallel SwiGLU MLP,
the learner's all-reduce accounting and the when-does-splitting-pay answer; the autoscaler policy's checks and the
fleet choice's grading by re-simulation; the printouts and figures of the tensor-parallel run, the simulated day, the
real two-replica fleet and the minillm / vLLM side-by-side benchmark.

Every check calls the learner's function through `call_learner` on the stated cases and on fresh random inputs of
odd shapes, compares with a torch reference written here (the unsharded layer, the engine's SiLU-and-mul), and names
the usual mistake when it recognises one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .common import (CheckFailed, FakeClock, call_learner, echo_prediction, new_figure, passed,  # noqa: F401 - for the notebook
                     device_label, require_kernel,
                     random_tokens)

ATOL = 1e-5


# =================================================================== inputs
def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A linear layer's weight [out, in] (fp32) as torch stores it (y = x W^T), scaled so y is about x's size."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5


def blocks(size: int, num_shards: int) -> list[slice]:
    """The contiguous block of each rank: rank r holds indices r * size / N .. (r + 1) * size / N - 1."""
    step = size // num_shards
    return [slice(r * step, (r + 1) * step) for r in range(num_shards)]


# =================================================================== references
def reference_column(x, weight, num_shards: int) -> list[torch.Tensor]:
    return [x @ weight[rows].t() for rows in blocks(weight.shape[0], num_shards)]


def reference_row(x, weight, num_shards: int) -> list[torch.Tensor]:
    return [x[:, cols] @ weight[:, cols].t() for cols in blocks(weight.shape[1], num_shards)]


def reference_mlp(x, w_gate_up, w_down) -> torch.Tensor:
    """SwiGLU as the engine runs it: gate_up [2I, H] holds the gate rows, then the up rows."""
    gate, up = (x @ w_gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down.t()


def reference_mlp_partials(x, w_gate_up, w_down, num_shards: int) -> list[torch.Tensor]:
    """Each rank's partial output before the MLP's one all-reduce (Megatron: gate_up column-, down row-parallel)."""
    inter = w_down.shape[1]
    gate_w, up_w = w_gate_up[:inter], w_gate_up[inter:]
    out = []
    for cols in blocks(inter, num_shards):
        h = F.silu(x @ gate_w[cols].t()) * (x @ up_w[cols].t())
        out.append(h @ w_down[:, cols].t())
    return out


# =================================================================== shared checking
def _as_shards(got, num_shards: int, shape: tuple[int, int], call: str, hint_shape: Callable) -> list[torch.Tensor]:
    if not isinstance(got, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in got):
        raise CheckFailed(f"{call} returned {type(got).__name__}; expected a list of {num_shards} tensors, one per rank "
                          "in rank order")
    if len(got) != num_shards:
        raise CheckFailed(f"{call} returned {len(got)} tensors; expected {num_shards}: one per rank")
    for rank, t in enumerate(got):
        if tuple(t.shape) != shape:
            raise CheckFailed(f"{call}: rank {rank}'s output has shape {tuple(t.shape)}, expected {shape}"
                              f"{hint_shape(tuple(t.shape))}")
    return [t.float() for t in got]


def _first_bad(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> int | None:
    for rank, (g, w) in enumerate(zip(got, want)):
        if not torch.allclose(g, w, atol=ATOL, rtol=1e-4):
            return rank
    return None


def _same(got: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> bool:
    return len(got) == len(other) and all(g.shape == o.shape and torch.allclose(g, o, atol=ATOL, rtol=1e-4)
                                          for g, o in zip(got, other))


def _strided(weight, num_shards: int, dim: int) -> list[torch.Tensor]:
    return [weight[r::num_shards] if dim == 0 else weight[:, r::num_shards] for r in range(num_shards)]


def _split_cases(seed: int, num_random: int, stated: list[tuple]) -> list[tuple]:
    """(x, weight, N, what): the stated cases, then random odd shapes (out and in multiples of N)."""
    gen = torch.Generator().manual_seed(seed)
    cases = list(stated)
    for i in range(num_random):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        out_f = n * int(torch.randint(1, 14, (1,), generator=gen))
        in_f = n * int(torch.randint(1, 14, (1,), generator=gen))
        tokens = int(torch.randint(1, 10, (1,), generator=gen))
        cases.append((random_tokens(tokens, in_f, seed * 100 + i), random_weight(out_f, in_f, seed * 100 + i), n,
                      f"random case {i}: {tokens} tokens, weight [{out_f}, {in_f}], N = {n}"))
    return cases


def _stated_split_cases() -> list[tuple]:
    x, w = random_tokens(3, 6, seed=1), random_weight(4, 6, seed=1)
    x9, w9 = random_tokens(5, 9, seed=2), random_weight(6, 9, seed=2)
    return [(x, w, 2, "weight [4, 6], N = 2"), (x9, w9, 3, "weight [6, 9], N = 3"),
            (x, w, 1, "N = 1: one rank holds the whole layer")]


# =================================================================== 1. column parallel
def check_column_parallel(fn: Callable, seed: int = 0, num_random: int = 8) -> None:
    """column_parallel against the unsharded layer: rank r's output is x @ W[block r]^T, and the concatenation of
    the N outputs in rank order (the all-gather) is x @ W^T."""
    for x, weight, n, what in _split_cases(seed, num_random, _stated_split_cases()):
        x_before, w_before = x.clone(), weight.clone()
        out_f, in_f = weight.shape
        call = f"column_parallel(x [{x.shape[0]}, {in_f}], weight [{out_f}, {in_f}], {n})"

        def shape_hint(shape, out_f=out_f, in_f=in_f, n=n):
            if n > 1 and shape == (x.shape[0], out_f):
                return (": that is a whole output (or a row split's partial sum). A column split gives rank r only "
                        "its block of output features: weight's rows r * out / N .. (r + 1) * out / N - 1")
            return ": [tokens, out / N] — split weight's dim 0 (its output rows, torch stores [out, in])"

        got = _as_shards(call_learner(fn, (x, weight, n), call), n, (x.shape[0], out_f // n), call, shape_hint)
        if not torch.equal(x, x_before) or not torch.equal(weight, w_before):
            raise CheckFailed(f"{call} ({what}) changed its inputs in place")
        want = reference_column(x, weight, n)
        rank = _first_bad(got, want)
        if rank is None:
            continue
        if _same(got, [x @ w.t() for w in _strided(weight, n, 0)]):
            hint = "every N-th row is not a block: rank r holds the contiguous rows r * out / N .. (r + 1) * out / N - 1"
        elif _same(got, want[::-1]):
            hint = "the outputs are in reverse order: return them in rank order, rank 0 first"
        else:
            hint = "rank r computes x @ weight[r * out / N : (r + 1) * out / N].T"
        raise CheckFailed(f"{call} ({what}): rank {rank}'s output differs from x @ W[block {rank}]^T by "
                          f"{float((got[rank] - want[rank]).abs().max()):.3g}: {hint}")
    passed("column_parallel", len(_split_cases(seed, num_random, _stated_split_cases())))


# =================================================================== 2. row parallel
def check_row_parallel(fn: Callable, seed: int = 0, num_random: int = 8) -> None:
    """row_parallel against the unsharded layer: rank r's partial is x[:, block r] @ W[:, block r]^T, and the sum of
    the N partials (the all-reduce) is x @ W^T."""
    for x, weight, n, what in _split_cases(seed + 7, num_random, _stated_split_cases()):
        x_before, w_before = x.clone(), weight.clone()
        out_f, in_f = weight.shape
        call = f"row_parallel(x [{x.shape[0]}, {in_f}], weight [{out_f}, {in_f}], {n})"

        def shape_hint(shape, out_f=out_f, n=n):
            if n > 1 and shape == (x.shape[0], out_f // n):
                return (": that is a column split's output. A row split cuts the INPUT features (weight's dim 1, x's "
                        "dim 1); every rank's partial has all out features")
            return ": [tokens, out] — every rank's partial covers every output feature"

        got = _as_shards(call_learner(fn, (x, weight, n), call), n, (x.shape[0], out_f), call, shape_hint)
        if not torch.equal(x, x_before) or not torch.equal(weight, w_before):
            raise CheckFailed(f"{call} ({what}) changed its inputs in place")
        want = reference_row(x, weight, n)
        rank = _first_bad(got, want)
        if rank is None:
            continue
        full = x @ weight.t()
        if n > 1 and all(torch.allclose(g, full, atol=ATOL, rtol=1e-4) for g in got):
            hint = ("every rank returned the whole x @ W^T: then the all-reduce (a sum) gives N times the output. "
                    "Rank r multiplies only its block: x[:, block r] @ weight[:, block r].T")
        elif n > 1 and all(torch.allclose(g, full / n, atol=ATOL, rtol=1e-4) for g in got):
            hint = "each rank returned x @ W^T / N: a rank holds only its block of weight, x[:, block r] @ weight[:, block r].T"
        elif _same(got, [x[:, r::n] @ w.t() for r, w in enumerate(_strided(weight, n, 1))]):
            hint = "every N-th column is not a block: rank r holds the contiguous columns r * in / N .. (r + 1) * in / N - 1"
        else:
            hint = "rank r's partial is x[:, block r] @ weight[:, block r].T (the same block of x's and weight's columns)"
        raise CheckFailed(f"{call} ({what}): rank {rank}'s partial differs from x[:, block {rank}] @ W[:, block "
                          f"{rank}]^T by {float((got[rank] - want[rank]).abs().max()):.3g}: {hint}")
    passed("row_parallel", len(_split_cases(seed + 7, num_random, _stated_split_cases())))


# =================================================================== 3. the MLP block
def random_mlp(hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w_gate_up [2I, H] (gate rows, then up rows) and w_down [H, I], as the engine stores a SwiGLU MLP."""
    return random_weight(2 * inter, hidden, seed), random_weight(hidden, inter, seed + 500)


def _naive_chunk_partials(x, w_gate_up, w_down, n):
    """gate_up cut into N contiguous blocks of 2I / N rows, as if it were one matrix (the fused layout ignored)."""
    out = []
    for rows, cols in zip(blocks(w_gate_up.shape[0], n), blocks(w_down.shape[1], n)):
        gate, up = (x @ w_gate_up[rows].t()).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ w_down[:, cols].t())
    return out


def _mlp_cases(seed: int, num_random: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = random_mlp(6, 8, seed=3)
    cases = [(random_tokens(4, 6, 3), w13, w2, 2, "hidden 6, intermediate 8, N = 2"),
             (random_tokens(1, 6, 4), w13, w2, 4, "one token (a decode step of batch 1), N = 4"),
             (random_tokens(3, 6, 5), w13, w2, 1, "N = 1: the whole MLP on one rank")]
    for i in range(num_random):
        n = int(torch.randint(1, 5, (1,), generator=gen))
        hidden = int(torch.randint(2, 30, (1,), generator=gen))
        inter = n * int(torch.randint(1, 12, (1,), generator=gen))
        tokens = int(torch.randint(1, 9, (1,), generator=gen))
        w13, w2 = random_mlp(hidden, inter, seed * 100 + i)
        cases.append((random_tokens(tokens, hidden, seed * 100 + i), w13, w2, n,
                      f"random case {i}: {tokens} tokens, hidden {hidden}, intermediate {inter}, N = {n}"))
    return cases


def check_parallel_mlp(fn: Callable, seed: int = 0, num_random: int = 8) -> None:
    """parallel_mlp: N partial outputs [T, H] whose sum (the MLP's one all-reduce) is the unsharded SwiGLU MLP, each
    computed from its rank's gate rows, up rows and down columns only."""
    cases = _mlp_cases(seed, num_random)
    for x, w13, w2, n, what in cases:
        before = (x.clone(), w13.clone(), w2.clone())
        call = f"parallel_mlp(x [{x.shape[0]}, {x.shape[1]}], w_gate_up {list(w13.shape)}, w_down {list(w2.shape)}, {n})"

        def shape_hint(shape, hidden=x.shape[1]):
            return f": [tokens, hidden {hidden}] per rank — down_proj is row-parallel, its partials cover every feature"

        got = _as_shards(call_learner(fn, (x, w13, w2, n), call), n, (x.shape[0], x.shape[1]), call, shape_hint)
        if not all(torch.equal(a, b) for a, b in zip((x, w13, w2), before)):
            raise CheckFailed(f"{call} ({what}) changed its inputs in place")
        want = reference_mlp_partials(x, w13, w2, n)
        total = torch.stack(got).sum(0)
        reference = reference_mlp(x, w13, w2)
        rank = _first_bad(got, want)
        if rank is None and torch.allclose(total, reference, atol=1e-4, rtol=1e-4):
            continue
        rank = 0 if rank is None else rank
        if n > 1 and _same(got, _naive_chunk_partials(x, w13, w2, n)):
            hint = ("gate_up is two matrices stacked (gate rows 0 .. I - 1, then up rows I .. 2I - 1): cutting it into "
                    "N blocks gives rank 0 only gate rows. Rank r needs its block of the gate rows AND the same block "
                    "of the up rows")
        elif n > 1 and all(torch.allclose(g, reference, atol=1e-4, rtol=1e-4) for g in got):
            hint = ("every rank returned the whole MLP output: the all-reduce then sums N copies. Return each rank's "
                    "partial, before the sum")
        elif _same(got, reference_mlp_partials(x, torch.cat(w13.chunk(2)[::-1]), w2, n)):
            hint = "the gate rows come first in w_gate_up, then the up rows: silu(gate) * up, not silu(up) * gate"
        else:
            hint = ("rank r: h = silu(x @ gate[block r].T) * (x @ up[block r].T) (no communication needed), then its "
                    "partial h @ w_down[:, block r].T")
        raise CheckFailed(f"{call} ({what}): rank {rank}'s partial differs from the reference by "
                          f"{float((got[rank] - want[rank]).abs().max()):.3g} (the sum differs from the unsharded MLP "
                          f"by {float((total - reference).abs().max()):.3g}): {hint}")
    passed("parallel_mlp", len(cases))


def print_model_mlp(result: dict) -> None:
    """Section 4: the learner's parallel_mlp on a real decoder layer's weights, against that layer's MLP."""
    print(f"{result['model']}, layer {result['layer']}: MLP hidden {result['hidden']}, intermediate "
          f"{result['intermediate']}, {result['tokens']} hidden states")
    for n, diff in result["diffs"].items():
        mark = "✓" if diff < 1e-4 else "✗"
        print(f"  N = {n}: {mark} sum of your {n} partials vs the layer's own MLP: largest relative difference "
              f"{diff:.2g}; each rank holds {result['shard_mib'][n]:.2f} MiB of this MLP's weights")


def check_model_mlp(result: dict | None) -> None:
    if result is None:
        raise CheckFailed("model_mlp is None: run the cell above (it needs parallel_mlp)")
    for n, diff in result["diffs"].items():
        if not diff < 1e-4:
            raise CheckFailed(f"your parallel_mlp on layer {result['layer']} of {result['model']} with N = {n}: the sum "
                              f"of the partials differs from the layer's MLP by {diff:.3g} (relative): run exercise 3's "
                              "checks")
    passed("your split on the model's own MLP", len(result["diffs"]))


# =================================================================== 5. the all-reduce per step
def print_tp_runs(result: dict, device: str) -> None:
    """Section 5: each N's greedy tokens against N = 1's, and its mean decode step with its collectives."""
    sizes = list(result["tokens"])
    base = result["tokens"][sizes[0]]
    print(f"{result['model']}: {len(base)} prompts x {len(base[0])} greedy tokens, {result['num_layers']} layers ({device})")
    for n in sizes[1:]:
        same = sum(a == b for a, b in zip(result["tokens"][n], base))
        print(f"  tensor_parallel_size={n}: {same} of {len(base)} prompts give N = {sizes[0]}'s tokens"
              + (" ✓" if same == len(base) else " ✗"))
    print(f"{'N':>3} {'decode step':>12} {'all-reduces':>12} {'their time':>11} {'bytes':>10} {'logits all-gather':>18}")
    for r in result["rows"]:
        print(f"{r['tensor_parallel_size']:>3} {r['step_s'] * 1e3:>10.1f}ms {r['num_allreduces']:>12.1f} "
              f"{r['allreduce_s'] * 1e3:>9.2f}ms {r['allreduce_bytes'] / 1e3:>8.1f}kB {r['allgather_s'] * 1e3:>16.2f}ms")


def check_tp_runs(result: dict | None) -> None:
    if result is None:
        raise CheckFailed("tp is None: run the tensor-parallel cell above")
    sizes = list(result["tokens"])
    for n in sizes[1:]:
        for i, (mine, want) in enumerate(zip(result["tokens"][n], result["tokens"][sizes[0]])):
            if mine != want:
                j = next((t for t, (p, q) in enumerate(zip(mine, want)) if p != q), min(len(mine), len(want)))
                raise CheckFailed(f"tensor_parallel_size={n}: prompt {i} parts from N = {sizes[0]}'s greedy tokens at "
                                  f"output token {j}")
    passed("tensor-parallel tokens", len(sizes) - 1)


# =================================================================== 5. your cut, in the engine (sharding=)
def _fake_all_reduce(others: torch.Tensor, calls: list):
    """rank r's all_reduce as the check plays it: the other ranks' partials (computed here) added to t."""
    def all_reduce(t):
        calls.append(tuple(t.shape))
        return t + others
    return all_reduce


def _sharding_cases(seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    cases = [(random_weight(4, 6, seed + 1), 2, "weight [4, 6], N = 2"), (random_weight(6, 9, seed + 2), 3,
                                                                          "weight [6, 9], N = 3")]
    for i in range(4):
        n = int(torch.randint(2, 5, (1,), generator=gen))
        out_f, in_f = n * int(torch.randint(1, 9, (1,), generator=gen)), n * int(torch.randint(1, 9, (1,), generator=gen))
        cases.append((random_weight(out_f, in_f, seed * 10 + i), n, f"random weight [{out_f}, {in_f}], N = {n}"))
    return cases


def check_sharding(part, seed: int = 0) -> None:
    """A TensorSharding (minillm/seams.py) against the engine's cut: column(weight, r, N) is rank r's block of rows,
    row(weight, r, N) its block of columns, and row_matmul(x_r, W_r, all_reduce) the whole layer's output through
    one all-reduce of rank r's partial product (the other ranks' partials played by the check)."""
    from ..seams import PartError, TensorSharding, check_part

    try:
        check_part(part, TensorSharding, "sharding")
    except PartError as exc:
        raise CheckFailed(str(exc)) from None
    count = 0
    for weight, n, what in _sharding_cases(seed):
        out_f, in_f = weight.shape
        for r in range(n):
            for how, want, strided, other in (
                    ("column", weight[blocks(out_f, n)[r]], weight[r::n], weight[:, blocks(in_f, n)[r]]),
                    ("row", weight[:, blocks(in_f, n)[r]], weight[:, r::n], weight[blocks(out_f, n)[r]])):
                before = weight.clone()
                call = f"sharding.{how}(weight [{out_f}, {in_f}], rank={r}, world_size={n}) ({what})"
                got = call_learner(getattr(part, how), (weight, r, n), call)
                if not torch.equal(weight, before):
                    raise CheckFailed(f"{call} changed the weight in place")
                if not isinstance(got, torch.Tensor):
                    raise CheckFailed(f"{call} returned {type(got).__name__}; expected a tensor of shape "
                                      f"{list(want.shape)}")
                if tuple(got.shape) != tuple(want.shape):
                    dim = 0 if how == "column" else 1
                    hint = (f": that is the other split's shape. {how}() cuts dim {dim} of weight [out, in] "
                            f"({'the output rows' if dim == 0 else 'the input columns'})"
                            if tuple(got.shape) == tuple(other.shape) else
                            f": [{out_f // n if how == 'column' else out_f}, {in_f if how == 'column' else in_f // n}]")
                    raise CheckFailed(f"{call} has shape {list(got.shape)}, expected {list(want.shape)}{hint}")
                if torch.equal(got, want):
                    count += 1
                    continue
                rank_of = next((k for k in range(n) if torch.equal(
                    got, weight[blocks(out_f, n)[k]] if how == "column" else weight[:, blocks(in_f, n)[k]])), None)
                if n > 1 and torch.equal(got, strided):
                    hint = "every N-th index is not a block: rank r holds the contiguous block r * d / N .. (r + 1) * d / N - 1"
                elif rank_of is not None:
                    hint = (f"that is rank {rank_of}'s block: rank r holds block r (rank 0 the first), so every rank "
                            "holds a different block and together they cover the matrix once")
                else:
                    hint = f"rank r's block of weight's dim {0 if how == 'column' else 1}, unchanged"
                raise CheckFailed(f"{call} is not rank {r}'s block: {hint}")
        x = random_tokens(3, in_f, seed + n)
        full = x @ weight.t()
        for r in range(n):
            cols = blocks(in_f, n)[r]
            others = full - x[:, cols] @ weight[:, cols].t()
            calls: list = []
            call = (f"sharding.row_matmul(x [3, {in_f // n}], weight [{out_f}, {in_f // n}], all_reduce) as rank {r} "
                    f"of {n} ({what})")
            got = call_learner(part.row_matmul, (x[:, cols].clone(), weight[:, cols].clone(),
                                                 _fake_all_reduce(others, calls)), call)
            if not calls:
                raise CheckFailed(f"{call} never called all_reduce: rank {r}'s product is a partial sum over its "
                                  f"{in_f // n} input features; all_reduce(partial) adds the other ranks' partials")
            if len(calls) > 1:
                raise CheckFailed(f"{call} called all_reduce {len(calls)} times; once, on this rank's partial product")
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (3, out_f):
                raise CheckFailed(f"{call} returned {getattr(got, 'shape', type(got).__name__)}; expected [3, {out_f}]")
            if not torch.allclose(got.float(), full, atol=ATOL, rtol=1e-4):
                if calls[0] != (3, out_f):
                    hint = f"all_reduce got a tensor of shape {list(calls[0])}: give it the partial product [T, out]"
                elif torch.allclose(got.float(), x[:, cols] @ weight[:, cols].t(), atol=ATOL, rtol=1e-4):
                    hint = "that is this rank's partial alone: return what all_reduce returns (the sum over the ranks)"
                else:
                    hint = "all_reduce(x @ weight.T): this rank's partial product, summed over the ranks"
                raise CheckFailed(f"{call}: the output differs from the whole layer's x @ W^T by "
                                  f"{float((got.float() - full).abs().max()):.3g}: {hint}")
            count += 1
    passed("your sharding", count)


def check_tp_tokens(result: dict | None) -> None:
    """Your sharding part gave N = 1's greedy tokens: with N ranks simulated in this process (always), and in the
    tensor-parallel engine's worker processes where the part could travel there (result["sharding"] names it)."""
    if result is None:
        raise CheckFailed("tp is None: run the tensor-parallel cell above")
    if not result.get("simulated"):
        raise CheckFailed("the tensor-parallel cell ran without your sharding part: run it again after exercise 4")
    sizes = list(result["tokens"])
    base = result["tokens"][sizes[0]]
    for n, tokens in result["simulated"].items():
        for i, (mine, want) in enumerate(zip(tokens, base)):
            if mine != want:
                j = next((t for t, (p, q) in enumerate(zip(mine, want)) if p != q), min(len(mine), len(want)))
                raise CheckFailed(f"your sharding with {n} ranks (simulated in this process): prompt {i} parts from "
                                  f"N = {sizes[0]}'s greedy tokens at output token {j}")
    check_tp_runs(result)
    if result.get("sharding") is None:
        print("  (the worker processes ran the engine's own cut: your part could not be sent to them here; the "
              "simulated ranks ran yours)")


# =================================================================== 5. the measurement: time per step against N
# The course's reference run, on the machine the course was written on (shared with other jobs while it ran): the
# solution's tp_step_time in full mode's setting (SmolLM2-135M fp32, N = 1 and 3 on gloo, the notebook's 3 prompts of
# seed 0, 2 warm-up and 8 timed decode steps per engine, lab11.DecodeSteps), the solution cells' code run as a script:
#   engines = {n: LLM(None, tensor_parallel_size=n, device="cpu") for n in (1, 3)}
#   tp_step_time({n: lab11.DecodeSteps(e, prompts, 10) for n, e in engines.items()}, warmup=2, repeats=8)
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
REFERENCE_TP_SIZES = (1, 3)
REFERENCE_STEP_S = {1: 0.394, 3: 1.049}   # median seconds per decode step (3 sequences); min 0.226 / 0.267 s
REFERENCE_SPEEDUP = 0.375                 # N = 1's median / N = 3's: splitting made the step 2.7x slower here


class DecodeSteps:
    """`num_prompts` sequences in `llm`'s engine, prefilled (not timed): each call runs ONE engine step, a decode
    step of the whole batch, for at most `num_steps` calls."""

    def __init__(self, llm, prompts: Sequence[dict], num_steps: int):
        from .. import SamplingParams

        if num_steps < 1:
            raise ValueError(f"DecodeSteps(num_steps={num_steps!r}): at least 1 decode step")
        engine = llm.engine
        if engine.has_unfinished():
            raise RuntimeError("DecodeSteps: the engine is already running requests; let them finish first")
        params = SamplingParams(max_tokens=num_steps + 1, temperature=0, ignore_eos=True)
        self.engine, self.num_steps, self.calls = engine, num_steps, 0
        self.seqs = [engine.add_request(list(p["prompt_token_ids"]), params) for p in prompts]
        while any(s.first_token_s is None and not s.is_finished for s in self.seqs):   # the prefills
            engine.step()

    def __call__(self) -> None:
        if self.calls >= self.num_steps:
            raise RuntimeError(f"DecodeSteps: all {self.num_steps} decode steps are spent; make a new one "
                               "(num_steps = warmup + repeats)")
        self.calls += 1
        self.engine.step()

    def finish(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()


class FakeStep:
    """A stand-in for DecodeSteps in the check: each call moves `clock` by the next scripted cost; nothing runs."""

    def __init__(self, clock, costs: Sequence[float], label: str):
        self.clock, self.costs, self.label = clock, list(costs), label
        self.calls = 0

    def __call__(self) -> None:
        self.clock.advance(self.costs[min(self.calls, len(self.costs) - 1)])
        self.calls += 1

    def __repr__(self) -> str:
        return f"<fake decode step, {self.label}>"


def reference_step_timing(costs: Sequence[float], warmup: int) -> dict:
    from .common import timing_summary

    summary = timing_summary(list(costs)[warmup:])
    return {"median": summary["median"], "min": summary["min"], "max": summary["max"]}


TP_TIMING_CASES = (  # (the case in words, warmup, repeats, seed, {N: base seconds})
    ("N = 1 and 2, 2 warm-up and 5 timed steps, one slow outlier each", 2, 5, 1, {1: 0.02, 2: 0.03}),
    ("N = 4, 1 and 2 (neither N = 1 nor the largest N last), 1 warm-up and 4 timed steps (the median averages the "
     "middle two)", 1, 4, 2, {4: 0.008, 1: 0.02, 2: 0.012}),
    ("N = 1 and 3, no warm-up, 3 timed steps", 0, 3, 3, {1: 0.05, 3: 0.04}),
)


def check_tp_step_time(fn: Callable, cases=TP_TIMING_CASES) -> None:
    """tp_step_time(steps, clock, warmup, repeats) on fake decode steps (one per N) that move a FakeClock by known
    costs (warm-up steps 20x slower, one timed step 4x): each called warmup + repeats times, the warm-up dropped,
    each N's median, min and max those of its timed steps, and speedup = N = 1's median / the largest N's."""
    from .common import FakeClock, is_close, scripted_costs, timing_mistake

    for name, warmup, repeats, seed, bases in cases:
        clock = FakeClock()
        costs = {n: scripted_costs(base, warmup, repeats, seed + n) for n, base in bases.items()}
        steps = {n: FakeStep(clock, costs[n], f"N = {n}") for n in bases}
        call = f"tp_step_time(<fake steps for N in {list(bases)}>, clock=FakeClock(), warmup={warmup}, " \
               f"repeats={repeats}). Case: {name}"
        got = call_learner(fn, (steps, clock, warmup, repeats), call)
        if clock.reads == 0:
            raise CheckFailed(f"{call}: your code never read `clock`: time with the clock you are given "
                              "(start = clock() ... clock() - start), not time.perf_counter, so the check can script "
                              "what each step costs")
        for n, step in steps.items():
            if step.calls != warmup + repeats:
                raise CheckFailed(f"{call}: steps[{n}] was called {step.calls} times; expected warmup + repeats = "
                                  f"{warmup + repeats} (warm up, then time `repeats` calls)")
        if not isinstance(got, dict) or not {"times", "speedup"} <= set(got) or not isinstance(got["times"], dict):
            raise CheckFailed(f"{call} returned {got!r}; return {{'times': {{N: {{'median', 'min', 'max'}}}}, "
                              "'speedup': ...}")
        if set(got["times"]) != set(bases):
            raise CheckFailed(f"{call}: ['times'] has the keys {sorted(got['times'])}; expected one per N: "
                              f"{sorted(bases)}")
        for n in bases:
            want = reference_step_timing(costs[n], warmup)
            summary = got["times"][n]
            if not isinstance(summary, dict) or not {"median", "min", "max"} <= set(summary):
                raise CheckFailed(f"{call}: ['times'][{n}] = {summary!r}; expected a dict with 'median', 'min', 'max'")
            for key in ("median", "min", "max"):
                value = summary[key]
                if is_close(value, want[key], rel=1e-6):
                    continue
                why = timing_mistake(value, costs[n], warmup) if key == "median" else ""
                if key != "median" and is_close(value, (min if key == "min" else max)(costs[n]), rel=1e-6):
                    why = "the spread kept a warm-up step: take min and max of the timed steps only"
                if not why and isinstance(value, (int, float)) and is_close(value, 0.0, abs_tol=1e-3):
                    why = "a real time, not the clock's: read `clock()`, not time.perf_counter()"
                shown = f"{float(value):.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
                raise CheckFailed(f"{call}: ['times'][{n}][{key!r}] = {shown}, expected {want[key]:.6g} s"
                                  + (f": that is {why}" if why else ""))
        top = max(bases)
        want_speedup = reference_step_timing(costs[1], warmup)["median"] / reference_step_timing(costs[top], warmup)["median"]
        if not is_close(got["speedup"], want_speedup, rel=1e-6):
            hint = (f"it is upside down: N = 1's median over N = {top}'s (above 1 when splitting made the step faster)"
                    if is_close(got["speedup"], 1 / want_speedup, rel=1e-6) else
                    f"N = 1's median over the largest N's ({top}), whatever the order of `steps`")
            raise CheckFailed(f"{call}: speedup = {got['speedup']!r}, expected {want_speedup:.6g}: {hint}")
    passed("tp_step_time", len(cases))


def print_tp_timing(timing: dict, device: str) -> None:
    from .common import format_seconds, print_beside_reference

    for n, t in sorted(timing["times"].items()):
        print(f"tensor_parallel_size={n}: {format_seconds(t['median'])} per decode step (min "
              f"{format_seconds(t['min'])}, max {format_seconds(t['max'])})")
    top = max(timing["times"])
    print_beside_reference(f"decode step speed-up, N = 1 over N = {top} (reference: N = {REFERENCE_TP_SIZES[-1]})",
                           timing["speedup"], REFERENCE_SPEEDUP, REFERENCE_HARDWARE, unit="x", device=device)


def tp_timing_figure(timing: dict, device: str):
    """Median ms per decode step against N, the min-max spread as error bars."""
    ns = sorted(timing["times"])
    med = [timing["times"][n]["median"] * 1e3 for n in ns]
    fig = new_figure(f"A decode step against tensor_parallel_size: speed-up {timing['speedup']:.2f}x at N = {ns[-1]}",
                     "tensor_parallel_size N", "ms per decode step (median; bars: min to max)", device)
    fig.add_bar(x=[str(n) for n in ns], y=med,
                error_y=dict(type="data", symmetric=False,
                             array=[timing["times"][n]["max"] * 1e3 - m for n, m in zip(ns, med)],
                             arrayminus=[m - timing["times"][n]["min"] * 1e3 for n, m in zip(ns, med)]),
                text=[f"{m:.1f} ms" for m in med], textposition="outside", name="median")
    return fig


def reference_allreduce_costs(rows: Sequence[dict]) -> list[dict]:
    base = next((r for r in rows if r["tensor_parallel_size"] == 1), None)
    out = []
    for r in rows:
        out.append({"tensor_parallel_size": r["tensor_parallel_size"],
                    "allreduce_share": r["allreduce_s"] / r["step_s"],
                    "allreduce_mb_per_step": r["allreduce_bytes"] / 1e6,
                    "us_per_allreduce": (1e6 * r["allreduce_s"] / r["num_allreduces"]) if r["num_allreduces"] else 0.0,
                    "speedup": base["step_s"] / r["step_s"] if base else float("nan")})
    return out


def check_allreduce_costs(fn: Callable, rows: Sequence[dict] | None) -> None:
    """allreduce_costs against the reference on the measured rows and on a stub of two rows."""
    if not rows:
        raise CheckFailed("tp_rows is empty: run the measurement cell above first")
    stub = [{"tensor_parallel_size": 2, "step_s": 0.025, "allreduce_s": 0.01, "allreduce_bytes": 4_000_000,
             "num_allreduces": 50},
            {"tensor_parallel_size": 1, "step_s": 0.02, "allreduce_s": 0.0, "allreduce_bytes": 0, "num_allreduces": 0}]
    hints = {"tensor_parallel_size": "the row's tensor_parallel_size, unchanged",
             "allreduce_share": "allreduce_s / step_s: the share of a step spent in all-reduces",
             "allreduce_mb_per_step": "allreduce_bytes / 1e6 (megabytes, 10^6 bytes)",
             "us_per_allreduce": "1e6 * allreduce_s / num_allreduces (0.0 when a step has none, N = 1)",
             "speedup": "the N = 1 row's step_s / this row's step_s (above 1: splitting paid); find the row whose "
                        "tensor_parallel_size is 1, whatever its place"}
    for case_rows, what in ((list(rows), "your measured rows"),
                            (stub, "two rows, N = 2 first: N = 2 at 25 ms a step, 10 ms of it in 50 all-reduces; "
                                   "N = 1 at 20 ms")):
        call = f"allreduce_costs({what})"
        got = call_learner(fn, (case_rows,), call)
        want = reference_allreduce_costs(case_rows)
        if not isinstance(got, list) or len(got) != len(want):
            raise CheckFailed(f"{call} returned {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'} "
                              f"items; expected a list of {len(want)} dicts, one per row in the rows' order")
        for i, (g, w) in enumerate(zip(got, want)):
            if not isinstance(g, dict) or set(g) != set(w):
                raise CheckFailed(f"{call}[{i}] is {g!r}; expected a dict with the keys {sorted(w)}")
            for key, value in w.items():
                if isinstance(g[key], bool) or not isinstance(g[key], (int, float)) or not math.isclose(
                        g[key], value, rel_tol=1e-6, abs_tol=1e-12):
                    raise CheckFailed(f"{call}[{i}][{key!r}] = {g[key]!r}, expected {value:.6g}: {hints[key]}")
    passed("allreduce_costs", 2)


def print_allreduce_costs(costs: Sequence[dict], device: str) -> None:
    print(f"{'N':>3} {'step share in all-reduce':>25} {'MB all-reduced / step':>22} {'µs / all-reduce':>16} "
          f"{'speed-up vs N = 1':>18}   ({device})")
    for c in costs:
        print(f"{c['tensor_parallel_size']:>3} {c['allreduce_share']:>25.0%} {c['allreduce_mb_per_step']:>22.3f} "
              f"{c['us_per_allreduce']:>16.0f} {c['speedup']:>17.2f}x")


def tp_figure(rows: Sequence[dict], device: str):
    """Per N: a decode step's time split into the all-reduces and the rest (compute, weights read)."""
    fig = new_figure("A decode step split across N ranks: compute vs all-reduce", "tensor_parallel_size N",
                     "ms per decode step", device)
    n = [str(r["tensor_parallel_size"]) for r in rows]
    fig.add_bar(x=n, y=[1e3 * (r["step_s"] - r["allreduce_s"]) for r in rows], name="compute (and the rest)")
    fig.add_bar(x=n, y=[1e3 * r["allreduce_s"] for r in rows], name="all-reduce")
    fig.update_layout(barmode="stack")
    return fig


# =================================================================== 6. when splitting pays
def tp_step_ms(weight_bytes: float, hbm_bytes_s: float, num_layers: int, allreduce_s: float, n: int) -> float:
    """A memory-bound decode step on N devices: each reads 1 / N of the weights; 2 all-reduces per layer when N > 1."""
    return 1e3 * (weight_bytes / (n * hbm_bytes_s) + (2 * num_layers * allreduce_s if n > 1 else 0.0))


# Section 6's numbers: Llama-3-70B in bf16 on H100 SXMs, batch 1, NVLink all-reduces of a few kB.
PAYS_MODEL = {"params": 70.6e9, "bytes_per_param": 2, "hbm_bytes_s": 3.35e12, "num_layers": 80, "allreduce_s": 20e-6}


def answer_tp8_ms() -> float:
    m = PAYS_MODEL
    return tp_step_ms(m["params"] * m["bytes_per_param"], m["hbm_bytes_s"], m["num_layers"], m["allreduce_s"], 8)


def check_answer_tp8_step_ms(value) -> None:
    want = answer_tp8_ms()
    case = "answer_tp8_step_ms (Llama-3-70B, bf16, 8 x H100, batch 1)"
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"{case} is {value!r}; set it to a number of milliseconds (a float, e.g. 12.5)")
    if abs(value - want) <= 0.3:
        passed("answer_tp8_step_ms", 1)
        return
    m = PAYS_MODEL
    weights_ms = 1e3 * m["params"] * m["bytes_per_param"] / m["hbm_bytes_s"]
    comm_ms = 1e3 * 2 * m["num_layers"] * m["allreduce_s"]
    if abs(value - weights_ms / 8) < 0.3:
        hint = f"the all-reduces are missing: 2 per layer x 80 layers x 20 µs = {comm_ms:.1f} ms every step"
    elif abs(value - (weights_ms / 8 + comm_ms / 2)) < 0.3:
        hint = "two all-reduces per layer (after o_proj and after down_proj), not one"
    elif abs(value - (weights_ms / 8 + 8 * comm_ms)) < 0.5 or abs(value - (weights_ms / 8 + comm_ms / 8)) < 0.3:
        hint = "an all-reduce costs its 20 µs whatever N (latency-bound at batch 1): do not scale it with N"
    elif abs(value - weights_ms) < 0.5:
        hint = "that is one device reading everything: with N = 8 each device reads 1/8 of the weights in parallel"
    else:
        hint = "weight bytes / (8 x 3.35 TB/s) + 2 x 80 x 20 µs"
    raise CheckFailed(f"{case} = {value!r} ms is not it: {hint}")


def pays_rows(ns: Sequence[int] = (1, 2, 4, 8, 16, 32)) -> list[dict]:
    """Section 6's model over N: step time, its all-reduce part, and the speed-up over the smallest N."""
    m = PAYS_MODEL
    rows = []
    for n in ns:
        step = tp_step_ms(m["params"] * m["bytes_per_param"], m["hbm_bytes_s"], m["num_layers"], m["allreduce_s"], n)
        comm = 1e3 * 2 * m["num_layers"] * m["allreduce_s"] if n > 1 else 0.0
        rows.append({"n": n, "step_ms": step, "allreduce_ms": comm})
    return rows


def print_pays(rows: Sequence[dict]) -> None:
    print("Llama-3-70B bf16, batch 1, H100 SXM (3.35 TB/s each), 20 µs per all-reduce: a model, not a measurement")
    print(f"{'N':>3} {'ms / step':>10} {'of it all-reduce':>17} {'tok/s':>7} {'efficiency':>11}")
    first = rows[0]
    for r in rows:
        eff = first["step_ms"] * first["n"] / (r["step_ms"] * r["n"])
        print(f"{r['n']:>3} {r['step_ms']:>10.2f} {r['allreduce_ms']:>16.1f}  {1e3 / r['step_ms']:>7.0f} {eff:>10.0%}")


# =================================================================== 7. the autoscaler's policy
def reference_policy(state, target_ongoing: float = 2.0, upscale_window_s: float = 5.0,
                     downscale_window_s: float = 30.0, rounding: Callable = math.ceil, edge_inside: bool = False) -> int:
    """Exercise 7's rule: up to ceil(least load of the last upscale_window_s / target) when that is above the target
    replicas; down to ceil(largest load of the last downscale_window_s / target) when that is below; clamped.
    A sample exactly window_s old is outside the window (edge_inside=True: the usual mistake, t >= now - window)."""
    def over(window_s):
        inside = (lambda t: t >= state.now_s - window_s) if edge_inside else (lambda t: t > state.now_s - window_s)
        return [total for t, total, _ in state.history if inside(t)] or [state.total_ongoing_requests]

    want_up = rounding(min(over(upscale_window_s)) / target_ongoing)
    want_down = rounding(max(over(downscale_window_s)) / target_ongoing)
    desired = state.target_replicas
    if want_up > desired:
        desired = want_up
    elif want_down < desired:
        desired = want_down
    return min(max(desired, state.min_replicas), state.max_replicas)


def fleet_state(now_s: float, loads: Sequence[int], running: int, starting: int = 0, queue: int = 0,
                min_replicas: int = 1, max_replicas: int = 8, tick_s: float = 1.0):
    """A FleetState at now_s whose history holds one total-ongoing sample per tick (the last one is now's, and
    includes the router queue); the load now is spread over the running replicas."""
    from ..fleet.policies import FleetState

    history = tuple((now_s - tick_s * (len(loads) - 1 - i), int(total), running) for i, total in enumerate(loads))
    at_replicas = max(0, loads[-1] - queue)
    per = [at_replicas // running + (1 if i < at_replicas % running else 0) for i in range(running)] if running else []
    return FleetState(now_s=now_s, running_replicas=running, starting_replicas=starting,
                      ongoing_per_replica=tuple(per), queue_length=queue, target_replicas=running + starting,
                      min_replicas=min_replicas, max_replicas=max_replicas, history=history)


def _policy_cases() -> list[tuple]:
    """(state, kwargs, what): the stated cases of exercise 7 (1 s ticks, 40 s of history)."""
    flat = [4] * 40
    return [
        (fleet_state(100.0, flat, running=2), {}, "a steady load of 4 on 2 replicas: keep 2"),
        (fleet_state(100.0, [4] * 34 + [10] * 6, running=2), {},
         "the load at 10 for the last 6 s (the up window is 5 s): go up to ceil(10 / 2) = 5"),
        (fleet_state(100.0, [4] * 37 + [10] * 3, running=2), {},
         "the load at 10 for only 3 s: not yet (the least load of the last 5 s is 4)"),
        (fleet_state(100.0, [4] * 35 + [10] * 5, running=2), {},
         "the load at 10 at t = 96 .. 100 and 4 at t = 95: the window of 5 s holds t > 95 only, up to 5"),
        (fleet_state(100.0, [4] * 30 + [10, 9, 8, 12, 10, 10, 7, 9, 11, 10], running=2), {},
         "a noisy high load (7 to 12) for 10 s: up to the LEAST load of the up window, ceil(7 / 2) = 4"),
        (fleet_state(100.0, [1] * 40, running=4), {}, "the load at 1 for 40 s on 4 replicas: down to 1"),
        (fleet_state(100.0, [1] * 15 + [5] + [1] * 24, running=4), {},
         "the load at 1 but for one tick of 5 within the last 30 s: down only to ceil(5 / 2) = 3"),
        (fleet_state(100.0, [4] * 30 + [12] + [4] * 9, running=1, starting=3), {},
         "a burst of 12 9 s ago, 4 now, 1 replica running and 3 starting: between the windows' asks (2 and 6), keep "
         "the 4 the fleet already has (target_replicas)"),
        (fleet_state(100.0, [30] * 40, running=2), {}, "a load of 30: ceil(30 / 2) = 15, clamped to max_replicas 8"),
        (fleet_state(100.0, [0] * 40, running=2, min_replicas=1), {}, "no load: down to min_replicas 1, never below"),
        (fleet_state(100.0, [0] * 40, running=1, min_replicas=0), {}, "no load and min_replicas 0: scale to zero"),
        (fleet_state(100.0, [12] * 40, running=2, queue=8), {},
         "12 requests of which 8 wait at the router (both replicas full): they count, up to 6"),
        (fleet_state(100.0, [9] * 40, running=2), {"target_ongoing": 3.0}, "target_ongoing 3, a load of 9: 3 replicas"),
        (fleet_state(100.0, [4] * 37 + [10] * 3, running=2), {"upscale_window_s": 2.0},
         "upscale_window_s 2: the 3 s at 10 are enough, up to 5"),
        (fleet_state(100.0, [1] * 30 + [5] + [1] * 9, running=4), {"downscale_window_s": 8.0},
         "downscale_window_s 8: the 5 is 9 s ago, outside the window, down to 1"),
    ]


def _policy_hint(state, kwargs, got: int) -> str:
    def ref(s=state, **over):
        return reference_policy(s, **{**kwargs, **over})

    target = kwargs.get("target_ongoing", 2.0)
    if not state.min_replicas <= got <= state.max_replicas:
        return f"clamp the answer to [state.min_replicas, state.max_replicas] = [{state.min_replicas}, {state.max_replicas}]"
    if state.starting_replicas and got == ref(state._replace(target_replicas=state.running_replicas)):
        return ("compare with state.target_replicas (running + starting), not running_replicas: replicas already "
                "starting will serve soon; asking for fewer cancels them, asking again would double them")
    if state.queue_length and got == min(max(math.ceil(sum(state.ongoing_per_replica) / target), state.min_replicas),
                                         state.max_replicas):
        return "the requests queued at the router count too: the history's totals (state.total_ongoing_requests) hold them"
    if got == ref(upscale_window_s=1e-9, downscale_window_s=1e-9):
        return ("that is ceil(load now / target): with no windows the fleet follows every burst. Go up only to what "
                "the whole up window asks for (its least load), down only to what the whole down window allows (its "
                "largest load)")
    if got == ref(edge_inside=True):
        return ("a sample exactly window_s old is outside the window: keep the samples with t > now_s - window_s "
                "(a 5 s window of 1 s ticks holds 5 samples, not 6)")
    if got in (ref(rounding=math.floor), ref(rounding=round)):
        return "ceil, not floor or round: 5 requests at 2 per replica need 3 replicas"
    return ("desired = target_replicas; up to ceil(min(up-window loads) / target) if that is more, else down to "
            "ceil(max(down-window loads) / target) if that is less; clamp to [min_replicas, max_replicas]")


def check_autoscaler(fn: Callable) -> None:
    """autoscaler_policy against the rule of exercise 7 on the stated states."""
    cases = _policy_cases()
    for state, kwargs, what in cases:
        extra = "".join(f", {k}={v}" for k, v in kwargs.items())
        call = f"autoscaler_policy(state{extra})"
        got = call_learner(lambda: fn(state, **kwargs), (), call)
        want = reference_policy(state, **kwargs)
        if isinstance(got, bool) or not isinstance(got, int):
            raise CheckFailed(f"{call} ({what}) returned {got!r} ({type(got).__name__}); expected an int number of "
                              "replicas (math.ceil gives one)")
        if got != want:
            raise CheckFailed(f"{call} ({what}): returned {got}, expected {want}: {_policy_hint(state, kwargs, got)}")
    passed("autoscaler_policy", len(cases))


# =================================================================== 8. the simulated day
# One CPU replica of the default model (SmolLM2-135M, fp32, one thread, continuous batching), measured on the 2-core
# CPU of the course's CI (AMD EPYC): decode step seconds by batch size, prefill step seconds by prompt tokens.
EXAMPLE_PROFILE = {"decode_points": [(1, 0.0333), (4, 0.0415), (8, 0.0858), (16, 0.126), (32, 0.199)],
                   "prefill_points": [(32, 0.149), (128, 0.386), (512, 1.567)],
                   "conditions": {"measured_on": "cpu: AMD EPYC (2 threads), one thread per replica",
                                  "model": "SmolLM2-135M-Instruct, fp32"}}


def example_profile(startup_s: float = 5.0):
    """EXAMPLE_PROFILE as the simulator's ReplicaProfile, with this start-up time."""
    from ..fleet.replica_profile import ReplicaProfile

    return ReplicaProfile(decode_points=list(EXAMPLE_PROFILE["decode_points"]),
                          prefill_points=list(EXAMPLE_PROFILE["prefill_points"]), startup_s=startup_s,
                          conditions=dict(EXAMPLE_PROFILE["conditions"]))


LONGEST_PROMPT = 96   # the day's prompts are 16-96 tokens


def slower_than_example(profile) -> float:
    """How many times slower this replica serves the day's requests than the example profile's (at least 1): the
    larger of its prefill of the longest prompt and its decode time per token at batch 16, each over the example's."""
    example = example_profile()
    prefill = profile.prefill_s(LONGEST_PROMPT) / example.prefill_s(LONGEST_PROMPT)
    decode = example.tokens_per_s(16) / profile.tokens_per_s(16)
    return max(1.0, prefill, decode)


def spike_target_s(profile) -> float:
    """The spike's p99 TTFT target: 1 s, or 3x this replica's own prefill of the longest prompt where that is more
    (no fleet gets a request's first token sooner than its replica can prefill it)."""
    return max(1.0, round(3 * profile.prefill_s(LONGEST_PROMPT), 1))


def print_profile(profile, label: str) -> None:
    print(f"replica profile ({label}):")
    print("  decode step: " + ", ".join(f"batch {b}: {s * 1e3:.0f} ms ({b / s:.0f} tok/s)" for b, s in profile.decode_points))
    print("  prefill step: " + ", ".join(f"{n} tokens: {s * 1e3:.0f} ms" for n, s in profile.prefill_points))


def _interval_p99(result, step_s: float) -> list[float]:
    from ..serve.client import percentile

    return [percentile(result.ttfts(s["t_s"] - step_s, s["t_s"]), 99) for s in result.timeline]


def day_figure(results: dict, start_hour: float, title: str):
    """Per named SimResult: requests waiting, replicas (serving + starting) and TTFT p99 per sample interval."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("requests waiting (router + engines)", "replicas (serving + starting)",
                                        "TTFT p99 per interval (s)"))
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, (name, result) in enumerate(results.items()):
        hours = [start_hour + s["t_s"] / result.hour_s for s in result.timeline]
        step = (result.timeline[1]["t_s"] - result.timeline[0]["t_s"]) if len(result.timeline) > 1 else result.hour_s
        style = dict(color=colors[i % len(colors)])
        fig.add_scatter(x=hours, y=[s["queue"] + s["waiting"] for s in result.timeline], name=name, line=style,
                        legendgroup=name, row=1, col=1)
        fig.add_scatter(x=hours, y=[s["replicas"] + s["starting"] for s in result.timeline], name=name,
                        line=dict(shape="hv", **style), legendgroup=name, showlegend=False, row=2, col=1)
        fig.add_scatter(x=hours, y=_interval_p99(result, step), name=name, line=style, legendgroup=name,
                        showlegend=False, row=3, col=1)
    fig.update_layout(title=dict(text=title, subtitle=dict(text="simulated (minillm/fleet/simulate.py)")),
                      height=720, template="plotly_white", margin=dict(t=100, l=70, r=30, b=60))
    fig.update_yaxes(type="log", row=3, col=1)
    fig.update_xaxes(title_text="hour of the day", row=3, col=1)
    return fig


def day_summary(result, spike_s: tuple[float, float]) -> dict:
    """The numbers the lab prints per simulated run: TTFT p50 / p99 (whole run and spike), the longest queue, the
    most replicas, replica-hours, $ per million output tokens."""
    return {"ttft_p50_s": result.ttft_percentile(50), "ttft_p99_s": result.ttft_percentile(99),
            "spike_ttft_p99_s": result.ttft_percentile(99, *spike_s),
            "queue_max": max(s["queue"] + s["waiting"] for s in result.timeline),
            "replicas_max": max(s["replicas"] + s["starting"] for s in result.timeline),
            "replica_hours": result.replica_seconds() / 3600, "usd_per_mtok": result.usd_per_mtok,
            "requests": len(result.requests)}


def print_day(results: dict, spike_s: tuple[float, float], hourly_usd: float) -> None:
    print(f"{'run':<28} {'requests':>8} {'TTFT p50':>9} {'p99':>7} {'spike p99':>10} {'max queue':>10} "
          f"{'max repl.':>9} {'repl.-hours':>11} {'$/Mtok':>7}   (a replica at {hourly_usd:.2f} $/h)")
    for name, result in results.items():
        d = day_summary(result, spike_s)
        print(f"{name:<28} {d['requests']:>8} {d['ttft_p50_s']:>8.2f}s {d['ttft_p99_s']:>6.2f}s "
              f"{d['spike_ttft_p99_s']:>9.2f}s {d['queue_max']:>10} {d['replicas_max']:>9} {d['replica_hours']:>11.1f} "
              f"{d['usd_per_mtok']:>7.3f}")


# =================================================================== 9. warm replicas and batch size
CHOICE_KEYS = ("warm_replicas", "max_num_seqs", "spike_ttft_p99_s", "usd_per_mtok")


def reference_choice(rows: Sequence[dict], target_p99_s: float) -> dict | None:
    meeting = [r for r in rows if r["spike_ttft_p99_s"] <= target_p99_s]
    return min(meeting, key=lambda r: r["usd_per_mtok"]) if meeting else None


def _stub_run(table: dict) -> Callable:
    def run(warm_replicas, max_num_seqs):
        p99, usd = table[(warm_replicas, max_num_seqs)]
        return {"spike_ttft_p99_s": p99, "usd_per_mtok": usd}
    return run


STUB_TABLE = {(1, 4): (3.0, 0.50), (1, 8): (2.5, 0.40), (2, 4): (1.1, 0.80), (2, 8): (1.5, 0.60),
              (3, 4): (0.5, 1.20), (3, 8): (0.8, 0.90)}


def check_choose_fleet(fn: Callable, run: Callable | None, target_p99_s: float, warm_options, batch_options,
                       rows: Sequence[dict] | None = None) -> None:
    """choose_fleet on a stub table (the rule: cheapest among those meeting the target, None when none does), then
    its measured rows: one per option pair with run's own numbers, and the choice the rule gives on them."""
    cases = [(_stub_run(STUB_TABLE), 1.0, (1, 2, 3), (4, 8), {"warm_replicas": 3, "max_num_seqs": 8},
              "a table of 6 runs, target 1.0 s: (3 warm, batch 8) at 0.90 $/Mtok, not the cheaper ones that miss it"),
             (_stub_run(STUB_TABLE), 2.0, (1, 2, 3), (4, 8), {"warm_replicas": 2, "max_num_seqs": 8},
              "the same table, target 2.0 s: (2 warm, batch 8) at 0.60 $/Mtok"),
             (_stub_run(STUB_TABLE), 0.1, (1, 2, 3), (4, 8), None, "the same table, target 0.1 s: no run meets it, None")]
    for stub, target, warms, batches, want, what in cases:
        call = f"choose_fleet(run, {target}, {warms}, {batches})"
        got = call_learner(fn, (stub, target, warms, batches), call)
        if want is None:
            if got is not None:
                raise CheckFailed(f"{call} ({what}) returned {got!r}; expected None: no option meets the target")
            continue
        if not isinstance(got, dict) or not set(CHOICE_KEYS) <= set(got):
            raise CheckFailed(f"{call} ({what}) returned {got!r}; expected a dict with the keys {list(CHOICE_KEYS)} "
                              "and 'rows'")
        pairs = [(r.get("warm_replicas"), r.get("max_num_seqs")) for r in got.get("rows") or [] if isinstance(r, dict)]
        if pairs != [(w, b) for w in warms for b in batches]:
            raise CheckFailed(f"{call} ({what}): rows cover {pairs}; expected every pair of warm_options x batch_options "
                              f"in the loop's order (warm outer): {[(w, b) for w in warms for b in batches]}")
        chosen = (got["warm_replicas"], got["max_num_seqs"])
        if chosen != (want["warm_replicas"], want["max_num_seqs"]):
            p99, usd = STUB_TABLE.get(chosen, (None, None))
            if p99 is not None and p99 > target:
                hint = f"that run's spike p99 is {p99} s, above the target: keep only the runs that meet it"
            elif p99 is not None:
                hint = "the cheapest (lowest usd_per_mtok) among those that meet the target, not the fastest"
            else:
                hint = "the warm_replicas and max_num_seqs of the chosen run"
            raise CheckFailed(f"{call} ({what}): chose {chosen}, expected {(want['warm_replicas'], want['max_num_seqs'])}: {hint}")
    if run is None:
        raise CheckFailed("fleet_window is None: run the cells of section 9 first")
    if not rows:
        every = [{"warm_replicas": w, "max_num_seqs": b, **run(w, b)} for w in warm_options for b in batch_options]
        best = reference_choice(every, target_p99_s)
        if best is not None:
            raise CheckFailed(f"choice is None or has no rows, but ({best['warm_replicas']} warm, batch "
                              f"{best['max_num_seqs']}) keeps the spike p99 at {best['spike_ttft_p99_s']:.2f} s <= "
                              f"{target_p99_s} s: run the cell above (it needs choose_fleet)")
        passed("choose_fleet (no setting meets the target on this machine: None is right)", len(cases) + len(every))
        return
    pairs = {(r.get("warm_replicas"), r.get("max_num_seqs")) for r in rows}
    want_pairs = {(w, b) for w in warm_options for b in batch_options}
    if pairs != want_pairs:
        raise CheckFailed(f"choice['rows'] covers {sorted(pairs, key=str)}; expected every pair of warm_options x "
                          f"batch_options: {sorted(want_pairs)}")
    for r in rows:
        again = run(r["warm_replicas"], r["max_num_seqs"])
        for key in ("spike_ttft_p99_s", "usd_per_mtok"):
            if not math.isclose(r[key], again[key], rel_tol=1e-9):
                raise CheckFailed(f"choice['rows'] ({r['warm_replicas']} warm, batch {r['max_num_seqs']}): {key} "
                                  f"{r[key]!r}, but the simulation gives {again[key]!r}: copy run's numbers unchanged")
    passed("choose_fleet", len(cases) + len(rows))


def print_choice(choice: dict | None, target_p99_s: float, hourly_usd: float) -> None:
    if choice is None:
        print(f"no option keeps the spike's p99 TTFT under {target_p99_s} s on this machine (its measured profile): "
              "a faster replica, more warm replicas or a looser target would")
        return
    print(f"{'warm':>5} {'batch':>6} {'spike p99':>10} {'$/Mtok':>8}   (target p99 {target_p99_s} s; "
          f"a replica at {hourly_usd:.2f} $/h)")
    for r in choice["rows"]:
        mark = "  <- your choice" if (r["warm_replicas"], r["max_num_seqs"]) == (choice["warm_replicas"], choice["max_num_seqs"]) else (
            "" if r["spike_ttft_p99_s"] <= target_p99_s else "  (misses the target)")
        print(f"{r['warm_replicas']:>5} {r['max_num_seqs']:>6} {r['spike_ttft_p99_s']:>9.2f}s {r['usd_per_mtok']:>8.3f}{mark}")


# =================================================================== 11. the move to vLLM: your flag map
VLLM_DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"   # minillm's default model, as vLLM loads it from the hub
VLLM_MAPPED = ("max_num_seqs", "max_model_len", "block_size", "tensor_parallel_size", "prefix_caching",
               "chunked_prefill", "kv_dtype", "weight_dtype")
# levers of minillm with no vLLM meaning when set away from vLLM's behaviour: (field, the value vLLM always has)
VLLM_FIXED = (("kv_cache", True), ("paged", True), ("batching", "continuous"), ("speculative", None),
              ("enable_lora", False))
# minillm's own spellings that `vllm serve` does not know -> vLLM's
MINILLM_ONLY_FLAGS = {"--prefix-caching": "--enable-prefix-caching", "--no-prefix-caching": "--no-enable-prefix-caching",
                      "--chunked-prefill": "--enable-chunked-prefill",
                      "--no-chunked-prefill": "--no-enable-chunked-prefill", "--kv-dtype": "--kv-cache-dtype",
                      "--weight-dtype": "--quantization", "--model": "the model as the first argument"}


def reference_vllm_args(config) -> list[str]:
    """`vllm serve` arguments for an EngineConfig: the model first, then vLLM's spelling of each mapped lever."""
    for name, value in VLLM_FIXED:
        if getattr(config, name) != value:
            raise ValueError(f"{name}={getattr(config, name)!r} has no vLLM flag (vLLM always runs {name}={value!r})")
    if config.weight_dtype not in (None, "fp8"):
        raise ValueError(f"weight_dtype={config.weight_dtype!r} has no vLLM flag (--quantization fp8 only)")
    if config.kv_dtype not in (None, "fp8"):
        raise ValueError(f"kv_dtype={config.kv_dtype!r} has no vLLM flag (--kv-cache-dtype fp8 only)")
    args = [config.model or VLLM_DEFAULT_MODEL, "--max-num-seqs", str(config.max_num_seqs), "--block-size",
            str(config.block_size), "--tensor-parallel-size", str(config.tensor_parallel_size),
            "--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching",
            "--enable-chunked-prefill" if _lever(config, "chunked_prefill") else "--no-enable-chunked-prefill"]
    if config.max_model_len is not None:
        args += ["--max-model-len", str(config.max_model_len)]
    if config.kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if config.weight_dtype == "fp8":
        args += ["--quantization", "fp8"]
    return args


def _vllm_cases() -> list[tuple]:
    from ..config import EngineConfig

    return [(EngineConfig(), "the defaults (LLM())"),
            (EngineConfig(model="random:tiny-llama", max_num_seqs=64, block_size=32, prefix_caching=True,
                          chunked_prefill=True, max_model_len=2048),
             "random:tiny-llama, 64 sequences, blocks of 32, prefix caching and chunked prefill on, 2048 tokens"),
            (EngineConfig(tensor_parallel_size=2, kv_dtype="fp8", weight_dtype="fp8"),
             "tensor_parallel_size=2, fp8 KV cache, fp8 weights"),
            (EngineConfig(max_num_seqs=8, prefix_caching=False), "8 sequences, prefix caching off")]


def _vllm_refusals() -> list[tuple]:
    from ..config import EngineConfig

    return [(EngineConfig(kv_cache=False), "kv_cache"), (EngineConfig(batching="static"), "batching"),
            (EngineConfig(weight_dtype="int8"), "weight_dtype"), (EngineConfig(paged=False), "paged")]


def _lever(config, name: str):
    """A lever's value as the engine will run it: chunked_prefill=None (the default) is on wherever kv_cache is."""
    value = getattr(config, name)
    return config.kv_cache if name == "chunked_prefill" and value is None else value


def check_vllm_args(fn: Callable) -> None:
    """vllm_serve_args(config) on stated configs, read back by minillm's own map of vLLM's flags (`minillm serve`
    accepts vLLM's spellings: serve/vllm_flags.py): the same levers must come back; prefix caching and chunked prefill
    said explicitly (vLLM's defaults differ from minillm's); minillm-only spellings refused; levers vLLM cannot
    express refused with a ValueError naming them."""
    import contextlib
    import io

    from ..serve.cli import config_from_argv

    count = 0
    for config, what in _vllm_cases():
        call = f"vllm_serve_args(EngineConfig(...)) ({what})"
        got = call_learner(fn, (config,), call)
        if not isinstance(got, (list, tuple)) or not all(isinstance(a, str) for a in got) or not got:
            raise CheckFailed(f"{call} returned {got!r}; expected a list of strings, the model first "
                              "(e.g. ['HuggingFaceTB/SmolLM2-135M-Instruct', '--max-num-seqs', '16', ...])")
        for arg in got:
            if arg in MINILLM_ONLY_FLAGS:
                raise CheckFailed(f"{call}: {arg} is minillm's spelling; vLLM's is {MINILLM_ONLY_FLAGS[arg]}")
        want_model = config.model or VLLM_DEFAULT_MODEL
        if got[0] != want_model:
            raise CheckFailed(f"{call}: the first argument is {got[0]!r}; `vllm serve` takes the model first: "
                              f"{want_model!r}" + (" (minillm's default model, by its hub id)" if config.model is None else ""))
        for on, off, name in (("--enable-prefix-caching", "--no-enable-prefix-caching", "prefix_caching"),
                              ("--enable-chunked-prefill", "--no-enable-chunked-prefill", "chunked_prefill")):
            said = [a for a in got if a in (on, off)]
            if len(said) != 1:
                raise CheckFailed(f"{call}: say {name} explicitly, once ({on} or {off}; you gave {said or 'neither'}): "
                                  "the command must not depend on either engine's defaults (vLLM turns prefix caching "
                                  "on by default, minillm's LLM() leaves it off)")
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                back = config_from_argv(list(got[1:]) + ["--model", got[0]])
        except SystemExit:
            raise CheckFailed(f"{call} = {list(got)}: minillm's map of vLLM's flags refuses it: "
                              f"{stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else ''}") from None
        except ValueError as exc:
            raise CheckFailed(f"{call} = {list(got)}: minillm's map of vLLM's flags refuses it: {exc}") from None
        for name in VLLM_MAPPED:
            if _lever(back, name) != _lever(config, name):
                raise CheckFailed(f"{call} = {list(got)}: read back by minillm's map of vLLM's flags, {name} is "
                                  f"{_lever(back, name)!r}, expected {_lever(config, name)!r}")
        count += 1
    for config, lever in _vllm_refusals():
        call = f"vllm_serve_args(EngineConfig({lever}={getattr(config, lever)!r}))"
        try:
            got = fn(config)
        except NotImplementedError:
            raise
        except ValueError as exc:
            if lever not in str(exc):
                raise CheckFailed(f"{call} raised ValueError({str(exc)!r}); name the lever {lever!r} in the message")
            count += 1
            continue
        except Exception as exc:
            raise CheckFailed(f"{call} raised {type(exc).__name__}: {exc}; raise a ValueError naming {lever!r}") from None
        raise CheckFailed(f"{call} returned {got!r}: vLLM has no flag for {lever}={getattr(config, lever)!r} (it always "
                          f"runs {dict(VLLM_FIXED).get(lever, 'without it')!r}); raise a ValueError naming {lever!r} "
                          "instead of serving something else")
    passed("vllm_serve_args", count)


# =================================================================== 5. your kernel: a row-parallel shard's matmul
def reference_row_shard_matmul(x_shard: torch.Tensor, w_shard: torch.Tensor) -> torch.Tensor:
    """One rank's partial product of a row-parallel layer: x_shard [M, K] @ w_shard [N, K]^T, fp32 [M, N]."""
    return x_shard.float() @ w_shard.float().t()


# (M, N, K, what): rows, output features and this rank's input features; tails on every dimension
KERNEL_CASES = ((1, 16, 32, "one token, N and K exactly one block"),
                (3, 24, 40, "3 tokens, N = 24 and K = 40: a tail of 8 on K (blocks of 32)"),
                (5, 33, 20, "5 tokens, K = 20: less than one block of K"),
                (17, 40, 70, "17 tokens (two blocks of rows), K = 70: two full blocks of K and a tail"))


def check_row_shard_matmul(fn: Callable, seed: int = 0, num_random: int = 3, device: str = "cpu") -> None:
    """row_shard_matmul(x_shard, w_shard) (your kernel, launched) against x_shard @ w_shard^T on fresh random inputs:
    the stated shapes, then random ones; within 1e-4 of the largest output."""
    gen = torch.Generator().manual_seed(seed)
    cases = list(KERNEL_CASES)
    for i in range(num_random):
        m, n, k = (int(torch.randint(1, 20, (1,), generator=gen)), int(torch.randint(1, 70, (1,), generator=gen)),
                   int(torch.randint(1, 100, (1,), generator=gen)))
        cases.append((m, n, k, f"random case {i}"))
    for m, n, k, what in cases:
        x = torch.randn(m, k, generator=gen).to(device)
        w = torch.randn(n, k, generator=gen).to(device)
        call = f"row_shard_matmul(x_shard [{m}, {k}], w_shard [{n}, {k}]) ({what})"
        got = call_learner(fn, (x, w), call)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (m, n):
            raise CheckFailed(f"{call} returned {getattr(got, 'shape', type(got).__name__)}; expected [{m}, {n}]")
        got, want = got.float().cpu(), reference_row_shard_matmul(x, w).cpu()
        tol = 1e-4 * max(1.0, float(want.abs().max()))
        if torch.isnan(got).any():
            r, c = (int(v) for v in torch.nonzero(torch.isnan(got))[0])
            raise CheckFailed(f"{call}: output [{r}, {c}] was never stored (the launcher fills y with NaN): the grid and "
                              "the store's mask must cover every row < M and column < N")
        err = float((got - want).abs().max())
        if err <= tol:
            continue
        xc, wc = x.float().cpu(), w.float().cpu()
        full_k = (k // 32) * 32 if k % 32 else k - 32
        if torch.allclose(got, xc @ wc.reshape(k, n), atol=tol):
            hint = ("W was read as [K, N]: w_shard is [N, K] row-major, so W[n, k] sits at n * K + k (the stride of "
                    "its rows is K)")
        elif torch.allclose(got.reshape(-1), want.t().reshape(-1), atol=tol):
            hint = "y was stored column by column: y[m, n] sits at m * N + n"
        elif full_k >= 0 and torch.allclose(got, xc[:, :full_k] @ wc[:, :full_k].t(), atol=tol):
            hint = (f"the last block of K (columns {full_k} .. {k - 1}) is missing: loop over every block, "
                    "range(0, K, BLOCK_K), the last one masked with ks < K")
        else:
            hint = "acc += x_tile @ w_tile^T over every block of K, masks on rows < M, cols < N and ks < K"
        raise CheckFailed(f"{call}: differs from x_shard @ w_shard^T by {err:.3g} (allowed {tol:.3g}): {hint}")
    passed("row_shard_matmul", len(cases))


def kernel_tp_check(result: dict | None, tp_result: dict | None) -> None:
    """Your kernel inside the tensor-parallel engine gave N = 1's greedy tokens (their first tokens)."""
    if result is None:
        raise CheckFailed("kernel_tp is None: run the cell that runs the engine with your kernel")
    want = [t[:len(result["tokens"][0])] for t in tp_result["tokens"][min(tp_result["tokens"])]]
    for i, (mine, ref) in enumerate(zip(result["tokens"], want)):
        if mine != ref:
            j = next((t for t, (p, q) in enumerate(zip(mine, ref)) if p != q), min(len(mine), len(ref)))
            raise CheckFailed(f"tensor_parallel_size={result['tensor_parallel_size']} with your kernel: prompt {i} "
                              f"parts from N = 1's greedy tokens at output token {j}")
    passed("your kernel in the tensor-parallel engine", len(want))


def print_kernel_tp(result: dict, tp_result: dict) -> None:
    want = [t[:len(result["tokens"][0])] for t in tp_result["tokens"][min(tp_result["tokens"])]]
    same = sum(a == b for a, b in zip(result["tokens"], want))
    print(f"tensor_parallel_size={result['tensor_parallel_size']}, every rank's o_proj and down_proj through your "
          f"kernel: {same} of {len(want)} prompts give N = 1's tokens" + (" ✓" if same == len(want) else " ✗"))
    print(f"  {result['tokens']}  ({result['wall_s']:.1f} s for {len(result['tokens'][0])} tokens, {result['device']})")
    from .common import print_interpreter_note

    print_interpreter_note()


def time_row_shard_matmul(fn: Callable, tokens: int = 1, out_features: int = 4096, in_features: int = 512) -> dict:
    """On a GPU: your kernel against torch's matmul on one rank's shard of a Llama-3-8B o_proj at N = 8
    ([4096, 512] fp32). Without a GPU: {"device": "cpu"}."""
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    from .common import gpu_seconds

    x = torch.randn(tokens, in_features, device="cuda")
    w = torch.randn(out_features, in_features, device="cuda")
    return {"device": torch.cuda.get_device_name(), "shape": f"x_shard [{tokens}, {in_features}], w_shard "
            f"[{out_features}, {in_features}] fp32", "yours_s": gpu_seconds(lambda: fn(x, w)),
            "torch_s": gpu_seconds(lambda: x @ w.t()),
            "bytes": (w.numel() + x.numel() + tokens * out_features) * 4}


def print_row_shard_timing(result: dict) -> None:
    from .common import print_no_gpu_timing

    if result["device"] == "cpu":
        print_no_gpu_timing("on one rank's shard of a Llama-3-8B o_proj at N = 8 (x_shard [1, 512], w_shard "
                            "[4096, 512]) beside torch's matmul")
        return
    print(f"{result['shape']} — {result['device']}")
    for name in ("yours", "torch"):
        s = result[f"{name}_s"]
        print(f"  {name:>6}: {s * 1e6:.1f} µs, {result['bytes'] / s / 1e9:.0f} GB/s")


# =================================================================== 5. N ranks simulated in one process
def sendable(part) -> bool:
    """Whether a sharding part can travel to the worker processes (by value). A part that lives in another
    process (the autograder keeps the learner's code in its sandbox) cannot: then the ranks are simulated here."""
    from ..engine.parallel import pack_sharding

    try:
        pack_sharding(part)
    except ValueError:
        return False
    return True


class _SimColumn(torch.nn.Module):
    """A column-parallel layer of N simulated ranks: each sub-matrix (q, k, v or gate, up) cut by the part for every
    rank, each rank's output block computed from its own rows, the blocks side by side in rank order."""

    def __init__(self, full, sizes, names, part, n: int, what: str):
        super().__init__()
        from ..models.shard import _cut

        subs = full.weight.detach().split(sizes)
        self.weights = [[_cut(part, "column", sub, r, n, f"{what}.weight[{name}]") for r in range(n)]
                        for sub, name in zip(subs, names)]
        self.biases = None
        if full.bias is not None:
            self.biases = [[_cut(part, "column", sub, r, n, f"{what}.bias[{name}]") for r in range(n)]
                           for sub, name in zip(full.bias.detach().split(sizes), names)]

    def forward(self, x):
        outs = []
        for i, ranks in enumerate(self.weights):
            for r, w in enumerate(ranks):
                y = x @ w.t()
                outs.append(y + self.biases[i][r] if self.biases is not None else y)
        return torch.cat(outs, dim=-1)


class _SimRow(torch.nn.Module):
    """A row-parallel layer of N simulated ranks: rank r holds block r of the input features and its shard from
    part.row; part.row_matmul runs once per rank to learn its partial, then once as rank 0 with an all_reduce that
    adds the other ranks' partials (what gloo's sum would give it); the bias is added after."""

    def __init__(self, full, part, n: int, what: str):
        super().__init__()
        from ..models.shard import _cut

        self.shards = [_cut(part, "row", full.weight.detach(), r, n, f"{what}.weight") for r in range(n)]
        self.bias, self.part, self.n, self.what = full.bias, part, n, what

    def forward(self, x):
        width = x.shape[-1] // self.n
        xs = [x[..., r * width:(r + 1) * width].contiguous() for r in range(self.n)]
        partials = [None] * self.n
        for r in range(self.n):
            def record(t, r=r):
                partials[r] = t.clone()
                return t
            self.part.row_matmul(xs[r], self.shards[r], record)
        if any(p is None for p in partials):
            raise ValueError(f"sharding.row_matmul on {self.what} never called all_reduce: a rank's product is a "
                             "partial sum; return all_reduce(partial)")
        total = torch.stack(partials).sum(0)
        y = self.part.row_matmul(xs[0], self.shards[0], lambda t: t + (total - partials[0]))
        want = (*x.shape[:-1], self.shards[0].shape[0])
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != want:
            raise ValueError(f"sharding.row_matmul on {self.what} returned {getattr(y, 'shape', type(y).__name__)}; "
                             f"expected {list(want)}")
        return y if self.bias is None else y + self.bias


def simulated_tp_tokens(llm, part, n: int, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of `llm`'s one-device engine with every decoder layer's matmuls computed as N ranks cut by
    `part` would (each rank's blocks, its row_matmul with an all_reduce that adds the other ranks' partials), all in
    this process. The layers are put back afterwards. For a part that cannot reach worker processes."""
    from .. import SamplingParams
    from ..models.shard import check_tensor_parallel

    model = llm.engine.model
    cfg = model.cfg
    check_tensor_parallel(cfg, n)
    hd = cfg.head_dim
    q, kv, inter = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    saved, runner = [], llm.engine.runner
    fuse = getattr(runner, "fuse_cpu_decode", None)
    try:
        for i, layer in enumerate(model.layers):
            names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
            saved.append({name: layer._modules[name] for name in names})
            layer._modules["qkv_proj"] = _SimColumn(layer.qkv_proj, (q, kv, kv), ("q", "k", "v"), part, n,
                                                    f"layers.{i}.qkv_proj")
            layer._modules["gate_up_proj"] = _SimColumn(layer.gate_up_proj, (inter, inter), ("gate", "up"), part, n,
                                                        f"layers.{i}.gate_up_proj")
            layer._modules["o_proj"] = _SimRow(saved[-1]["o_proj"], part, n, f"layers.{i}.o_proj")
            layer._modules["down_proj"] = _SimRow(saved[-1]["down_proj"], part, n, f"layers.{i}.down_proj")
        if fuse is not None:
            runner.fuse_cpu_decode = False
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False) if _takes_tqdm(llm) else \
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        for layer, modules in zip(model.layers, saved):
            for name, module in modules.items():
                layer._modules[name] = module
        if fuse is not None:
            runner.fuse_cpu_decode = fuse


def _takes_tqdm(llm) -> bool:
    import inspect

    return "use_tqdm" in inspect.signature(llm.generate).parameters
