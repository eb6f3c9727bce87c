"""The physical floor: the least time any engine needs for a workload on this machine,
from the bytes it must move at the bandwidth measured here, or the arithmetic it must do
at the matmul rate measured here, whichever is longer.

The bytes: every decode step reads every weight a token uses once (all requests decode
together, so there are max(output_len) steps), and each generated token reads the K/V of
its whole context once. The arithmetic: 2 FLOPs per weight per token through the decoder
layers, 2 per LM-head weight per generated token (no engine needs the logits of prompt
tokens), and the attention's 4 per (query, key) pair, head and layer.
"""

import json
import os
import platform

from benchmarks.workload import CACHE_DIR, Workload, repeated_time

MEANINGFUL_FLOOR_S = 0.01
# the fastest rates measured on each machine (see `fastest_seen`)
RATES_FILE = os.path.join(CACHE_DIR, "device-rates.json")


def model_shape(model: str) -> dict:
    """What the floor needs of a checkpoint: the weights a token runs through
    (`active_params`; `lm_head_params` of them in the LM head), and the K/V elements and
    attention FLOPs of a token."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = (
        c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
        + c.num_attention_heads * head_dim * c.hidden_size
    )
    # a token of a mixture of experts runs (and a step reads) its top_k experts at least
    # (the floor counts every layer sparse)
    active = getattr(c, "num_experts_per_tok", None) or 1
    mlp = (
        3
        * c.hidden_size
        * (getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    )
    lm_head = c.vocab_size * c.hidden_size
    return dict(
        active_params=c.num_hidden_layers * (attention + active * mlp) + lm_head,
        lm_head_params=lm_head,
        vocab_size=c.vocab_size,
        quantization=getattr(c, "quantization_config", None),
        kv_elements_per_token=2
        * c.num_hidden_layers
        * c.num_key_value_heads
        * head_dim,
        attention_flops_per_pair=4
        * c.num_hidden_layers
        * c.num_attention_heads
        * head_dim,
    )


def weight_bytes(shape: dict, dtype_bytes: int, on_gpu: bool) -> float:
    """The bytes of the weights a token runs through as nanopaged keeps them (see
    nanopaged/quantization/): on a GPU, AWQ and GPTQ projections 4-bit (half a byte, and
    a float16 scale and a uint8 zero point per group of inputs), FP8 ones with a scale
    per channel or tensor and dynamic activations in a bfloat16 model one byte; all
    else, and everything on a CPU, dequantized to the model's dtype."""
    projections = shape["active_params"] - shape["lm_head_params"]
    quant = shape.get("quantization") or {}
    method = quant.get("quant_method")
    per_weight = dtype_bytes
    if on_gpu and method in ("awq", "gptq"):
        # -1: one group, ~0.5
        per_weight = 0.5 + 3 / max(quant.get("group_size", 128), 1)
    elif on_gpu and dtype_bytes == 2 and method in ("fp8", "compressed-tensors"):
        group = next(iter((quant.get("config_groups") or {"": {}}).values()))
        blocks = (
            quant.get("weight_block_size")
            or (group.get("weights") or {}).get("strategy") == "block"
        )
        static = quant.get("activation_scheme") == "static" or not (
            group.get("input_activations") or {"dynamic": True}
        ).get("dynamic", False)
        per_weight = dtype_bytes if blocks or static else 1
    return projections * per_weight + shape["lm_head_params"] * dtype_bytes


def engine_dtype(model: str) -> "torch.dtype":  # noqa: F821 (torch is imported when called)
    """The dtype nanopaged (and the transformers peers) run the model in here."""
    import torch

    if not torch.cuda.is_available():
        return torch.float32
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model), "dtype", None) or torch.bfloat16


def measure_device(dtype: "torch.dtype") -> dict:  # noqa: F821
    """Copy bandwidth (bytes read + written) and the matmul rate in `dtype`, measured
    here (or faster ones measured here before: `fastest_seen`); on a CPU, the faster of
    torch's matmul and oneDNN's (which nanopaged's CPU backend uses)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 1 << 28 if device == "cuda" else 1 << 24
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    # the fastest run: the machine's rates, which a slow moment here must not lower (a
    # lower rate is a longer floor, and every engine would look closer to it)
    copy_time = repeated_time(lambda: dst.copy_(src), pick=min)
    size = 8192 if device == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    mm_time = repeated_time(lambda: a @ b, pick=min)
    if device == "cpu" and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        mm_time = min(
            mm_time,
            repeated_time(
                lambda: torch.ops.mkldnn._linear_pointwise(
                    a, packed, None, "none", [None], ""
                ),
                pick=min,
            ),
        )
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    # the threads nanopaged's CPU backend runs with (see nanopaged/cpu/__init__.py)
    if device == "cpu":
        from nanopaged.cpu import usable_cores

        name += f", {min(torch.get_num_threads(), usable_cores())} threads"
    return fastest_seen(
        dict(
            device=name,
            gpu=device == "cuda",
            dtype=str(dtype).removeprefix("torch."),
            bandwidth=2 * src.nbytes / copy_time,
            flops=2 * size**3 / mm_time,
        )
    )


def fastest_seen(device: dict) -> dict:
    """`device` with each rate the fastest this machine has shown: this run's, or an
    earlier run's kept in RATES_FILE. A slow spell on a shared machine can last longer
    than a measurement (seen here: the matmul rate at half from one run to the next),
    and must not lengthen the floor either: so a floor is the same from run to run."""
    key = f"{platform.node()}: {device['device']}, {device['dtype']}"
    try:
        with open(RATES_FILE) as f:
            seen = json.load(f)
    except (OSError, ValueError):
        seen = {}
    best = seen.get(key, {})
    device = dict(
        device,
        **{
            rate: max(device[rate], best.get(rate, 0))
            for rate in ("bandwidth", "flops")
        },
    )
    seen[key] = {rate: device[rate] for rate in ("bandwidth", "flops")}
    os.makedirs(os.path.dirname(RATES_FILE), exist_ok=True)
    with open(RATES_FILE, "w") as f:
        json.dump(seen, f, indent=1)
    return device


def physical_floor(
    shape: dict, work: Workload, device: dict, dtype_bytes: int, kv_dtype_bytes: int
) -> dict:
    """The least time any engine needs for `work` (see the module's docstring), its K/V
    `kv_dtype_bytes` an element."""
    steps = max(work.output_lens)
    weights = weight_bytes(shape, dtype_bytes, device["gpu"]) * steps
    decode_pairs = sum(
        len(prompt) * n + n * (n - 1) // 2
        for prompt, n in zip(work.prompts, work.output_lens)
    )
    prefill_pairs = sum(len(p) * (len(p) + 1) // 2 for p in work.prompts)
    kv_bytes = decode_pairs * shape["kv_elements_per_token"] * kv_dtype_bytes
    tokens = sum(len(p) for p in work.prompts) + sum(work.output_lens)
    decoder_params = shape["active_params"] - shape["lm_head_params"]
    flops = (
        2 * decoder_params * tokens
        + 2 * shape["lm_head_params"] * sum(work.output_lens)
        + shape["attention_flops_per_pair"] * (decode_pairs + prefill_pairs)
    )
    seconds = max((weights + kv_bytes) / device["bandwidth"], flops / device["flops"])
    return dict(weight_bytes=weights, kv_bytes=kv_bytes, flops=flops, seconds=seconds)


def share_of_floor(floor_seconds: float, seconds: float) -> str:
    """How close a measured time is to its floor. A floor cannot be beaten: a time under
    it means the floor's model of the work (or of the device) is wrong, and says so. A
    floor too small to mean anything (under 10 ms, or under 1% of the time) is not
    shown."""
    if seconds < floor_seconds:
        return "under the floor: the floor model is wrong here"
    if floor_seconds < MEANINGFUL_FLOOR_S or floor_seconds < seconds / 100:
        return ""
    return f"{100 * floor_seconds / seconds:.0f}% of the floor"
