"""Memory accounting: weight bytes, KV bytes per token, and how many sequences fit in a budget.

Pure functions of a ModelConfig (no weights are loaded), so the same table covers the default
model and an 8B shape. The weight bytes follow exactly what the engine stores and counts
(minillm.quant.linear.weight_bytes after minillm.models.quantize.quantize_model):

- float settings: every parameter once (a tied head is the embedding) at 4 (fp32) or 2 bytes;
- int8 / fp8: each decoder matrix [N, K] as N * K one-byte values + N fp32 scales;
- int4, group g: K padded up to a multiple of g, N * K_pad / 2 bytes (two weights per byte)
  + a 16-bit scale and a 16-bit zero per group: 4 * N * K_pad / g bytes;
- the lm_head in its own dtype (head_dtype_for: int8 under int4, else the weight dtype; an int4
  head in groups of 32, HEAD_INT4_GROUP_SIZE). A tied
  embedding (SmolLM2) is then looked up in the quantized head's storage and not kept apart:
  the matrix is counted once. An untied model keeps its embedding table in the float dtype.
  The norms and any biases stay in the float dtype too (the rotary tables are buffers computed
  at load time and are not counted).

KV bytes per token: 2 (K and V) * layers * kv_heads * head_dim * bytes in the model dtype; int8
and fp8 KV store one byte per value plus one fp32 scale per token and KV head:
2 * layers * kv_heads * (head_dim + 4).

Sequences that fit: floor((budget - weight bytes) / (seq_len * KV bytes per token)). Activations,
the CUDA context and block rounding of the paged pool are not counted: this is the upper bound
the weights and the cache alone allow.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.config import ModelConfig
from ..models.quantize import HEAD_INT4_GROUP_SIZE, head_dtype_for
from ..quant.linear import quantized_matrix_bytes  # the formula QuantizedLinear.quantized_bytes uses

FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# label -> (float dtype of the unquantized tensors or None for the base dtype, weight_dtype, group size)
WEIGHT_SETTINGS: dict[str, tuple[str | None, str | None, int]] = {
    "fp32": ("float32", None, 128),
    "bf16": ("bfloat16", None, 128),
    "int8": (None, "int8", 128),
    "int4-g32": (None, "int4", 32),
    "int4-g64": (None, "int4", 64),
    "int4-g128": (None, "int4", 128),
    "int4-head4": (None, "int4", 128),   # group 128, the lm_head int4 too (groups of 32)
    "fp8": (None, "fp8", 128),
}
SETTING_HEADS = {"int4-head4": "int4"}  # label -> weight_head_dtype (others: "auto")
KV_DTYPES = ("model", "int8", "fp8")   # "model": the setting's float dtype
KV_SCALE_BYTES = 4                      # one fp32 scale per token and KV head (K and V each)


def decoder_matrices(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """One layer's Linears as the engine holds them (fused qkv and gate_up): (out, in, bias numel)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [
        (q + 2 * kv, h, q + 2 * kv if cfg.qkv_bias else 0),   # qkv_proj
        (h, q, h if cfg.o_bias else 0),                       # o_proj
        (2 * i, h, 2 * i if cfg.mlp_bias else 0),             # gate_up_proj
        (h, i, h if cfg.mlp_bias else 0),                     # down_proj
    ]


def weight_bytes(cfg: ModelConfig, weight_dtype: str | None = None, group_size: int = 128,
                 float_dtype: str = "bfloat16", head_dtype: str = "auto") -> int:
    """The model's stored weight bytes under weight_dtype (None: every parameter in float_dtype).

    float_dtype: the dtype of what stays unquantized (embedding, norms, biases, a float head).
    head_dtype: the weight_head_dtype rule (minillm.models.quantize.head_dtype_for)."""
    if float_dtype not in FLOAT_BYTES:
        raise ValueError(f"float_dtype={float_dtype!r} is not one of {tuple(FLOAT_BYTES)}")
    fb = FLOAT_BYTES[float_dtype]
    if weight_dtype in (None, "auto"):
        return cfg.num_params * fb
    h, v = cfg.hidden_size, cfg.vocab_size
    per_layer = 2 * h * fb  # input and post-attention RMSNorm weights
    for n, k, bias in decoder_matrices(cfg):
        per_layer += quantized_matrix_bytes(n, k, weight_dtype, group_size) + bias * fb
    total = cfg.num_layers * per_layer + h * fb  # + the final norm
    embedding = 0 if cfg.tie_word_embeddings else v * h * fb  # tied: the head's storage serves the lookup
    head = head_dtype_for(weight_dtype, head_dtype)
    if head is None:
        return total + v * h * fb + embedding  # a float head (tied: the embedding table itself)
    head_group = HEAD_INT4_GROUP_SIZE if head == "int4" else group_size
    return total + quantized_matrix_bytes(v, h, head, head_group) + embedding


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "model", float_dtype: str = "bfloat16") -> int:
    """K and V bytes per token over every layer and KV head."""
    if kv_dtype in ("model", None, "auto"):
        if float_dtype not in FLOAT_BYTES:
            raise ValueError(f"float_dtype={float_dtype!r} is not one of {tuple(FLOAT_BYTES)}")
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * FLOAT_BYTES[float_dtype]
    if kv_dtype in ("int8", "fp8"):
        return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + KV_SCALE_BYTES)
    raise ValueError(f"kv_dtype={kv_dtype!r} is not one of {KV_DTYPES}")


def sequences_that_fit(budget_bytes: float, weight_bytes_: int, kv_per_token: int, seq_len: int) -> int:
    """floor((budget - weights) / (seq_len * KV bytes per token)); 0 when the weights alone do not fit."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be an integer >= 1")
    if budget_bytes <= 0:
        raise ValueError(f"budget={budget_bytes!r} bytes must be > 0")
    free = budget_bytes - weight_bytes_
    return max(0, int(free // (seq_len * kv_per_token)))


@dataclass
class MemoryRow:
    setting: str
    float_dtype: str
    weight_dtype: str | None
    group_size: int | None
    head: str                       # what the lm_head is stored as
    weight_bytes: int
    kv_bytes_per_token: dict        # kv dtype -> bytes
    sequences: dict                 # kv dtype -> sequences of seq_len that fit in the budget


def memory_table(cfg: ModelConfig, budget_bytes: float, seq_len: int, base_dtype: str = "bfloat16",
                 settings: tuple[str, ...] = tuple(WEIGHT_SETTINGS)) -> list[MemoryRow]:
    """One row per weight setting; each with every KV dtype. base_dtype: the float dtype of the
    unquantized tensors in the quantized settings (and of their model-dtype KV cache)."""
    rows = []
    for label in settings:
        if label not in WEIGHT_SETTINGS:
            raise ValueError(f"setting {label!r} is not one of {tuple(WEIGHT_SETTINGS)}")
        float_dtype, wd, group = WEIGHT_SETTINGS[label]
        float_dtype = float_dtype or base_dtype
        head_choice = SETTING_HEADS.get(label, "auto")
        wb = weight_bytes(cfg, wd, group, float_dtype, head_choice)
        head = head_dtype_for(wd, head_choice) or float_dtype
        kv = {k: kv_bytes_per_token(cfg, k, float_dtype) for k in KV_DTYPES}
        rows.append(MemoryRow(label, float_dtype, wd, group if wd == "int4" else None, head, wb, kv,
                              {k: sequences_that_fit(budget_bytes, wb, kv[k], seq_len) for k in KV_DTYPES}))
    return rows


def format_memory(name: str, cfg: ModelConfig, rows: list[MemoryRow], budget_bytes: float, seq_len: int) -> str:
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
    lines = [
        f"{name}: {cfg.num_params / 1e6:,.0f}M parameters, {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x "
        f"{cfg.head_dim}, vocab {cfg.vocab_size}, head {'tied' if cfg.tie_word_embeddings else 'untied'}; "
        f"budget {budget_bytes / 1e9:g} GB, sequences of {seq_len} tokens",
    ]
    head = (f"{'setting':<11}{'rest':>6}{'lm_head':>9}{'weights MB':>12}"
            f"{'KV B/tok model':>16}{'int8':>7}{'fp8':>7}{'seqs: model KV':>16}{'int8 KV':>9}{'fp8 KV':>8}")
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.setting:<11}{short[r.float_dtype]:>6}{short.get(r.head, r.head):>9}{r.weight_bytes / 1e6:>12.1f}"
            f"{r.kv_bytes_per_token['model']:>16d}{r.kv_bytes_per_token['int8']:>7d}{r.kv_bytes_per_token['fp8']:>7d}"
            f"{r.sequences['model']:>16d}{r.sequences['int8']:>9d}{r.sequences['fp8']:>8d}")
    return "\n".join(lines)


def plot_memory(tables: dict[str, tuple[ModelConfig, list[MemoryRow]]], path: str, budget_bytes: float,
                seq_len: int, base_dtype: str = "bfloat16") -> str:
    """Per model: weight GB per setting (bars) and sequences of seq_len that fit vs the budget
    (lines: model-dtype KV solid, int8 KV dashed). Writes a PNG to `path` and returns it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'minillm[lab]' (or pip install matplotlib)") from exc
    fig, axes = plt.subplots(len(tables), 2, figsize=(12, 4.2 * len(tables)), squeeze=False)
    for (name, (cfg, rows)), (ax_w, ax_s) in zip(tables.items(), axes):
        labels = [r.setting for r in rows]
        ax_w.bar(labels, [r.weight_bytes / 1e9 for r in rows], color="tab:blue")
        ax_w.set_ylabel("weight GB")
        ax_w.set_title(f"{name}: weights per setting")
        ax_w.tick_params(axis="x", rotation=30)
        top = max(budget_bytes, 2 * max(r.weight_bytes for r in rows))
        budgets = [top * j / 200 for j in range(1, 201)]
        for r, color in zip(rows, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2):
            for kv, style in (("model", "-"), ("int8", "--")):
                ys = [sequences_that_fit(b, r.weight_bytes, r.kv_bytes_per_token[kv], seq_len) for b in budgets]
                ax_s.plot([b / 1e9 for b in budgets], ys, style, color=color,
                          label=f"{r.setting}" + (" (int8 KV)" if kv == "int8" else ""))
        ax_s.axvline(budget_bytes / 1e9, color="grey", lw=0.8)
        ax_s.set_xlabel("memory budget GB")
        ax_s.set_ylabel(f"sequences of {seq_len} tokens")
        ax_s.set_title(f"{name}: sequences that fit (dashed: int8 KV)")
        ax_s.legend(fontsize=7, ncol=2)
    fig.suptitle(f"weights + KV cache only; quantized settings keep embedding and norms in {base_dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
