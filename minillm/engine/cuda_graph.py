"""CUDA graphs for decode steps: capture once per batch-size bucket, then replay.

A decode step of a small model is mostly launch overhead: hundreds of small kernels, each
queued by Python. A CUDA graph records one step's launches once and replays them with a
single call. A graph fixes every tensor address and shape, so a step reads its inputs from
*static buffers* that live as long as the graphs, sized for the largest batch:

    input_ids, positions, slot_mapping    [max_bs]               int64
    seq_lens                              [max_bs]               int32
    block_tables                          [max_bs, max_blocks]   int32  (max_blocks from max_model_len)

A batch of n sequences runs the graph of the smallest bucket >= n (1, 2, 4, 8, 16, ...,
max_num_seqs, as vLLM and nano-vllm do). The rows past n are padding: slot -1 (store_kv
writes nothing for it) and seq_len 1 (attention reads one key through a block table row of
0s); every operation of the model is row-wise, so padding never touches real rows, whose
logits are the first n of the graph's output.

The split-KV decode kernel sizes its partition grid from the block table's width, fixed
here by the longest context a graph serves: min(max_model_len, MAX_CAPTURE_LEN). A grid
sized for Llama-3's 128k context would launch hundreds of idle programs per sequence and
layer, so (like vLLM's max_seq_len_to_capture) a decode step whose context is longer runs
eagerly instead.

A quantized KV cache (kv_dtype "int8" / "fp8") needs nothing more: its scale pools, like the
value pools, are allocated once (every pass's ForwardContext hands the same ones to the layers), so
their addresses are fixed, and the store kernel skips a padding row's scales along with its values
(slot -1).

Logits are computed inside the graph; sampling runs outside it. Prefill and mixed steps
run eagerly (their token counts vary too much to capture).

`capture=False` runs the same padded static-buffer path eagerly: that is how the CPU tests
check padding (Triton interpreter), since capture itself needs a CUDA device.
"""

from __future__ import annotations

import time

import torch

from ..layers.attention import AttentionMetadata
from .sequence import Sequence

MAX_CAPTURE_LEN = 8192  # longest context served by a graph (vLLM's max_seq_len_to_capture default)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... up to max_num_seqs (which is itself the last bucket)."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Static buffers + one captured graph per bucket, for one engine's model and KV pool."""

    def __init__(self, model, context, device: torch.device, block_size: int, max_num_seqs: int, max_model_len: int,
                 capture: bool = True, max_capture_len: int = MAX_CAPTURE_LEN):
        """context(meta) -> the engine's ForwardContext for a pass (ModelRunner.context)."""
        if capture and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this engine runs on {device.type!r}")
        self.model, self.context = model, context
        self.device = device
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.max_len = min(max_model_len, max_capture_len)
        self.max_blocks = -(-self.max_len // block_size)
        self.capture = capture
        dev, n = device, self.max_bs
        # One int64 buffer holds ids, positions and slots: one host-to-device copy per step.
        self._packed = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self._packed[0], self._packed[1], self._packed[2]
        self.slot_mapping.fill_(-1)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_s = 0.0       # time spent capturing (first decode step)
        self.num_steps = 0         # decode steps run through this path (captured or padded-eager)

    # ------------------------------------------------------------------ which steps
    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def can_run(self, seqs: list[Sequence]) -> bool:
        """Every sequence feeds exactly one token, and the batch and contexts fit the buffers."""
        if not seqs or len(seqs) > self.max_bs:
            return False
        for s in seqs:
            new = s.num_scheduled_tokens or len(s) - s.num_cached_tokens
            if new != 1 or s.num_cached_tokens + 1 > self.max_len:
                return False
        return True

    # ------------------------------------------------------------------ the step
    def metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_lens=[1] * bs, num_cached=[0] * bs, slot_mapping=self.slot_mapping[:bs], kv_read=[],
            use_cache=True, block_size=self.block_size, block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1], max_query_len=1,
        )

    def forward(self, bs: int) -> torch.Tensor:
        """The model over the first `bs` rows of the static buffers -> fp32 logits [bs, vocab]."""
        ctx = self.context(self.metadata(bs))
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        return self.model.compute_logits(hidden, ctx.parts)

    def load(self, seqs: list[Sequence], bs: int) -> None:
        """Copy the batch into the static buffers; rows len(seqs)..bs-1 become padding."""
        block = self.block_size
        ids, pos, slots, lens, tables = [], [], [], [], []
        for s in seqs:
            p = s.num_cached_tokens
            table = s.block_table
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(table[p // block] * block + p % block)
            lens.append(p + 1)
            tables.append(table[: self.max_blocks])  # a reservation may run past what is read
        pad = bs - len(seqs)
        width = max(len(t) for t in tables)
        packed = torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad], dtype=torch.long)
        self._packed[:, :bs].copy_(packed)
        self.seq_lens[:bs].copy_(torch.tensor(lens + [1] * pad, dtype=torch.int32))
        # Columns past `width` keep old (valid) block ids: no sequence reads past its own length.
        rows = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad
        self.block_tables[:bs, :width].copy_(torch.tensor(rows, dtype=torch.int32))

    @torch.inference_mode()
    def logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Next-token logits [len(seqs), vocab] fp32 for a decode batch (see can_run)."""
        bs = self.bucket(len(seqs))
        if self.capture and not self.graphs:
            self.capture_all()
        self.load(seqs, bs)
        self.num_steps += 1
        if not self.capture:
            return self.forward(bs)[: len(seqs)]
        self.graphs[bs].replay()
        return self.outputs[bs][: len(seqs)]

    # ------------------------------------------------------------------ capture
    def reset(self) -> None:
        """Drop the captured graphs (the next decode step captures again)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool)."""
        t0 = time.perf_counter()
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)   # capture writes nothing into the KV pool
        self.seq_lens.fill_(1)
        torch.cuda.synchronize(self.device)
        for bs in reversed(self.buckets):
            self.forward(bs)          # warm up: compile the Triton kernels, pick cuBLAS kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self.forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
