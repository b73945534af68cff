"""Batched multi-LoRA on the model's linear layers: the stacked adapter slots, the step's LoRA batch, the delta.

Each decoder layer's fused linear layers (qkv_proj, o_proj, gate_up_proj, down_proj; DecoderLayer.lora_slices
says which PEFT modules each holds, at which output columns) get, for every slot, its adapter's matrices:

    A  [max_loras + 1, num_slices * r_max, in]     the slices' A concatenated along the rank
    B  [max_loras + 1, width, r_max]               one per slice (scaling folded in)

zero-padded to r_max (a rank-8 adapter in a rank-16 slot adds zeros), slot 0 all zeros (no adapter). A module
an adapter does not target stays zero too. After each fused layer's base matmul (whatever its weight format), the
decoder layer calls `add_delta`, which adds every token's delta y += (x A[s]^T) B[s]^T for its own slot s, from
the step's `LoRABatch` in the pass's ForwardContext (layers/context.py; None: no adapter in the step, nothing to
add). The slots belong to the engine's runner, so two engines sharing one model's weights (LLM.with_levers)
each bring their own. An engine built with `lora_delta=fn` (seams.LoRADelta) computes the delta with fn.

Two ways to compute the delta: Triton's SGMV shrink / expand over segments (kernels/lora.py) when the engine's
Triton ops are on, else torch: for each adapter in the batch, its tokens' rows times its A, then its B
(a slice for one run of tokens, an index_add for scattered ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lora import LoRAAdapter


@dataclass
class LoRABatch:
    """One step's adapters, built by the model runner from each sequence's slot (0: no adapter)."""

    weights: "LoRAWeights"
    token_slots: torch.Tensor            # [num_tokens] int64: each token's slot
    seg_starts: torch.Tensor             # [num_segments] int32: runs of consecutive tokens on one adapter (slot > 0)
    seg_lens: torch.Tensor               # [num_segments] int32
    seg_slots: torch.Tensor              # [num_segments] int32
    max_seg_len: int
    groups: list                         # [(slot, slice | int64 row indices)]: each adapter's tokens (torch path)
    use_triton: bool = False


def lora_targets(model) -> list[dict[str, tuple[int, list[tuple[str, int, int]]]]]:
    """Per decoder layer: fused attribute -> (in_features, [(PEFT module, first output column, width)])."""
    return [layer.lora_slices() for layer in model.layers]


def layer_shapes(model) -> list[dict[str, tuple[int, int]]]:
    """Per decoder layer: PEFT module name -> (out_features, in_features) of the matrix it adapts."""
    return [{name: (width, in_features) for in_features, slices in layer.values() for name, _offset, width in slices}
            for layer in lora_targets(model)]


class LoRAWeights:
    """The stacked slots of every hooked layer, on the model's device, in its dtype."""

    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets = lora_targets(model)
        num_slots = max_loras + 1
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, list[torch.Tensor]]] = []
        for layer in self.targets:
            self.a.append({attr: torch.zeros(num_slots, len(slices) * max_rank, in_features, dtype=dtype,
                                             device=device) for attr, (in_features, slices) in layer.items()})
            self.b.append({attr: [torch.zeros(num_slots, width, max_rank, dtype=dtype, device=device)
                                  for _name, _offset, width in slices] for attr, (_in, slices) in layer.items()})
        self.resident: list[int | None] = [None] * num_slots   # slot -> adapter id whose weights it holds
        self.num_copies = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.a for t in layer.values()) + \
            sum(t.numel() * t.element_size() for layer in self.b for ts in layer.values() for t in ts)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into a slot (zeros where it has no module or a lower rank)."""
        if self.resident[slot] == adapter.request.lora_int_id:
            return
        r, max_rank = adapter.rank, self.max_rank
        for index, layer in enumerate(self.targets):
            for attr, (_in, slices) in layer.items():
                a_slot = self.a[index][attr][slot]
                a_slot.zero_()
                for i, (name, _offset, _width) in enumerate(slices):
                    b_slot = self.b[index][attr][i][slot]
                    b_slot.zero_()
                    pair = adapter.weights.get((index, name))
                    if pair is not None:
                        a_slot[i * max_rank:i * max_rank + r].copy_(pair[0])
                        b_slot[:, :r].copy_(pair[1])
        self.resident[slot] = adapter.request.lora_int_id
        self.num_copies += 1


def build_batch(weights: LoRAWeights, slots: list[int], query_lens: list[int], device: torch.device,
                use_triton: bool) -> LoRABatch | None:
    """The step's batch from each sequence's slot and token count; None when no sequence has an adapter."""
    if not any(slots):
        return None
    token_slots: list[int] = []
    segments: list[list[int]] = []     # [start, length, slot]
    start = 0
    for slot, n in zip(slots, query_lens):
        token_slots.extend([slot] * n)
        if slot and segments and segments[-1][2] == slot and segments[-1][0] + segments[-1][1] == start:
            segments[-1][1] += n        # the previous sequence ran on the same adapter: one longer segment
        elif slot and n:
            segments.append([start, n, slot])
        start += n
    rows: dict[int, list[list[int]]] = {}
    for seg_start, length, slot in segments:
        rows.setdefault(slot, []).append([seg_start, length])
    groups = []
    for slot, runs in rows.items():
        if len(runs) == 1:
            groups.append((slot, slice(runs[0][0], runs[0][0] + runs[0][1])))
        else:
            index = [t for s, n in runs for t in range(s, s + n)]
            groups.append((slot, torch.tensor(index, dtype=torch.long, device=device)))
    columns = list(zip(*segments))
    return LoRABatch(
        weights=weights,
        token_slots=torch.tensor(token_slots, dtype=torch.long, device=device),
        seg_starts=torch.tensor(columns[0], dtype=torch.int32, device=device),
        seg_lens=torch.tensor(columns[1], dtype=torch.int32, device=device),
        seg_slots=torch.tensor(columns[2], dtype=torch.int32, device=device),
        max_seg_len=max(columns[1]),
        groups=groups,
        use_triton=use_triton,
    )


def add_lora_delta(x: torch.Tensor, y: torch.Tensor, batch: LoRABatch, layer_index: int, attr: str) -> torch.Tensor:
    """y [T, out_total] += each token's delta, slice by slice, in place (the fused layer's output)."""
    weights = batch.weights
    a = weights.a[layer_index][attr]
    bs = weights.b[layer_index][attr]
    _in, slices = weights.targets[layer_index][attr]
    r = weights.max_rank
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    if batch.use_triton:
        from ..kernels.lora import sgmv_expand, sgmv_shrink

        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        mid = sgmv_shrink(x2, a, batch.seg_starts, batch.seg_lens, batch.seg_slots, batch.max_seg_len)
        for i, ((_name, offset, width), b) in enumerate(zip(slices, bs)):
            sgmv_expand(mid[:, i * r:(i + 1) * r], b, y2[:, offset:offset + width], batch.seg_starts,
                        batch.seg_lens, batch.seg_slots, batch.max_seg_len)
        return y
    for slot, rows in batch.groups:
        mid = x2[rows] @ a[slot].t()                                    # [n, num_slices * r]
        for i, ((_name, offset, width), b) in enumerate(zip(slices, bs)):
            delta = mid[:, i * r:(i + 1) * r] @ b[slot].t()             # [n, width]
            if isinstance(rows, slice):
                y2[rows, offset:offset + width] += delta
            else:
                y2[:, offset:offset + width].index_add_(0, rows, delta)
    return y


def add_plugged_delta(fn, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch, layer_index: int,
                      attr: str) -> torch.Tensor:
    """y += fn(x2d, A [S, r, in], B [S, width, r], batch) per slice of the fused layer, in place."""
    weights = batch.weights
    a = weights.a[layer_index][attr]
    _in, slices = weights.targets[layer_index][attr]
    r = weights.max_rank
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    for i, ((name, offset, width), b) in enumerate(zip(slices, weights.b[layer_index][attr])):
        delta = fn(x2, a[:, i * r:(i + 1) * r], b, batch)
        if not isinstance(delta, torch.Tensor) or tuple(delta.shape) != (x2.shape[0], width):
            shape = tuple(delta.shape) if isinstance(delta, torch.Tensor) else type(delta).__name__
            raise ValueError(f"the plugged LoRA delta returned {shape} for layer {layer_index} {name}; "
                             f"expected a tensor of shape {(x2.shape[0], width)} (tokens, out_features)")
        y2[:, offset:offset + width] += delta.to(y2.dtype)
    return y


def add_delta(x: torch.Tensor, y: torch.Tensor, batch: LoRABatch | None, layer_index: int, attr: str,
              delta_fn=None) -> torch.Tensor:
    """What a fused projection returns with adapters: y plus each token's delta (in place), by `delta_fn` (an
    engine's lora_delta part, seams.LoRADelta) or the built-in one; y as it is when the step has no adapter."""
    if batch is None:
        return y
    if delta_fn is not None:
        return add_plugged_delta(delta_fn, x, y, batch, layer_index, attr)
    return add_lora_delta(x, y, batch, layer_index, attr)
