"""The online-softmax step shared by the attention kernels (paged decode, extend).

Flash attention never holds a whole row of scores: it walks the keys a tile at a time and
keeps, per query row, the running max of the scores, the running sum of exponentials and an
output accumulator, all in fp32. When a tile raises a row's max, everything accumulated so
far was exponentiated against the old max and is rescaled by exp2(old_max - new_max).
The scores are in log2 units (already multiplied by softmax scale * log2(e)), so exp2 is used.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_update(
    scores,    # [ROWS, TILE] fp32 scores of this key tile, log2 units; -inf where a key is not visible
    v,         # [TILE, BLOCK_D] this tile's values (model dtype; masked keys loaded as 0)
    row_max,   # [ROWS] fp32 running max (-inf before the first tile)
    row_sum,   # [ROWS] fp32 running sum of exp2(score - row_max)
    acc,       # [ROWS, BLOCK_D] fp32 running sum of exp2(score - row_max) * v
    DOT_IN_FP32: tl.constexpr,  # exact (ieee) fp32 dot: fp32 inputs (not tf32), and bf16 under the
                                # interpreter, whose tl.dot multiplies bf16's raw uint16 bits
):
    """Fold one key tile into (row_max, row_sum, acc); returns the three updated.

    The caller guarantees every row's new max is finite (some key seen so far is visible to
    it), so no exp2(-inf - -inf) = NaN can appear.
    """
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    probs = tl.math.exp2(scores - new_max[:, None])
    correction = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * correction + tl.sum(probs, axis=1)
    if DOT_IN_FP32:
        acc = acc * correction[:, None] + tl.dot(probs, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v)
    return new_max, row_sum, acc
