"""TPGroup: one rank's view of a tensor-parallel group (Megatron-style), and the row-parallel linear.

A model sharded over N ranks (models/shard.py) holds 1/N of each matrix: QKV and gate/up split by
output rows (column-parallel: each rank computes its heads / its slice of the MLP, no communication),
o_proj and down_proj split by input columns (row-parallel: each rank's product is a partial sum, one
all-reduce adds them), the embedding and the head split by vocabulary rows. So a decoder layer costs
two all-reduces of [tokens, hidden]; the embedding one more, the head one all-gather of the logits.

The group wraps a torch.distributed process-group backend (gloo on the CPU, NCCL on CUDA) built by
the engine (engine/parallel.py), and counts what it moves: bytes and seconds of every all-reduce and
all-gather, so the benchmark can print communication beside compute. No module-level state: each
engine owns its group; tests build as many as they like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class CommStats:
    """What the group's collectives moved since the last reset (bytes: this rank's tensor sizes)."""

    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    allreduce_s: float = 0.0
    allgather_calls: int = 0
    allgather_bytes: int = 0
    allgather_s: float = 0.0


class TPGroup:
    """rank, world_size and the backend's collectives. `backend`: a torch.distributed process-group
    backend (ProcessGroupGloo / ProcessGroupNCCL), attached once the ranks have met (the shards are
    cut before that, so every rank loads its weights while the others start); None for world_size 1."""

    def __init__(self, rank: int, world_size: int, backend=None, device: torch.device | None = None):
        if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
            raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size!r}), world_size >= 1")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = device or torch.device("cpu")
        self.stats = CommStats()
        self.on_error = None   # set by the engine: turns a failed collective into "worker rank r died"

    def reset_stats(self) -> CommStats:
        self.stats = CommStats()
        return self.stats

    def _sync(self) -> None:
        if self.device.type == "cuda":   # NCCL runs on the stream: time the collective, not its launch
            torch.cuda.synchronize(self.device)

    def _wait(self, work) -> None:
        try:
            if work is None:
                raise RuntimeError(f"rank {self.rank} of {self.world_size}: the group has no backend attached yet")
            work.wait()
        except Exception as exc:   # a peer died (gloo: its connection closed) or timed out
            if self.on_error is not None:
                self.on_error(exc)
            raise

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x contiguous); returns x."""
        if self.world_size == 1:
            return x
        if not x.is_contiguous():
            x = x.contiguous()
        self._sync()
        t0 = time.perf_counter()
        self._wait(self.backend.allreduce([x]) if self.backend is not None else None)
        self._sync()
        st = self.stats
        st.allreduce_calls += 1
        st.allreduce_bytes += x.numel() * x.element_size()
        st.allreduce_s += time.perf_counter() - t0
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n]: the ranks' slices side by side, rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        self._sync()
        t0 = time.perf_counter()
        self._wait(self.backend.allgather([out], [x]) if self.backend is not None else None)
        self._sync()
        st = self.stats
        st.allgather_calls += 1
        st.allgather_bytes += x.numel() * x.element_size()
        st.allgather_s += time.perf_counter() - t0
        return torch.cat(out, dim=-1)


class RowParallelLinear(nn.Module):
    """A row-parallel matrix (o_proj, down_proj): this rank's input columns in `inner` (a Linear or a
    QuantizedLinear, no bias), its partial product all-reduced, then the bias added once."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, group: TPGroup, row_matmul=None):
        super().__init__()
        self.inner = inner
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.__dict__["group"] = group   # not a submodule, not copied by state_dict
        # a TensorSharding's row_matmul(x, weight, all_reduce) (sharding=...): it computes the partial product and
        # calls the all-reduce itself; None: inner's matmul, then the group's all-reduce
        self.__dict__["row_matmul"] = row_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_matmul is None:
            y = self.group.all_reduce(self.inner(x))
        else:
            y = self.row_matmul(x, self.inner.weight, self.group.all_reduce)
            want = (*x.shape[:-1], self.inner.weight.shape[0])
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != want:
                raise ValueError(f"sharding.row_matmul(x {list(x.shape)}, weight {list(self.inner.weight.shape)}, "
                                 f"all_reduce) returned {list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}; expected the whole "
                                 f"layer's output {list(want)} (the partial product, summed by all_reduce)")
        return y if self.bias is None else y + self.bias


def vocab_parallel_lookup(lookup, ids: torch.Tensor, start: int, end: int, group: TPGroup) -> torch.Tensor:
    """An embedding split by vocabulary rows: this rank holds rows [start, end); `lookup(local_ids)`
    reads them. Ids outside the range read row 0 and are zeroed; the all-reduce fills them in from the
    rank that holds them (exactly one rank holds each id, so the sum is that row)."""
    inside = (ids >= start) & (ids < end)
    rows = lookup(torch.where(inside, ids - start, torch.zeros_like(ids)))
    rows = rows * inside.unsqueeze(-1).to(rows.dtype)
    return group.all_reduce(rows.contiguous())
