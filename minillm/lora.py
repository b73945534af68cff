"""LoRA adapters: vLLM's LoRARequest, reading and checking a PEFT directory, and the slot table.

    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/path/to/peft/dir"))

An adapter is an ordinary PEFT directory: adapter_config.json + adapter_model.safetensors holding
`...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and `lora_B.weight` [out, r] for any subset of
q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. Its delta on a module is
scaling * (x A^T) B^T with scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora); `load_adapter`
folds the scaling into B once, so the kernels only multiply.

`LoRASlots` is the scheduler's bookkeeping, plain Python over integers like the block manager: which adapter
id sits in which of `max_loras` slots (slot 0 is "no adapter"), how many running requests use each, and the
least recently used order. The model runner copies an adapter's weights into its slot when the slot's
occupant changes (layers/lora.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .config import MAX_LORA_RANK

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """One adapter, as vLLM's: `LoRARequest(lora_name, lora_int_id, lora_path)`.

    lora_int_id identifies the adapter (>= 1, unique per adapter): requests with the same id share its slot
    and its prefix-cached blocks; different ids never share KV blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest lora_name={self.lora_name!r} must be a non-empty str")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id={self.lora_int_id!r} must be an integer >= 1 "
                             "(0 means the base model in vLLM; give no lora_request for it)")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"LoRARequest lora_path={self.lora_path!r} must be the path of a PEFT adapter directory")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return str(self.lora_path)


@dataclass(eq=False)
class LoRAAdapter:
    """A checked adapter on the host: per (layer, module) its A [r, in] and its B [out, r] with the scaling in."""

    request: LoRARequest
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of A and B as stored on disk (before padding to a slot's rank)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _refuse(request: LoRARequest, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}, {request.path}): {message}")


def read_adapter_config(request: LoRARequest) -> dict:
    path = request.path
    if not os.path.isdir(path):
        raise _refuse(request, f"the directory {path!r} does not exist (a PEFT adapter directory holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise _refuse(request, f"{CONFIG_FILE} is missing from {path!r}")
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise _refuse(request, f"{CONFIG_FILE} is not valid JSON: {exc}") from None


def load_adapter(request: LoRARequest, layer_shapes: list[dict[str, tuple[int, int]]], max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check a PEFT adapter against the base model.

    layer_shapes: per decoder layer, PEFT module name -> (out_features, in_features) of the base model's matrix
    (a mixture-of-experts layer lists no MLP modules). Refuses, naming
    the reason: a missing directory or file, a rank above max_rank, a module other than SUPPORTED_MODULES
    (embed_tokens, lm_head, modules_to_save), DoRA or trained biases, and a matrix whose shape is not the base
    model's (an adapter of another model)."""
    from safetensors import safe_open

    cfg = read_adapter_config(request)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(request, f"peft_type={cfg.get('peft_type')!r}; only LORA adapters are served")
    if cfg.get("modules_to_save"):
        raise _refuse(request, f"modules_to_save={cfg['modules_to_save']!r}: fully trained copies of modules are "
                               f"not supported; only LoRA on {SUPPORTED_MODULES}")
    if cfg.get("use_dora"):
        raise _refuse(request, "use_dora=True: DoRA adapters are not supported (plain LoRA only)")
    if cfg.get("bias", "none") != "none":
        raise _refuse(request, f"bias={cfg['bias']!r}: trained biases are not supported (bias='none' only)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise _refuse(request, "rank_pattern / alpha_pattern (a rank per module) are not supported: one r and "
                               "lora_alpha for every module")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(request, f"r={rank!r} in {CONFIG_FILE} must be an integer >= 1")
    if rank > max_rank:
        raise _refuse(request, f"rank r={rank} exceeds max_lora_rank={max_rank}; build the LLM with "
                               f"max_lora_rank >= {rank} (at most {MAX_LORA_RANK})")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    unsupported = sorted(t for t in targets if t.split(".")[-1] not in SUPPORTED_MODULES
                         and not any(t.endswith(m) for m in SUPPORTED_MODULES))
    if unsupported:
        raise _refuse(request, f"target modules {unsupported} are not supported; an adapter may target any of "
                               f"{SUPPORTED_MODULES}")
    weights_path = os.path.join(request.path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise _refuse(request, f"{WEIGHTS_FILE} is missing from {request.path!r} (save the adapter with "
                               "safe_serialization=True, PEFT's default)")
    num_layers = len(layer_shapes)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(weights_path, framework="pt") as f:
        for key in f.keys():
            match = _KEY.search(key)
            if match is None or match.group(2) not in SUPPORTED_MODULES:
                raise _refuse(request, f"weight {key!r} is not a LoRA A/B matrix of {SUPPORTED_MODULES} "
                                       "(embed_tokens, lm_head and modules_to_save are not supported)")
            layer, module, which = int(match.group(1)), match.group(2), match.group(3)
            if layer >= num_layers:
                raise _refuse(request, f"weight {key!r} is for layer {layer}, but the base model has {num_layers} "
                                       "layers (an adapter of another base model?)")
            pairs.setdefault((layer, module), {})[which] = f.get_tensor(key)
    if not pairs:
        raise _refuse(request, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        name = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise _refuse(request, f"{name} has lora_{'A' if 'A' in ab else 'B'} without its lora_"
                                   f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if module not in layer_shapes[layer]:
            raise _refuse(request, f"{name}: layer {layer} of the base model has no dense {module} (a mixture-of-"
                                   "experts layer); LoRA on experts is not supported")
        out_features, in_features = layer_shapes[layer][module]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise _refuse(request, f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                                   f"model's {module} of shape ({out_features}, {in_features}) (out, in) at r={rank}: "
                                   f"expected lora_A ({rank}, {in_features}) and lora_B ({out_features}, {rank}); "
                                   "an adapter of another base model?")
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.double() * scaling).to(dtype).contiguous())
    modules = tuple(m for m in SUPPORTED_MODULES if any(key[1] == m for key in weights))
    return LoRAAdapter(request, rank, scaling, modules, weights)


class LoRARegistry:
    """The adapters an engine has read, by lora_int_id (each read and checked once, at its first request)."""

    def __init__(self, layer_shapes: list[dict[str, tuple[int, int]]], max_rank: int, dtype: torch.dtype):
        self.layer_shapes, self.max_rank, self.dtype = layer_shapes, max_rank, dtype
        self.adapters: dict[int, LoRAAdapter] = {}
        self._lock = threading.Lock()   # a server validates requests off the engine thread

    def get(self, request: LoRARequest) -> LoRAAdapter:
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a minillm.LoRARequest or None, got {type(request).__name__}")
        with self._lock:
            known = self.adapters.get(request.lora_int_id)
            if known is not None:
                if os.path.abspath(known.request.path) != os.path.abspath(request.path):
                    raise ValueError(f"lora_int_id={request.lora_int_id} is already adapter "
                                     f"{known.request.lora_name!r} at {known.request.path}; {request.lora_name!r} at "
                                     f"{request.path} needs another id (an id names one adapter)")
                return known
            adapter = load_adapter(request, self.layer_shapes, self.max_rank, self.dtype)
            self.adapters[request.lora_int_id] = adapter
            return adapter


class LoRASlots:
    """Which adapter id occupies each of slots 1..max_loras, how many running requests use it, LRU order.

    acquire(id) -> the slot (loading is the model runner's job when `occupant` changes), or None when the
    adapter is not resident and every slot is held by running requests (the request waits)."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.occupant: list[int | None] = [None] * (max_loras + 1)   # slot -> adapter id (slot 0: none)
        self.refs = [0] * (max_loras + 1)
        self.slot_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # slots, least recently used first
        self.num_loads = 0
        self.num_evictions = 0

    def acquire(self, adapter_id: int) -> int | None:
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self.occupant[slot] = adapter_id
            self.slot_of[adapter_id] = slot
            self.num_loads += 1
        self.refs[slot] += 1
        self.lru[slot] = None
        self.lru.move_to_end(slot)
        return slot

    def _free_slot(self) -> int | None:
        for slot in range(1, self.max_loras + 1):
            if self.occupant[slot] is None:
                return slot
        for slot in self.lru:   # least recently used first, among those no running request holds
            if self.refs[slot] == 0:
                del self.slot_of[self.occupant[slot]]
                self.occupant[slot] = None
                self.num_evictions += 1
                return slot
        return None

    def release(self, slot: int) -> None:
        if not 1 <= slot <= self.max_loras or self.refs[slot] == 0:
            raise ValueError(f"LoRA slot {slot} is not held (slots 1..{self.max_loras}, refs {self.refs[1:]})")
        self.refs[slot] -= 1

    @property
    def resident(self) -> dict[int, int]:
        """adapter id -> slot, for the adapters loaded now."""
        return dict(self.slot_of)
