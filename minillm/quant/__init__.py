"""Weight quantizers (int8 / int4 / fp8) and the quantized linear layer.

Pure torch, no engine imports (floor 0): `quantize_*` / `dequantize_*` work on one
[out_features, in_features] matrix; `QuantizedLinear` holds one quantized matrix and runs
the fastest path this machine has; `weight_bytes` counts what a model really stores.
"""

from .fp8 import dequantize_fp8, quantize_fp8
from .int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from .int8 import dequantize_int8, quantize_int8
from .linear import GROUP_SIZES, WEIGHT_DTYPES, QuantizedLinear, weight_bytes

__all__ = [
    "GROUP_SIZES", "WEIGHT_DTYPES", "QuantizedLinear", "weight_bytes",
    "quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4", "pack_int4", "unpack_int4",
    "quantize_fp8", "dequantize_fp8",
]
