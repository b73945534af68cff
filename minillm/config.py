"""EngineConfig: every lever of the engine is one field of this dataclass."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .seams import check_attention_backend


def cache_root() -> Path:
    """`$MINILLM_CACHE`, else `~/.cache/minillm` (XDG_CACHE_HOME respected)."""
    env = os.environ.get("MINILLM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "minillm"


# Example on-demand price of one H100 80GB hour in USD (late 2025 cloud list prices
# cluster around 2-4 USD). Learners change it to their own hardware's price.
DEFAULT_GPU_HOURLY_USD = 2.50
# A CPU has a price too: a 2-vCPU cloud VM costs about 0.08 USD per hour.
DEFAULT_CPU_HOURLY_USD = 0.08

BATCHING_MODES = ("continuous", "static")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("int8", "int4", "fp8")   # or None / "auto": the model dtype
WEIGHT_GROUP_SIZES = (32, 64, 128)        # int4 group size, in input channels
WEIGHT_CALIBRATIONS = ("awq", "gptq", "gptq-tuned", "autoround")    # or None: round-to-nearest
SPECULATIVE_METHODS = ("ngram", "self", "draft")  # proposers (minillm/speculative/)
MAX_SPECULATIVE_TOKENS = 16
WEIGHT_HEAD_DTYPES = ("auto", "model") + WEIGHT_DTYPES  # lm_head storage (models/quantize.py head_dtype_for)
MAX_LORAS = 64                           # enable_lora: adapter slots at most
MAX_LORA_RANK = 256                      # enable_lora: the largest adapter rank
MAX_TENSOR_PARALLEL = 64                 # tensor_parallel_size: ranks at most
KV_DTYPES = ("int8", "fp8")               # or None / "auto": the model dtype (see engine/kv_cache.py)

# Chunked prefill's step budget (max_num_batched_tokens) per device: the largest step the engine runs. Smaller
# chunks let decodes and short prompts in sooner, but each chunk re-reads the weights and the cached K/V of the
# chunks before it. On a CPU a chunk of 512 tokens keeps a long prompt's prefill throughput near whole-prompt
# prefill (`python -m minillm.bench.chunking`, docs/PERFORMANCE.md); a GPU takes 2048, as vLLM's default for an
# online server on a data-center GPU. Without chunking a step admits whole prompts up to 8192 tokens.
CPU_CHUNK_TOKENS = 512
GPU_CHUNK_TOKENS = 2048
WHOLE_PREFILL_TOKENS = 8192
DEVICE_DEFAULTS = ("chunked_prefill", "max_num_batched_tokens")   # None: chosen when the engine is built


def default_max_num_batched_tokens(device, chunked_prefill: bool = True) -> int:
    """max_num_batched_tokens=None on `device` (a torch.device or its type name): the chunk budget, or
    WHOLE_PREFILL_TOKENS without chunked prefill."""
    if not chunked_prefill:
        return WHOLE_PREFILL_TOKENS
    kind = getattr(device, "type", str(device))
    return CPU_CHUNK_TOKENS if kind == "cpu" else GPU_CHUNK_TOKENS


def lever(default, help: str):
    """An EngineConfig field with its help text (`minillm serve --help`, `minillm ... --set`)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    """The levers. Names are the public API: `LLM(model, **fields)`."""

    model: str | None = lever(None,
        "None: the default model (SmolLM2-135M-Instruct); a local directory, a hub id or 'random:<preset>'")
    dtype: str = lever("auto", 'activation and weight dtype; auto: float32 on a CPU, bfloat16 on CUDA')
    device: str = lever("auto", 'auto: cuda when available, else cpu')
    seed: int = lever(0, 'seeds the requests that bring no seed of their own')

    # KV cache lever: False recomputes the whole prefix at every step (quadratic work).
    kv_cache: bool = lever(True,
        'keep K/V between steps; False recomputes the whole prefix at every step (quadratic work)')
    max_model_len: int | None = lever(None, "None: the model's max_position_embeddings")
    block_size: int = lever(16, 'KV pool granularity, in tokens')
    kv_cache_bytes: int | None = lever(None, 'KV pool size in bytes; None: enough for the batch, capped')
    kv_cache_memory_fraction: float | None = lever(None,
        "or: this fraction of the device's free memory after the weights")
    paged: bool = lever(True, 'True: KV blocks on demand (PagedAttention); False: max_model_len reserved per request')

    # Batching lever.
    batching: str = lever("continuous",
        'continuous: requests join and leave the running batch; static: hold the batch until its longest ends')
    max_num_seqs: int = lever(16, 'sequences in one step at most')
    max_num_batched_tokens: int | None = lever(None,
        'tokens in one step at most (the chunk budget with chunked_prefill); None: 512 on a CPU and 2048 on a GPU '
        'when chunking, else 8192')

    # Kernels.
    attention_backend: Any = lever("auto",
        'auto | torch | triton | cpu | an object of an attention protocol (minillm/seams.py); auto: cpu for '
        'fp32 on a CPU with the kernels built, else torch')
    cpu_threads: Any = lever("auto",
        "auto: torch's threads, one fewer per core other processes keep busy (re-decided each second); or a "
        'fixed count')

    # Cost model.
    gpu_hourly_usd: float | None = lever(None,
        'USD per device hour for the cost model; None: 2.50 on a GPU, 0.08 on a CPU')

    # Levers of the later labs (chunked prefill, quantization, prefix caching, speculative decoding).
    # Every value listed is built; anything else is refused at construction with the allowed values.
    chunked_prefill: bool | None = lever(None,
        'split long prompts into chunks of max_num_batched_tokens, beside the running decodes; None: on wherever '
        'kv_cache=True (as vLLM), False: one step prefills whole prompts')
    long_prefill_token_threshold: int = lever(0,
        "chunked prefill: one prompt's chunk takes at most this many tokens a step, leaving the rest of the budget "
        "to other requests (vLLM's --long-prefill-token-threshold); 0: a chunk may take the whole budget")
    weight_dtype: str | None = lever(None, 'None (the model dtype) | int8 | int4 | fp8 (minillm/quant)')
    weight_group_size: int = lever(128, 'int4: input channels per scale and zero (32, 64 or 128)')
    weight_calibration: str | None = lever(None,
        "None: round-to-nearest | awq | gptq | gptq-tuned | autoround (int4, calibrated on the course's text; "
        'see docs/PERFORMANCE.md)')
    weight_head_dtype: str = lever("auto",
        'lm_head: auto (int8 under int4, else weight_dtype) | model (the model dtype) | int8 | int4 | fp8')
    kv_dtype: str | None = lever(None,
        'None (the model dtype) | int8 | fp8: K/V stored with a scale per token and head')
    prefix_caching: bool = lever(False, 'reuse the K/V of full blocks another request already computed')
    speculative: str | None = lever(None,
        'None: off | ngram (prompt lookup) | self (an early-exit draft) | draft (draft_model)')
    num_speculative_tokens: int = lever(4, 'tokens proposed per speculative step')
    draft_model: str | None = lever(None,
        'speculative=draft: a smaller model sharing the tokenizer (path, hub id or random:<preset>)')
    draft_num_layers: int | None = lever(None,
        "speculative=self: the target's first layers that draft (None: a quarter)")
    cuda_graphs: bool = lever(False, 'GPU decode steps replay CUDA graphs (needs attention_backend=triton)')
    enable_lora: bool = lever(False, 'per-request LoRA adapters (LoRARequest), batched together')
    max_loras: int = lever(4, 'enable_lora: adapters resident at once (slots, LRU-evicted when unused)')
    max_lora_rank: int = lever(16, 'enable_lora: the largest adapter rank a slot holds')
    tensor_parallel_size: int = lever(1,
        'shard the model over N processes (Megatron; gloo on a CPU, NCCL on CUDA); N divides the query and KV '
        'head counts')

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}; the levers are: {sorted(names - {'model'})}"
            )
        return cls(model=model, **kwargs)

    def resolve_defaults(self, device) -> tuple[str, ...]:
        """Fill in the levers left to a default that depends on the device or on other levers (DEVICE_DEFAULTS,
        None), in place, when the engine is built for `device`; returns the names filled. chunked_prefill None
        becomes kv_cache (a chunk attends to the cached earlier chunks), max_num_batched_tokens None the
        device's budget (default_max_num_batched_tokens)."""
        filled = tuple(name for name in DEVICE_DEFAULTS if getattr(self, name) is None)
        if self.chunked_prefill is None:
            self.chunked_prefill = self.kv_cache
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_max_num_batched_tokens(device, self.chunked_prefill)
        self.validate()
        return filled

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.dtype in DTYPES, f"dtype={self.dtype!r} is not one of {DTYPES}")
        cores = os.cpu_count() or 1
        need(self.cpu_threads == "auto" or (isinstance(self.cpu_threads, int) and not isinstance(self.cpu_threads, bool)
                                            and 1 <= self.cpu_threads <= cores),
             f"cpu_threads={self.cpu_threads!r} must be 'auto' or an integer in [1, {cores}] (this machine's CPUs)")
        need(isinstance(self.kv_cache, bool), f"kv_cache={self.kv_cache!r} must be True or False")
        need(self.batching in BATCHING_MODES, f"batching={self.batching!r} is not one of {BATCHING_MODES}")
        need(isinstance(self.max_num_seqs, int) and 1 <= self.max_num_seqs <= 4096,
             f"max_num_seqs={self.max_num_seqs!r} must be an integer in [1, 4096]")
        need(self.max_num_batched_tokens is None or (isinstance(self.max_num_batched_tokens, int)
                                                     and not isinstance(self.max_num_batched_tokens, bool)
                                                     and self.max_num_batched_tokens >= 1),
             f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be an integer >= 1 (or None: the "
             "device's default)")
        need(self.chunked_prefill is None or isinstance(self.chunked_prefill, bool),
             f"chunked_prefill={self.chunked_prefill!r} must be None (on with the KV cache), True or False")
        need(isinstance(self.long_prefill_token_threshold, int) and not isinstance(self.long_prefill_token_threshold, bool)
             and self.long_prefill_token_threshold >= 0,
             f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} must be an integer >= 0 (0: off)")
        need(isinstance(self.block_size, int) and 1 <= self.block_size <= 1024,
             f"block_size={self.block_size!r} must be an integer in [1, 1024]")
        need(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
             f"max_model_len={self.max_model_len!r} must be None or an integer >= 1")
        need(self.kv_cache_bytes is None or (isinstance(self.kv_cache_bytes, int) and self.kv_cache_bytes > 0),
             f"kv_cache_bytes={self.kv_cache_bytes!r} must be None or a positive integer")
        need(self.kv_cache_memory_fraction is None or (isinstance(self.kv_cache_memory_fraction, (int, float))
                                                       and 0 < self.kv_cache_memory_fraction <= 0.95),
             f"kv_cache_memory_fraction={self.kv_cache_memory_fraction!r} must be None or in (0, 0.95]")
        need(self.kv_cache_bytes is None or self.kv_cache_memory_fraction is None,
             f"give the KV pool size once: kv_cache_bytes={self.kv_cache_bytes} or "
             f"kv_cache_memory_fraction={self.kv_cache_memory_fraction}, not both")
        need(self.gpu_hourly_usd is None or self.gpu_hourly_usd >= 0,
             f"gpu_hourly_usd={self.gpu_hourly_usd!r} must be >= 0")
        if isinstance(self.attention_backend, str):
            need(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend={self.attention_backend!r} is not one of {ATTENTION_BACKENDS} "
                 "(or an object of an attention protocol, minillm/seams.py)")
        else:
            check_attention_backend(self.attention_backend)
        if self.attention_backend in ("triton", "cpu") and not self.kv_cache:
            raise ValueError(f"attention_backend={self.attention_backend!r} needs kv_cache=True: its kernels read "
                             "the paged KV pool")
        if self.chunked_prefill and not self.kv_cache:
            raise ValueError("chunked_prefill=True needs kv_cache=True: a chunk attends to the cached earlier chunks")
        # CUDA graphs replay captured decode steps (the CUDA-device check happens when the engine
        # resolves its device). The torch backend loops over sequences in Python and reads each
        # one's cache through host-built indices, so only the Triton kernels can be captured.
        need(isinstance(self.cuda_graphs, bool), f"cuda_graphs={self.cuda_graphs!r} must be True or False")
        if self.cuda_graphs and not self.kv_cache:
            raise ValueError("cuda_graphs=True needs kv_cache=True: a captured decode step reads and writes the KV pool")
        if self.cuda_graphs and self.attention_backend != "triton":
            raise ValueError(f"cuda_graphs=True needs attention_backend='triton' (got {self.attention_backend!r}): "
                             "only the Triton kernels' decode steps are captured (the torch backend loops over sequences "
                             "in Python; the CPU kernels run on the CPU)")

        need(self.weight_dtype in (None, "auto") + WEIGHT_DTYPES,
             f"weight_dtype={self.weight_dtype!r} is not one of {(None,) + WEIGHT_DTYPES}")
        need(self.weight_group_size in WEIGHT_GROUP_SIZES,
             f"weight_group_size={self.weight_group_size!r} is not one of {WEIGHT_GROUP_SIZES}")
        need(self.weight_calibration in (None,) + WEIGHT_CALIBRATIONS,
             f"weight_calibration={self.weight_calibration!r} is not one of {(None,) + WEIGHT_CALIBRATIONS}")
        need(self.weight_calibration is None or self.weight_dtype not in (None, "auto"),
             f"weight_calibration={self.weight_calibration!r} needs a weight_dtype (one of {WEIGHT_DTYPES}): "
             "it calibrates the quantization of the weights")
        need(self.weight_calibration not in ("gptq", "gptq-tuned", "autoround") or self.weight_dtype == "int4",
             f"weight_calibration={self.weight_calibration!r} needs weight_dtype='int4' (got {self.weight_dtype!r}): "
             "it rounds onto the int4 group grid")
        need(self.weight_head_dtype in WEIGHT_HEAD_DTYPES,
             f"weight_head_dtype={self.weight_head_dtype!r} is not one of {WEIGHT_HEAD_DTYPES} "
             "('auto': int8 under int4 weights, else the weight_dtype; 'model': the model dtype)")
        need(self.weight_head_dtype in ("auto", "model") or self.weight_dtype not in (None, "auto"),
             f"weight_head_dtype={self.weight_head_dtype!r} needs a weight_dtype (one of {WEIGHT_DTYPES}): "
             "the head is quantized together with the decoder matrices")

        need(self.kv_dtype in (None, "auto") + KV_DTYPES,
             f"kv_dtype={self.kv_dtype!r} is not one of {(None, 'auto') + KV_DTYPES} "
             "(None / 'auto': the model dtype; 'int8' / 'fp8': one byte per value plus a scale per token and head)")
        if self.kv_dtype not in (None, "auto") and not self.kv_cache:
            raise ValueError(f"kv_dtype={self.kv_dtype!r} needs kv_cache=True: it sets how the KV cache stores K and V")

        need(isinstance(self.prefix_caching, bool), f"prefix_caching={self.prefix_caching!r} must be True or False")
        if self.prefix_caching and not (self.kv_cache and self.paged):
            raise ValueError(f"prefix_caching=True needs kv_cache=True and paged=True (got kv_cache={self.kv_cache}, "
                             f"paged={self.paged}): cached blocks are shared through paged block tables")

        need(self.speculative in (None,) + SPECULATIVE_METHODS,
             f"speculative={self.speculative!r} is not one of {(None,) + SPECULATIVE_METHODS}")
        need(isinstance(self.num_speculative_tokens, int) and not isinstance(self.num_speculative_tokens, bool)
             and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"num_speculative_tokens={self.num_speculative_tokens!r} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        need(self.draft_num_layers is None or (isinstance(self.draft_num_layers, int)
                                                and not isinstance(self.draft_num_layers, bool)
                                                and self.draft_num_layers >= 1),
             f"draft_num_layers={self.draft_num_layers!r} must be None or an integer >= 1")
        need(self.draft_model is None or (isinstance(self.draft_model, str) and self.draft_model != ""),
             f"draft_model={self.draft_model!r} must be None or a model path, hub id or 'random:<preset>'")
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative='draft' needs draft_model=<a smaller model sharing the target's tokenizer>, "
                             "e.g. SmolLM2-135M drafting for SmolLM2-1.7B")
        if self.draft_model is not None and self.speculative != "draft":
            raise ValueError(f"draft_model={self.draft_model!r} is only used with speculative='draft' "
                             f"(got speculative={self.speculative!r})")
        need(isinstance(self.enable_lora, bool), f"enable_lora={self.enable_lora!r} must be True or False")
        need(isinstance(self.max_loras, int) and not isinstance(self.max_loras, bool)
             and 1 <= self.max_loras <= MAX_LORAS,
             f"max_loras={self.max_loras!r} must be an integer in [1, {MAX_LORAS}]")
        need(isinstance(self.max_lora_rank, int) and not isinstance(self.max_lora_rank, bool)
             and 1 <= self.max_lora_rank <= MAX_LORA_RANK,
             f"max_lora_rank={self.max_lora_rank!r} must be an integer in [1, {MAX_LORA_RANK}]")
        if self.enable_lora and self.speculative is not None:
            raise ValueError(f"enable_lora=True with speculative={self.speculative!r}: not supported yet (the proposers "
                             "do not apply the adapters); use speculative=None")
        if self.enable_lora and self.cuda_graphs:
            raise ValueError("enable_lora=True with cuda_graphs=True: not supported yet (the captured decode step has "
                             "no adapter slots); use cuda_graphs=False")
        tp = self.tensor_parallel_size
        need(isinstance(tp, int) and not isinstance(tp, bool) and 1 <= tp <= MAX_TENSOR_PARALLEL,
             f"tensor_parallel_size={tp!r} must be an integer in [1, {MAX_TENSOR_PARALLEL}]")
        for name, on, why in (("speculative", self.speculative is not None, "the proposers run one unsharded model"),
                              ("enable_lora", self.enable_lora, "the adapter deltas are not sharded"),
                              ("cuda_graphs", self.cuda_graphs, "a captured step cannot broadcast to the other ranks"),
                              ("weight_calibration", self.weight_calibration is not None,
                               "calibration runs the whole model; shards are quantized round-to-nearest")):
            if tp > 1 and on:
                raise ValueError(f"tensor_parallel_size={tp} with {name}={getattr(self, name)!r}: not supported yet "
                                 f"({why}); use tensor_parallel_size=1 or turn {name} off")
        if self.speculative is not None and not self.kv_cache:
            raise ValueError(f"speculative={self.speculative!r} needs kv_cache=True: the target scores the proposals "
                             "as a short chunk on top of the cached sequence")
