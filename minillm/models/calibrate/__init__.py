"""Weight calibrations of a whole model (the weight_calibration lever), one module per method.

Each module runs a model over calibration text and hands a per-matrix algorithm its inputs; the
algorithm itself is on floor 0, in minillm/quant/:

    awq.py        calibrate_awq: input scales and int4 clipping ranges   (quant/awq.py)
    gptq.py       calibrate_gptq: int4 with error feedback, layer by layer  (quant/gptq.py)
    autoround.py  calibrate_autoround: learned int4 rounding, layer by layer (quant/autoround.py)
    tune.py       tune_int4_grids: end-to-end tuning of int4 scales and zeros
    rotate.py     Hadamard rotations of matrices' inputs                  (quant/rotate.py)
    cache.py      calibration text, the on-disk cache, the cached recipes ("autoround", "gptq-tuned")
    common.py     what they share: matrix names, shallow_copy, calibration passes

models/quantize.py turns the levers into these calls and swaps in the quantized layers.
"""
