"""On a CUDA GPU: every available backend, eager and with CUDA graphs, against
transformers."""

import gc
import importlib.util
import sys

import pytest
import torch
from conftest import TINY, random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.random_checkpoint import TINY_QWEN3, write_random_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# head_dim 64: a size the flash-attn kernels are built for
GPU_QWEN3 = dict(
    TINY_QWEN3,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=3,
)
BACKENDS = ["torch", "triton"] + (
    ["flash"] if importlib.util.find_spec("flash_attn") else []
)
PROMPTS = random_prompts([1, 9, 33, 120, 300, 64], seed=21)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_path(tmp_path_factory) -> str:
    return write_random_checkpoint(
        str(tmp_path_factory.mktemp("gpu") / "qwen3"), GPU_QWEN3, initializer_range=0.1
    )


def run(
    path: str,
    backend: str,
    dtype: str,
    enforce_eager: bool,
    prompts=PROMPTS,
    tensor_parallel_size: int = 1,
):
    block_size = 256 if backend == "flash" else 16
    with LLM(
        path,
        dtype=dtype,
        attention_backend=backend,
        enforce_eager=enforce_eager,
        kvcache_block_size=block_size,
        max_model_len=1024,
        max_num_seqs=64,
        gpu_memory_utilization=0.3,
        tensor_parallel_size=tensor_parallel_size,
    ) as llm:
        return [
            o.outputs[0].token_ids
            for o in llm.generate(prompts, GREEDY, use_tqdm=False)
        ]


def hf_greedy(path: str, dtype: torch.dtype, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None  # as ignore_eos
    outs = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
        )
        outs.append(ids[0, len(p) :].tolist())
    return outs


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """After each test: a failed test's engine, alive in pytest's `sys.last_*`
    traceback, and any cycle freed, so that the next engine sizes its KV cache from a
    card as found."""
    yield
    sys.last_type = sys.last_value = sys.last_traceback = sys.last_exc = None
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def no_tf32():
    """float32 matmuls in full precision, as transformers' reference runs them; restored
    after."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "flash"])
def test_float32_greedy_matches_transformers(gpu_path, backend, enforce_eager, no_tf32):
    assert run(gpu_path, backend, "float32", enforce_eager) == hf_greedy(
        gpu_path, torch.float32, PROMPTS
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "flash"])
def test_two_gpus_float32_greedy_matches_transformers(gpu_path, backend, no_tf32):
    assert run(
        gpu_path, backend, "float32", False, tensor_parallel_size=2
    ) == hf_greedy(gpu_path, torch.float32, PROMPTS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_graphs_give_the_eager_tokens(gpu_path, backend):
    assert run(gpu_path, backend, "bfloat16", False) == run(
        gpu_path, backend, "bfloat16", True
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_scheduling_under_graphs_gives_the_synchronous_tokens(gpu_path, backend):
    """Step n+1 queued before n's tokens are read: its input ids taken from n's samples
    on the device, its tokens copied back without waiting for the steps after it;
    greedy and seeded, chunked prefill and preemption in the run."""
    params = [
        SamplingParams(temperature=t, max_tokens=32, ignore_eos=True, seed=i)
        for i, t in enumerate([0.0, 0.8] * 3)
    ]
    tokens = []
    for overlap in (False, True):
        llm = LLM(
            gpu_path,
            attention_backend=backend,
            dtype="float32",
            async_scheduling=overlap,
            max_num_batched_tokens=256,
            num_kvcache_blocks=40 if backend != "flash" else 4,
        )
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
        del llm
        gc.collect()
    assert tokens[0] == tokens[1]


def assert_transformers_argmax(path: str, prompts, completions) -> None:
    """Each bf16 token (within bf16 rounding) transformers' most likely at its
    position."""
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    )
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(completion, device="cuda")[:, None])[
            :, 0
        ]
        gap = logits.max(dim=1).values - chosen
        assert (gap <= 0.05 * logits.abs().max(dim=1).values + 0.05).all(), gap.max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_tokens_are_transformers_argmax_when_teacher_forced(gpu_path, backend):
    """In bf16 two implementations may part at a near-tie; so feed our tokens to
    transformers and check each is (within bf16 rounding) its most likely token at that
    position."""
    assert_transformers_argmax(
        gpu_path, PROMPTS, run(gpu_path, backend, "bfloat16", False)
    )


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_4bit_layers_stay_4bit_and_give_transformers_tokens(fmt, tmp_path, no_tf32):
    """The Triton 4-bit GEMM compiled (CI runs it interpreted): float32, so the tokens
    are transformers' on the float weights the format defines."""
    from test_quantization import SHAPE, greedy, transformers_greedy, write_quantized

    from nanopaged.quantization.int4_triton import Int4Kernel

    base = write_random_checkpoint(
        str(tmp_path / "base"), dict(TINY["qwen3"], **SHAPE), initializer_range=0.1
    )
    path = write_quantized(base, str(tmp_path / fmt), fmt)
    with LLM(
        path, dtype="float32", max_model_len=256, gpu_memory_utilization=0.3
    ) as llm:
        down = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(down.method, Int4Kernel) and down.packed.is_cuda
        assert greedy(llm) == transformers_greedy(path, fmt)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 (Ada, Hopper)",
)
def test_fp8_layers_multiply_in_fp8_and_give_transformers_first_tokens(tmp_path):
    """cuBLAS's FP8 GEMM (CI runs torch's CPU `_scaled_mm`): bfloat16, per-channel
    scales, dynamic per-token activations."""
    from test_quantization import SHAPE, greedy, transformers_greedy, write_quantized

    from nanopaged.quantization.fp8 import Fp8ScaledMM

    base = write_random_checkpoint(
        str(tmp_path / "base"), dict(TINY["qwen3"], **SHAPE), initializer_range=0.1
    )
    path = write_quantized(base, str(tmp_path / "ct"), "compressed-tensors")
    with LLM(
        path, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3
    ) as llm:
        qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert (
            isinstance(qkv.method, Fp8ScaledMM)
            and qkv.weight_t.dtype == torch.float8_e4m3fn
        )
        got = greedy(llm)
    pytest.importorskip("compressed_tensors")  # transformers' reader of the format
    assert [t[0] for t in got] == [
        t[0] for t in transformers_greedy(path, "compressed-tensors")
    ]


def test_an_fp8_kv_cache_read_by_triton_in_graphs_gives_the_torch_backends_tokens(
    gpu_path, no_tf32
):
    """The e4m3 cache read by the compiled Triton kernels, decode replayed in CUDA
    graphs: float32, so the tokens are the plain PyTorch backend's on the same cache."""
    tokens = {}
    for backend, enforce_eager in (("torch", True), ("triton", False)):
        with LLM(
            gpu_path,
            dtype="float32",
            attention_backend=backend,
            enforce_eager=enforce_eager,
            kv_cache_dtype="fp8",
            kvcache_block_size=16,
            max_model_len=1024,
            max_num_seqs=64,
            gpu_memory_utilization=0.3,
        ) as llm:
            assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
            tokens[backend] = [
                o.outputs[0].token_ids
                for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            ]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_base_and_two_adapters_in_one_batch_give_peft_merged_tokens(
    gpu_path, tmp_path, enforce_eager, no_tf32
):
    """LoRA on a GPU: the Triton kernels, and the rows' slots as an input of the decode
    graphs (one batch mixing the base model and two adapters, replayed)."""
    from peft import PeftModel
    from test_lora import EVERY, write_adapter
    from transformers import AutoModelForCausalLM

    from nanopaged import LoRARequest
    from nanopaged.lora.punica import lora_delta_triton

    loras = [
        None,
        LoRARequest(
            "a",
            1,
            write_adapter(
                gpu_path, str(tmp_path / "a"), 8, ["q_proj", "v_proj", "down_proj"], 1
            ),
        ),
        LoRARequest(
            "b",
            2,
            write_adapter(gpu_path, str(tmp_path / "b"), 4, EVERY, 2, use_rslora=True),
        ),
    ]
    prompts = [p for p in PROMPTS[:4] for _ in loras]
    requests = loras * 4
    with LLM(
        gpu_path,
        dtype="float32",
        attention_backend="triton",
        enforce_eager=enforce_eager,
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    ) as llm:
        layer = next(
            m.method
            for m in llm.engine.runner.model.modules()
            if hasattr(getattr(m, "method", None), "delta")
        )
        assert layer.delta is lora_delta_triton
        got = [
            o.outputs[0].token_ids
            for o in llm.generate(
                prompts, GREEDY, use_tqdm=False, lora_request=requests
            )
        ]
    for lora in loras:
        model = AutoModelForCausalLM.from_pretrained(gpu_path, dtype=torch.float32)
        if lora is not None:
            model = PeftModel.from_pretrained(model, lora.lora_path).merge_and_unload()
        model = model.cuda().eval()
        model.generation_config.eos_token_id = None
        for i, prompt in enumerate(prompts):
            if requests[i] == lora:
                out = model.generate(
                    torch.tensor([prompt]).cuda(), max_new_tokens=32, do_sample=False
                )
                assert got[i] == out[0, len(prompt) :].tolist(), (lora, i)


# ---- the features above the core, on a GPU with CUDA graphs ----


@pytest.mark.parametrize(
    "family", ["qwen3-moe", "mixtral", "mistral", "qwen2-sliding", "gemma3"]
)
def test_families_give_transformers_tokens_under_graphs(
    family, model_path, hf_greedy, no_tf32
):
    """The fused MoE kernels compiled, and windows on the Triton kernels, replayed in
    graphs; with chunked prefill, preemption and prefix hits (test_models' mix)."""
    from test_models import mixed_run

    from nanopaged.models.moe import SparseMoeBlock

    llm = mixed_run(
        model_path(family),
        hf_greedy,
        dtype="float32",
        attention_backend="triton",
        enforce_eager=False,
    )
    blocks = [
        m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)
    ]
    assert all(b.run_experts.__name__ == "_fused_experts" for b in blocks)


SPEC_PROMPTS = PROMPTS[:4] + [[5, 6, 7, 8] * 6]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_greedy_speculation_under_graphs_gives_the_plain_tokens(
    gpu_path, backend, method, no_tf32
):
    """float32 on Triton: the very tokens of transformers; bf16 on flash-attn (its
    varlen verify): transformers' argmax at every position."""
    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": gpu_path, "num_speculative_tokens": 3}
    )
    dtype = "bfloat16" if backend == "flash" else "float32"
    with LLM(
        gpu_path,
        dtype=dtype,
        attention_backend=backend,
        enforce_eager=False,
        kvcache_block_size=256 if backend == "flash" else 16,
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        speculative_config=spec,
    ) as llm:
        got = [
            o.outputs[0].token_ids
            for o in llm.generate(SPEC_PROMPTS, GREEDY, use_tqdm=False)
        ]
        stats = llm.stats()
    # n-grams of a random model: some, and some rejected
    assert stats.num_accepted_tokens > 0
    assert method != "ngram" or stats.num_accepted_tokens < stats.num_proposed_tokens
    if backend == "flash":
        assert_transformers_argmax(gpu_path, SPEC_PROMPTS, got)
    else:
        assert got == hf_greedy(gpu_path, torch.float32, SPEC_PROMPTS)


def test_bfloat16_sliding_window_on_triton_is_transformers_argmax(tmp_path):
    """A window of 24 over prompts of up to 300 tokens, bf16, graphs (flash-attn's
    window needs a build with local attention; the trimmed one of the GPU machine has
    none)."""
    path = write_random_checkpoint(
        str(tmp_path / "mistral"),
        dict(
            GPU_QWEN3,
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            sliding_window=24,
            tie_word_embeddings=False,
        ),
        initializer_range=0.1,
    )
    got = run(path, "triton", "bfloat16", False)
    assert_transformers_argmax(path, PROMPTS, got)


@pytest.mark.skipif(
    importlib.util.find_spec("llguidance") is None, reason="needs llguidance"
)
def test_structured_outputs_under_graphs(gpu_path, no_tf32):
    """Masks filled while the graph replays: JSON that parses, one of the choices, and
    greedy requests beside them still transformers' tokens."""
    import json

    from nanopaged.sampling_params import StructuredOutputsParams

    number = {"type": "integer", "minimum": 0, "maximum": 120}
    schema = {
        "type": "object",
        "properties": {"n": number},
        "required": ["n"],
        "additionalProperties": False,
    }
    constrained = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(**c),
        )
        for s, c in enumerate([{"json": schema}, {"choice": ["paged", "cache"]}] * 4)
    ]
    with LLM(
        gpu_path,
        dtype="float32",
        attention_backend="triton",
        enforce_eager=False,
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        structured_outputs_config={"disable_any_whitespace": True},
    ) as llm:
        outs = llm.generate(
            PROMPTS[:2] * 4 + PROMPTS,
            constrained + [GREEDY] * len(PROMPTS),
            use_tqdm=False,
        )
    for out in outs[0:8:2]:
        assert list(json.loads(out.outputs[0].text)) == ["n"]
    assert all(o.outputs[0].text in ("paged", "cache") for o in outs[1:8:2])
    assert [o.outputs[0].token_ids for o in outs[8:]] == hf_greedy(
        gpu_path, torch.float32, PROMPTS
    )


def test_the_sampling_kernel_at_qwen3s_vocabulary_is_the_reference():
    """The bench's shape: 256 bfloat16 rows of 151,936 logits, compiled."""
    from nanopaged.core.sampler import sample
    from nanopaged.sampling.triton_kernel import sample as sample_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(256, 151_936, device="cuda", generator=g) * 4).bfloat16()
    temperatures = torch.full((256,), 0.6, device="cuda")
    uniform = torch.rand(256, device="cuda", generator=g) * 0.998 + 1e-3
    tokens = sample_kernel(logits, temperatures, uniform)
    assert (tokens == sample(logits, temperatures, uniform)).float().mean() > 0.99


def test_del_gives_the_gpu_memory_back_so_a_second_engine_fits(gpu_path):
    """Each engine takes 60% of the card: the second starts only if `del` freed the
    first's KV cache and graphs."""
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    for _ in range(2):
        llm = LLM(
            gpu_path,
            enforce_eager=False,
            max_model_len=1024,
            gpu_memory_utilization=0.6,
        )
        assert torch.cuda.memory_allocated() - before > 0.3 * total
        [out] = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        del llm, out
        assert torch.cuda.memory_allocated() - before < 0.01 * total


def perturbed_weights(path: str, tmp_path) -> tuple[str, list]:
    """`path`'s weights moved by noise, saved as a checkpoint beside it (for
    transformers' reference) and as a trainer's (name, tensor) pairs, on the GPU."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    new = str(tmp_path / "new")
    model.save_pretrained(new)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{path}/{name}", new)
    return new, [(n, p.detach().cuda()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_weights_under_graphs_give_transformers_tokens(
    gpu_path, backend, tmp_path, no_tf32
):
    """RL's update (rl/weights.py) copies into the parameters in place: the captured
    CUDA graphs read the new weights; no prefix cached under the old ones is served."""
    new, weights = perturbed_weights(gpu_path, tmp_path)
    block_size = 256 if backend == "flash" else 16
    with LLM(
        gpu_path,
        dtype="float32",
        attention_backend=backend,
        kvcache_block_size=block_size,
        max_model_len=1024,
        gpu_memory_utilization=0.3,
    ) as llm:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(weights)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(
            new, torch.float32, PROMPTS
        )
        assert all(o.num_cached_tokens == 0 for o in outputs)


def test_sleep_gives_the_gpu_memory_back_and_wakes_with_the_same_tokens(gpu_path):
    """Level 1: the KV cache's memory back to the device, the weights kept in host
    memory; level 2: both; the graphs captured again on waking; the same tokens."""
    with LLM(
        gpu_path,
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        enable_sleep_mode=True,
    ) as llm:
        expected = [
            o.outputs[0].token_ids
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ]
        cache = llm.engine.runner.kv_cache
        kv_bytes = cache.numel() * cache.element_size()
        for level in (1, 2):
            before = torch.cuda.memory_allocated()
            free_before = torch.cuda.mem_get_info()[0]
            llm.sleep(level=level)
            assert before - torch.cuda.memory_allocated() >= 0.99 * kv_bytes
            assert torch.cuda.mem_get_info()[0] - free_before >= 0.9 * kv_bytes
            llm.wake_up()
            if level == 2:  # the weights were discarded: the checkpoint's again
                from transformers import AutoModelForCausalLM

                from nanopaged.rl.weights import checkpoint_shapes  # noqa: F401

                model = AutoModelForCausalLM.from_pretrained(gpu_path)
                engine = llm.llm_engine.model_executor.driver_worker.model_runner
                engine.model.load_weights(model.named_parameters())
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected
