"""Where int4 g128 learned rounding loses perplexity: each matrix type, and each layer, put back in float.

Builds (or reads from the cache) weight_calibration="autoround" at group 128, writes its stored
weights (the int4 levels times scale plus zero, divided by the input scale) into the fp32 model,
and scores the first 8 corpus windows with every matrix int4, then with one matrix type or one
layer restored to float, then with only one type in int4:

    .venv/bin/python scripts/int4_sensitivity.py

(Simulated in fp32 with the fp32 head, so about 1 point under the lever's own int4 kernels with
the int8 head. 2026-11-30, before the lever rotated down_proj's input: all int4 +9.88%; down_proj
alone +8.37%, restoring it -4.43 points; restoring qkv_proj or o_proj alone makes it worse, as
the layers' rounding was learned together; no layer above 1.5 points, the last the largest.
That is one calibration: two builds of one recipe differed by about 2 points.
docs/notes/performance-history.md.)
"""

from __future__ import annotations

import torch

from minillm import LLM
from minillm.bench.quality import corpus_token_ids, perplexity
from minillm.models.quantize import LAYER_LINEARS, autoround_calibration, rotate_down_proj, rotation_block
from minillm.quant.int4 import dequantize_int4

WINDOWS = 8


def main() -> None:
    llm = LLM()
    model = rotate_down_proj(llm.engine.model, rotation_block(llm.engine.model, 128))   # as the lever does
    scales, parts = autoround_calibration(model, llm.tokenizer, 128)   # the lever's own, cached
    corpus = corpus_token_ids(llm.tokenizer)
    linear = {f"layers.{i}.{name}": getattr(layer, name) for i, layer in enumerate(model.layers) for name in LAYER_LINEARS}
    keys = list(linear)
    float_w = {key: linear[key].weight.detach().clone() for key in keys}
    int4_w = {key: (dequantize_int4(*parts[key])[:, :float_w[key].shape[1]] / scales[key].float()).to(float_w[key].dtype)
              for key in keys}

    def score(int4_keys) -> float:
        with torch.no_grad():
            for key in keys:
                linear[key].weight.copy_(int4_w[key] if key in int4_keys else float_w[key])
        return perplexity(llm, corpus, max_windows=WINDOWS, progress=False).perplexity

    base, full = score(set()), score(set(keys))

    def show(label: str, p: float) -> None:
        print(f"{label:<28}{p:>9.3f}{100 * (p / base - 1):>+9.2f}%{100 * (full - p) / base:>+9.2f}")

    print(f"{'setting':<28}{'ppl':>9}{'vs fp32':>10}{'gain':>9}   (gain: points of the increase won back)")
    show("fp32", base)
    show("all int4", full)
    for name in LAYER_LINEARS:
        show(f"restore {name}", score({k for k in keys if not k.endswith(name)}))
    for name in LAYER_LINEARS:
        show(f"only {name} int4", score({k for k in keys if k.endswith(name)}))
    for i in range(len(model.layers)):
        show(f"restore layer {i}", score({k for k in keys if not k.startswith(f"layers.{i}.")}))


if __name__ == "__main__":
    main()
