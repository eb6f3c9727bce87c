"""FP8 checkpoints in the compressed-tensors format (`quant_method:
"compressed-tensors"`, `format: "float-quantized"`), as llm-compressor writes them for
vLLM. One config group quantizes every projection (`targets: ["Linear"]`): `weights`
float, 8 bits, symmetric, with a float32 `weight_scale` per output channel (out, 1), per
tensor (1,), or per block (`strategy: "block"`, `block_structure: [bn, bk]`);
`input_activations`, if any, 8-bit float per token or per tensor (dynamic, or static
with an `input_scale`). The stored layout is fp8.py's, and so is the computation (FP8
GEMMs on a GPU that has them, else the weight dequantized once loaded)."""

from nanopaged.core.layers import LinearMethod
from nanopaged.quantization.dequantize import check_keys, check_skipped
from nanopaged.quantization.fp8 import Fp8Linear

METHOD = "compressed-tensors"


def compressed_tensors_method(config: dict, dense: LinearMethod) -> Fp8Linear:
    check_keys(
        METHOD, config, {"format": ["float-quantized"], "kv_cache_scheme": [None]}
    )
    check_skipped("ignore", config.get("ignore"))
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(
            f"the checkpoint's {METHOD} config has {len(groups)} config_groups; "
            f"nanopaged implements one, quantizing every projection"
        )
    group = groups[0]
    check_keys(METHOD, group, {"targets": [["Linear"]], "output_activations": [None]})
    weights = group.get("weights") or {}
    check_keys(
        METHOD,
        weights,
        {
            "num_bits": [8],
            "type": ["float"],
            "symmetric": [True],
            "strategy": ["channel", "tensor", "block"],
            "dynamic": [False],
            "actorder": [None],
        },
    )
    block = weights.get("block_structure") if weights["strategy"] == "block" else None
    if weights["strategy"] == "block" and not (
        isinstance(block, list) and len(block) == 2
    ):
        raise ValueError(
            f"the checkpoint's {METHOD} block strategy needs block_structure "
            f"[rows, columns], got {block!r}"
        )
    inputs = group.get("input_activations")
    if inputs is not None:
        check_keys(
            METHOD,
            inputs,
            {
                "num_bits": [8],
                "type": ["float"],
                "strategy": ["token", "tensor", "group"],
            },
        )
    static = inputs is not None and not inputs.get("dynamic", False)
    return Fp8Linear(dense, "weight_scale", block, static)
