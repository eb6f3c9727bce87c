"""Quantized checkpoints (nanopaged/quantization/): tiny random ones written in each
format's published layout by the code below, loaded by nanopaged and compared with
transformers. FP8 block-wise checkpoints are read by transformers itself (its own
dequantization), and compressed-tensors ones by transformers with the compressed-tensors
library (decompressed: `run_compressed=False`); AWQ, GPTQ and per-tensor FP8 ones are
compared with a float checkpoint of the weights the format defines, which transformers
runs. Greedy tokens must be equal, alone and on 2 ranks; a malformed checkpoint or a
config asking for what is not implemented is a ValueError naming it."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import TINY, random_prompts
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanopaged import LLM, SamplingParams
from nanopaged.random_checkpoint import write_random_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12)
# wide enough for groups of 64 and 128 and FP8 blocks of 64 on 2 ranks
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    head_dim=64,
    num_attention_heads=4,
    num_key_value_heads=2,
)
PROJECTION = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight$")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# AutoAWQ's: the word's value i is output AWQ_ORDER[i]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_rows(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """int32 words of eight 4-bit values along the last dim: value i at bits 4i is
    column order[i] of its eight (AutoAWQ's and AutoGPTQ's pack loops)."""
    values = values.numpy().astype(np.uint32)
    words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for i, column in enumerate(order):
        words |= values[:, column::8] << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


def fp8_block(w: torch.Tensor, block: int) -> tuple[dict, torch.Tensor]:
    out_f, in_f = w.shape
    blocks = w.reshape(out_f // block, block, in_f // block, block)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).reshape(out_f, in_f)
    return {"weight": q.reshape(out_f, in_f), "weight_scale_inv": scale}, deq


def fp8_rows(w: torch.Tensor, per_channel: bool) -> tuple[dict, torch.Tensor]:
    scale = (
        w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
    ) / FP8_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    stored = scale if per_channel else scale.reshape(())
    return {"weight": q, "weight_scale": stored}, q.float() * scale


def int4_groups(w: torch.Tensor, group: int, sym: bool):
    """w (out, in) as 4-bit values, zero points and float16 scales per `group` inputs:
    (in, out) values, (groups, out) zeros and scales, and the weight they stand for
    (out, in)."""
    groups = w.t().reshape(-1, group, w.shape[0])  # (groups, group, out)
    low, high = groups.amin(dim=1), groups.amax(dim=1)
    if sym:
        scale = 2 * torch.maximum(low.abs(), high.abs()) / 15
        zero = torch.full_like(scale, 8)
    else:  # zero points 1..15: AutoGPTQ's stored zero - 1 corrupts its neighbours at 0
        scale = (high - low) / 14
        zero = (1 - low / scale).round().clamp(1, 15)
    scale = scale.half().float()
    q = (groups / scale[:, None] + zero[:, None]).round().clamp(0, 15)
    deq = ((q - zero[:, None]) * scale[:, None]).reshape(-1, w.shape[0]).t()
    return q.reshape(-1, w.shape[0]).int(), zero.int(), scale.half(), deq


def awq(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    q, zero, scale, deq = int4_groups(w, group, sym=False)
    return {
        "qweight": pack_rows(q, AWQ_ORDER),
        "qzeros": pack_rows(zero, AWQ_ORDER),
        "scales": scale,
    }, deq


def gptq(
    w: torch.Tensor, group: int, sym: bool, v2: bool = False
) -> tuple[dict, torch.Tensor]:
    q, zero, scale, deq = int4_groups(w, group, sym)
    stored_zero = zero if v2 else (zero - 1) & 0xF
    return {
        "qweight": pack_rows(q.t().contiguous()).t().contiguous(),
        "qzeros": pack_rows(stored_zero),
        "scales": scale,
        "g_idx": (torch.arange(w.shape[1]) // group).int(),
    }, deq


FORMATS = {  # name -> (quantization_config, quantize one projection's weight)
    "fp8-block": (
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [64, 64],
        },
        lambda w: fp8_block(w, 64),
    ),
    "fp8-tensor": (
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        lambda w: fp8_rows(w, per_channel=False),
    ),
    "compressed-tensors": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "channel",
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
        },
        lambda w: fp8_rows(w, per_channel=True),
    ),
    "awq": (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 64,
            "zero_point": True,
            "version": "gemm",
        },
        lambda w: awq(w, 64),
    ),
    "gptq": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 64,
            "desc_act": False,
            "sym": False,
        },
        lambda w: gptq(w, 64, sym=False),
    ),
    "gptq-v2-sym": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq_v2",
        },
        lambda w: gptq(w, 128, sym=True, v2=True),
    ),
}


def transformers_greedy(path: str, fmt: str) -> list[list[int]]:
    """transformers' greedy tokens: its own reading of the quantized checkpoint where it
    has one without GPU kernels, else of the float checkpoint beside it."""
    options = {}
    if fmt == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        options["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    elif fmt != "fp8-block":
        path += "-float"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options)
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False
            )[0, len(p) :].tolist()
            for p in prompts()
        ]


def write_quantized(base: str, path: str, fmt: str, edit=None) -> str:
    """The checkpoint at `base` with its projections in format `fmt` at `path`, and a
    float checkpoint of the weights they stand for at `path`-float. `edit(tensors)` may
    break it."""
    config, quantize = FORMATS[fmt]
    tensors = load_file(os.path.join(base, "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if PROJECTION.match(name):
            parts, deq = quantize(tensor)
            prefix = name.removesuffix("weight")
            quantized.update({prefix + key: value for key, value in parts.items()})
            dequantized[name] = deq
        else:
            quantized[name] = dequantized[name] = tensor
    if edit:
        edit(quantized)
    for target, weights, quant in (
        (path, quantized, config),
        (path + "-float", dequantized, None),
    ):
        shutil.copytree(base, target, dirs_exist_ok=True)
        save_file(weights, os.path.join(target, "model.safetensors"))
        with open(os.path.join(base, "config.json")) as f:
            written = json.load(f)
        if quant:
            written["quantization_config"] = quant
        with open(os.path.join(target, "config.json"), "w") as f:
            json.dump(written, f)
    return path


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {
        arch: write_random_checkpoint(
            str(root / arch), dict(TINY[arch], **SHAPE), initializer_range=0.1
        )
        for arch in ("qwen3", "llama")
    }


def prompts():
    return random_prompts([5, 17, 40], seed=3)


def greedy(llm: LLM) -> list[list[int]]:
    return [
        o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)
    ]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_equal_transformers_on_the_weights_the_format_defines(
    fmt, arch, bases, tmp_path
):
    path = write_quantized(bases[arch], str(tmp_path / fmt), fmt)
    expected = transformers_greedy(path, fmt)
    with LLM(path, max_model_len=256) as llm:
        assert greedy(llm) == expected


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_the_4bit_kernel_gives_the_tokens_of_the_dequantized_weight(
    fmt, bases, tmp_path, monkeypatch
):
    """The GPU's path, the weight kept 4-bit and multiplied by int4_triton's kernel
    (here interpreted on CPU tensors): transformers' tokens, and no float weight left
    behind."""
    pytest.importorskip("triton")
    from nanopaged.quantization import dequantize, int4_triton

    monkeypatch.setattr(dequantize, "use_kernel", lambda qweight: True)
    path = write_quantized(bases["qwen3"], str(tmp_path / fmt), fmt)
    with LLM(path, max_model_len=256) as llm:
        assert greedy(llm) == transformers_greedy(path, fmt)
        projection = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(projection.method, int4_triton.Int4Kernel)
        assert projection.packed.dtype == torch.int32 and not hasattr(
            projection, "weight"
        )


def test_scaled_mm_quantizes_each_row_of_activations_by_its_own_scale():
    """The GPU's FP8 GEMM (run here by torch's CPU `_scaled_mm`): e4m3 activations, one
    scale a row, times the e4m3 weight and its scale per output channel."""
    from torch import nn

    from nanopaged.quantization.fp8 import FP8_MAX, Fp8ScaledMM

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    parts, _ = fp8_rows(w, per_channel=True)
    layer = nn.Module()
    layer.weight_t, layer.bias = parts["weight"].t(), torch.randn(48, generator=g)
    layer.weight_scale = parts["weight_scale"].reshape(1, -1)
    x = torch.randn(5, 64, generator=g) * torch.tensor(
        [[1e-3], [1], [10], [100], [1e3]]
    )
    scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    x_fp8 = (x / scale).to(torch.float8_e4m3fn).float() * scale
    expected = (
        x_fp8 @ (parts["weight"].float() * parts["weight_scale"]).t() + layer.bias
    )
    assert torch.allclose(Fp8ScaledMM().apply(layer, x), expected, rtol=1e-5, atol=1e-6)


def fp8_activations_reference(path: str) -> torch.nn.Module:
    """transformers on the dequantized weights, each projection's input rows quantized
    to e4m3 by their own scale first: the arithmetic the FP8 GEMM path defines."""
    model = AutoModelForCausalLM.from_pretrained(path + "-float", dtype=torch.float32)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ):

            def forward(x, linear=module):
                scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / fp8_max
                quantized = (x / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
                return torch.nn.functional.linear(
                    quantized.float() * scale, linear.weight
                )

            module.forward = forward
    return model.eval()


@pytest.mark.parametrize("fmt", ["fp8-tensor", "compressed-tensors"])
def test_the_fp8_gemm_path_computes_what_it_defines_at_every_position(
    fmt, bases, tmp_path, monkeypatch
):
    """The FP8 GEMM path (the layer kept in e4m3, each row of activations quantized by
    its own scale, `torch._scaled_mm`), here on the CPU's `_scaled_mm`: the
    log-probability of every prompt token (teacher-forced: no drift from one sampled
    token to the next) is the reference's, transformers on the dequantized weights with
    the same activation quantization, within what a flipped e4m3 rounding moves (0.06
    here; a per-tensor activation scale instead of a row's: 0.5, no activation
    quantization: 0.3). cuBLAS's FP8 GEMM itself runs only on a GPU
    (tests/test_gpu.py)."""
    from nanopaged.quantization import fp8

    monkeypatch.setattr(fp8, "use_scaled_mm", lambda layer: True)
    path = write_quantized(bases["qwen3"], str(tmp_path / fmt), fmt)
    reference = fp8_activations_reference(path)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    with LLM(path, max_model_len=256) as llm:
        projection = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert isinstance(projection.method, fp8.Fp8ScaledMM)
        assert projection.weight_t.dtype == torch.float8_e4m3fn
        outputs = llm.generate(prompts(), params, use_tqdm=False)
    for prompt, output in zip(prompts(), outputs):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt])).logits[0, :-1].float()
        want = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])
        got = [
            entry[token].logprob
            for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])
        ]
        assert torch.allclose(torch.tensor(got), want.squeeze(1), atol=0.12), (
            got,
            want,
        )


@pytest.mark.parametrize("fmt", ["fp8-block", "compressed-tensors", "awq", "gptq"])
def test_two_ranks_split_the_quantized_tensors_as_one(fmt, bases, tmp_path, hf_greedy):
    path = write_quantized(bases["qwen3"], str(tmp_path / fmt), fmt)
    with LLM(path, max_model_len=256, tensor_parallel_size=2) as llm:
        assert greedy(llm) == hf_greedy(path + "-float", prompts(), GREEDY.max_tokens)


def edit_quantization(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(
        config.get("quantization_config", {}), **changes
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def drop(suffix: str):
    return lambda tensors: tensors.pop(next(n for n in tensors if n.endswith(suffix)))


def halve(suffix: str):
    def edit(tensors):
        name = next(n for n in tensors if n.endswith(suffix))
        tensors[name] = tensors[name][: tensors[name].shape[0] // 2].contiguous()

    return edit


def poison(suffix: str, value: float):
    """One entry of the tensor named `...suffix` set to `value` (a NaN, an infinity)."""

    def edit(tensors):
        name = next(n for n in tensors if n.endswith(suffix))
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value

    return edit


def store_as(suffix: str, dtype: torch.dtype):
    """The tensor named `...suffix` stored in `dtype` (its values cast, or its bytes
    viewed where the sizes agree), as a broken converter might."""

    def edit(tensors):
        name = next(n for n in tensors if n.endswith(suffix))
        tensor = tensors[name]
        same_size = tensor.dtype.itemsize == torch.empty(0, dtype=dtype).itemsize
        tensors[name] = tensor.view(dtype) if same_size else tensor.to(dtype)

    return edit


def flatten(suffix: str):
    def edit(tensors):
        name = next(n for n in tensors if n.endswith(suffix))
        tensors[name] = tensors[name].flatten().contiguous()

    return edit


def reverse_g_idx(suffix: str):
    """One part's g_idx out of group order (as desc_act writes it), its siblings'
    unchanged: each part is checked, not only the last one loaded."""

    def edit(tensors):
        name = next(n for n in tensors if n.endswith(suffix))
        tensors[name] = tensors[name].flip(0).contiguous()

    return edit


SCALES = {
    "fp8-block": "weight_scale_inv",
    "fp8-tensor": "weight_scale",
    "compressed-tensors": "weight_scale",
    "awq": "scales",
    "gptq": "scales",
}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("fmt", list(SCALES))
def test_a_non_finite_scale_is_refused_by_name(fmt, value, bases, tmp_path):
    """A NaN or an infinity in any scale the format defines: a ValueError naming the
    tensor and its file, where it used to load and generate token 0 or garbage."""
    suffix = f"k_proj.{SCALES[fmt]}"
    path = write_quantized(
        bases["qwen3"], str(tmp_path / fmt), fmt, poison(suffix, value)
    )
    with pytest.raises(
        ValueError,
        match=rf"weight '.*{suffix}' in .*model.safetensors "
        r"holds NaN or infinities",
    ):
        LLM(path, max_model_len=256)


@pytest.mark.parametrize(
    "fmt, edit, message",
    [  # a dtype the format does not define: refused, not cast by value
        (
            "fp8-block",
            store_as("q_proj.weight", torch.int8),
            "int8, not torch.float8_e4m3fn",
        ),
        (
            "fp8-tensor",
            store_as("q_proj.weight", torch.float8_e5m2),
            "float8_e5m2, not torch.float8_e4m3fn",
        ),
        (
            "fp8-tensor",
            store_as("q_proj.weight_scale", torch.int32),
            "int32, not torch.float32",
        ),
        ("gptq", store_as("q_proj.qweight", torch.float32), "float32, not torch.int32"),
        ("awq", store_as("up_proj.qzeros", torch.float32), "float32, not torch.int32"),
        # fewer dimensions than the format's: named, not a bare IndexError
        ("fp8-block", flatten("o_proj.weight_scale_inv"), "does not fit the model"),
        (
            "gptq",
            reverse_g_idx("k_proj.g_idx"),
            r"g_idx' in .* does not put the inputs",
        ),
        (
            "gptq",
            reverse_g_idx("up_proj.g_idx"),
            r"g_idx' in .* does not put the inputs",
        ),
    ],
)
def test_a_tensor_stored_other_than_the_format_says_is_refused_by_name(
    fmt, edit, message, bases, tmp_path
):
    path = write_quantized(bases["qwen3"], str(tmp_path / fmt), fmt, edit)
    with pytest.raises(ValueError, match=r"weight '.*' in .*model.safetensors"):
        LLM(path, max_model_len=256)
    with pytest.raises(ValueError, match=message):
        LLM(path, max_model_len=256)


def test_a_plain_weight_stored_one_dimensional_is_named(qwen3_path, tmp_path):
    path = str(tmp_path / "flat")
    shutil.copytree(qwen3_path, path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = next(n for n in tensors if n.endswith("o_proj.weight"))
    tensors[name] = tensors[name].flatten().contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(
        ValueError, match=rf"weight '{name}' in .* does not fit the model"
    ):
        LLM(path, max_model_len=256)


@pytest.mark.parametrize(
    "fmt, edit, message",
    [
        (
            "fp8-block",
            drop("k_proj.weight_scale_inv"),
            r"missing weights: "
            r"model\.layers\.\d\.self_attn\.qkv_proj\.weight_scale_inv \(part k\)",
        ),
        (
            "awq",
            halve("down_proj.scales"),
            r"weight 'model\.layers\.\d\.mlp\.down_proj\.scales'.*does not fit",
        ),
        (
            "gptq",
            halve("o_proj.qzeros"),
            r"'model\.layers\.\d\.self_attn\.o_proj\.qzeros'.*does not fit",
        ),
    ],
)
def test_a_malformed_checkpoint_names_the_tensor(fmt, edit, message, bases, tmp_path):
    path = write_quantized(bases["qwen3"], str(tmp_path / fmt), fmt, edit)
    with pytest.raises(ValueError, match=message):
        LLM(path, max_model_len=256)


@pytest.mark.parametrize(
    "fmt, change, message",
    [
        ("awq", {"bits": 8}, r"awq quantization_config has bits=8"),
        ("awq", {"version": "gemv"}, r"version='gemv'"),
        ("gptq", {"desc_act": True}, r"desc_act=True"),
        ("gptq", {"checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
        ("fp8-block", {"weight_block_size": [64]}, r"weight_block_size must be"),
        (
            "fp8-block",
            {"ignored_layers": ["model.layers.0.mlp.down_proj"]},
            r"leaves 'model.layers.0.mlp.down_proj' unquantized",
        ),
        ("awq", {"group_size": 48}, r"group_size=48"),
        ("awq", {"quant_method": "exl2"}, r"quant_method='exl2'"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(
    fmt, change, message, bases, tmp_path
):
    path = write_quantized(bases["qwen3"], str(tmp_path / fmt), fmt)
    edit_quantization(path, **change)
    with pytest.raises(ValueError, match=message):
        LLM(path, max_model_len=256)


def test_a_group_size_that_does_not_divide_the_inputs_is_refused(bases, tmp_path):
    path = write_quantized(bases["qwen3"], str(tmp_path / "g"), "gptq")
    edit_quantization(path, group_size=48)
    with pytest.raises(
        ValueError, match=r"group_size=48 does not divide a projection's 128 in"
    ):
        LLM(path, max_model_len=256)


def test_quantized_experts_are_refused(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "moe"), TINY["qwen3-moe"])
    edit_quantization(path, **FORMATS["fp8-block"][0])
    with pytest.raises(ValueError, match=r"quantized experts\)='fp8'"):
        LLM(path, max_model_len=256)


# ---- an FP8 KV cache (kv_cache_dtype="fp8") ----


def test_an_fp8_kv_cache_holds_twice_the_blocks_of_a_bfloat16_one(
    qwen3_path, monkeypatch
):
    """On the same memory budget: 32 MB of RAM available, of which the pool may take a
    quarter."""
    from nanopaged.core import model_runner

    monkeypatch.setattr(model_runner, "available_memory", lambda: 32 << 20)
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")):
        with LLM(qwen3_path, dtype=dtype, kv_cache_dtype=kv, max_model_len=256) as llm:
            blocks[dtype, kv] = llm.stats().num_blocks
            assert llm.engine.runner.kv_cache.dtype == llm.config.kv_cache_dtype
    assert llm.config.kv_cache_dtype == torch.float8_e4m3fn
    assert (
        blocks["bfloat16", "fp8"]
        == 2 * blocks["bfloat16", "auto"]
        == 4 * blocks["float32", "auto"]
        > 0
    )


def test_an_fp8_kv_cache_keeps_most_greedy_tokens(qwen3_path):
    """What e4m3 K/V (3 bits of mantissa, scale 1) costs on the tiny model, against a
    bfloat16 cache (measured: the first token equal on 30 of 32 prompts, the first-token
    logprob 0.026 apart on average, 18 of 32 completions of 24 tokens identical;
    docs/quantization.md)."""
    lengths = torch.randint(
        4, 120, (32,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    prompts = random_prompts(lengths, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    runs = {}
    for kv in ("auto", "fp8"):
        with LLM(
            qwen3_path, dtype="bfloat16", kv_cache_dtype=kv, max_model_len=256
        ) as llm:
            runs[kv] = [
                o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)
            ]
    firsts = [
        (a.token_ids[0], b.token_ids[0]) for a, b in zip(runs["auto"], runs["fp8"])
    ]
    assert sum(a == b for a, b in firsts) >= 0.8 * len(prompts)
    gaps = [
        abs(
            next(iter(a.logprobs[0].values())).logprob
            - next(iter(b.logprobs[0].values())).logprob
        )
        for a, b in zip(runs["auto"], runs["fp8"])
    ]
    assert 0 < sum(gaps) / len(gaps) < 0.05  # it changes the numbers, a little


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_every_backend_reads_an_fp8_kv_cache_as_the_reference_does(backend, qwen3_path):
    """The same e4m3 K/V read by the cpu backend and the Triton kernels (interpreted
    here) give the plain PyTorch backend's tokens."""
    if backend == "triton":
        pytest.importorskip("triton")
    prompts = random_prompts([5, 40, 70], seed=6)
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = {}
    for name in ("torch", backend):
        with LLM(
            qwen3_path,
            attention_backend=name,
            kv_cache_dtype="fp8",
            max_model_len=256,
            kvcache_block_size=16,
        ) as llm:
            tokens[name] = [
                o.outputs[0].token_ids
                for o in llm.generate(prompts, params, use_tqdm=False)
            ]
    assert tokens[backend] == tokens["torch"]


def test_flash_attn_refuses_an_fp8_kv_cache(monkeypatch):
    """flash-attn reads no e4m3 cache: "auto" passes it over, asking for it is a clear
    error."""
    import importlib.util

    from nanopaged.core.attention import BACKENDS

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert (
        BACKENDS["flash"].missing(True, torch.float8_e4m3fn)
        == "a float16 or bfloat16 KV cache"
    )
    assert BACKENDS["flash"].missing(True, torch.bfloat16) is None


def test_an_unknown_kv_cache_dtype_is_refused_by_name(qwen3_path):
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', "
    ):
        LLM(qwen3_path, kv_cache_dtype="int8")
