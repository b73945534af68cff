"""Weight quantizers (int8 / int4 / fp8) and the quantized linear layers.

Pure torch, no engine imports (floor 0): `quantize_*` / `dequantize_*` work on one
[out_features, in_features] matrix; `QuantizedLinear.from_float` builds the layer of a format
(Int8Linear / Int4Linear / Fp8Linear), which holds one quantized matrix and runs the fastest path
this machine has; `weight_bytes` counts what a model really stores.
"""

from .fp8 import dequantize_fp8, quantize_fp8
from .int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from .int8 import dequantize_int8, quantize_int8
from .linear import GROUP_SIZES, WEIGHT_DTYPES, QuantizedLinear, weight_bytes
from .linear_fp8 import Fp8Linear
from .linear_int4 import Int4Linear
from .linear_int8 import Int8Linear

__all__ = [
    "GROUP_SIZES", "WEIGHT_DTYPES", "QuantizedLinear", "Int8Linear", "Int4Linear", "Fp8Linear", "weight_bytes",
    "quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4", "pack_int4", "unpack_int4",
    "quantize_fp8", "dequantize_fp8",
]
