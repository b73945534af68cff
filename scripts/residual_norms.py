"""The attention sink in the residual stream: why AutoRound scales down the error of the largest tokens.

Runs the default model (fp32) on the first two 512-token sequences of the AutoRound calibration
text and prints, after every decoder layer, the rms of each sequence's first token (the
attention sink) against the median token's, the share of the sink's square in its largest
dimension, and the share the two sinks would take of a plain mean squared error over the 1,024
tokens if every token's error were proportional to its size:

    .venv/bin/python scripts/residual_norms.py

(On SmolLM2-135M, layers 11-27: sink rms about 960 against a median of 6-30, and a 75-98% share.
calibrate_autoround therefore divides the squared error of a token larger than the median one
by how much larger it is; docs/notes/performance-history.md has the measurement.)
"""

from __future__ import annotations

import torch

from minillm import LLM
from minillm.layers.attention import AttentionMetadata
from minillm.models.quantize import autoround_token_ids

SEQ_LEN, NUM_SEQS = 512, 2


def main() -> None:
    llm = LLM()
    model = llm.engine.model
    ids = torch.tensor(autoround_token_ids(llm.tokenizer)[:SEQ_LEN * NUM_SEQS])
    meta = AttentionMetadata(query_lens=[SEQ_LEN] * NUM_SEQS, num_cached=[0] * NUM_SEQS, slot_mapping=None,
                             use_cache=False)
    positions = torch.arange(SEQ_LEN).repeat(NUM_SEQS)
    sinks = torch.arange(NUM_SEQS) * SEQ_LEN
    print(f"{'layer':>5}{'sink rms':>10}{'median rms':>12}{'sink top dim':>14}{'its share':>11}{'sinks in MSE':>14}")
    with torch.no_grad():   # a pass without a KV pool: torch attention and ops
        hidden = model.embed_tokens(ids)
        for i, layer in enumerate(model.layers):
            hidden = layer(positions, hidden, meta)
            square = hidden.float().pow(2)
            per_token = square.mean(-1)
            sink = square[sinks[0]]
            print(f"{i:>5}{per_token[sinks[0]].sqrt():>10.1f}{per_token.median().sqrt():>12.2f}"
                  f"{int(sink.argmax()):>14}{float(sink.max() / sink.sum()):>11.2f}"
                  f"{float(per_token[sinks].sum() / per_token.sum()):>14.3f}")


if __name__ == "__main__":
    main()
