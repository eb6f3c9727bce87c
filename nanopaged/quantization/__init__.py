"""Quantized checkpoints: each format in its own file, which `features.py` enters in
the core's `loader.QUANTIZATIONS` under the `quant_method` of the checkpoint's
`quantization_config`.

- fp8.py: `"fp8"` (block-wise e4m3 with `weight_scale_inv`, or one scale per tensor)
- compressed_tensors.py: `"compressed-tensors"` FP8 (per channel, per tensor or
  block-wise)
- awq.py: `"awq"` 4-bit GEMM layout, group scales and zero points
- gptq.py: `"gptq"` 4-bit, symmetric or not, without `desc_act`
- int4_triton.py: the GPU's 4-bit GEMM of both (the weight kept 4-bit)
(fp8.py's `Fp8ScaledMM` is the GPU's FP8 GEMM: `torch._scaled_mm`)

Each loads the checkpoint's tensors as they are stored (tensor-parallel shards and fused
q/k/v, gate/up parts placed by the core's loader from the dims their parameters
declare), then dequantizes them once into the float weight the device's own linear
method multiplies (dequantize.py); on a GPU the 4-bit formats stay 4-bit and FP8 ones
(per channel or tensor, dynamic activations) FP8 instead."""
