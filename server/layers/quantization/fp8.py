"""FP8 (e4m3) linear layers, vLLM's ``--quantization fp8`` on a float checkpoint: weights quantized as
they load, activations quantized per token at run time (W8A8, dynamic scales).

Format (server/layers/quantization/per_channel.py): ``layer.weight`` float8_e4m3fn ``[out_features,
in_features]`` and ``layer.weight_scale`` float32 ``[out_features]``, ``weight_scale[n] = max|W[n]| / 448``
(``reference.quantize_fp8_rows``). Half a 16-bit weight's bytes, as int8, but
the product runs on the FP8 tensor cores: the backend's ``fp8_matmul`` (cuBLASLt through
``torch._scaled_mm`` on a Hopper GPU, kernels/fp8_matmul.py; the torch reference elsewhere).
"""

from __future__ import annotations

from pagedserve.kernels.reference import FP8_KV_DTYPE, quantize_fp8_rows
from pagedserve.server.layers.quantization.per_channel import PerChannelLinearMethod, ScaledMatmul


class Fp8LinearMethod(PerChannelLinearMethod):
    weight_dtype = FP8_KV_DTYPE
    quantizes_head = False  # as vLLM's fp8: the head's logits keep the model dtype

    def __init__(self, matmul: ScaledMatmul) -> None:
        super().__init__(matmul, quantize_fp8_rows)
