"""The model families above the core (nanopaged/models/): mixtures of experts
(Qwen3-MoE, Mixtral) and sliding windows (Mistral, Qwen2's, Gemma 3's). Greedy tokens
equal transformers' on each CPU backend with chunked prefill, preemption and prefix hits
in the mix; a window smaller than the prompt changes the tokens; a model whose every
layer slides gives back the blocks before its window; every config field that changes a
model is honoured or refused."""

import pytest
import torch
from conftest import FAMILIES, random_prompts
from test_errors import broken_copy
from transformers import AutoConfig, AutoModelForCausalLM

from nanopaged import LLM, SamplingParams
from nanopaged.core.attention import BACKENDS
from nanopaged.models.moe import MoeForCausalLM, SparseMoeBlock

GREEDY = SamplingParams(temperature=0, max_tokens=40)
BLOCK_SIZE = 16


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def mixed_run(path: str, hf_greedy, params: SamplingParams = GREEDY, **options) -> LLM:
    """Two prompts sharing 40 tokens and six short ones; 14 blocks of 16 tokens cannot
    hold the eight as they grow (every family preempts, windows included), and 32 tokens
    a step prefill the longer prompts in chunks; the second finds the first's blocks in
    the prefix cache, then again after the others ran."""
    shared = random_prompts([40], seed=20)[0]
    prompts = [shared + tail for tail in random_prompts([3, 30], seed=21)]
    prompts += random_prompts([12] * 6, seed=22)
    llm = LLM(
        path,
        max_model_len=512,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=14,
        max_num_batched_tokens=32,
        **options,
    )
    expected = hf_greedy(path, prompts, params.max_tokens)
    first = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(first) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(prompts[:2], params, use_tqdm=False)
    assert token_ids(again) == expected[:2]
    # two whole blocks of the 40 shared tokens; then maybe its own blocks too
    assert first[1].num_cached_tokens == 32 and again[1].num_cached_tokens >= 32
    return llm


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_with_chunks_preemption_and_prefix_hits(
    family, model_path, hf_greedy
):
    mixed_run(model_path(family), hf_greedy, attention_backend="torch")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_on_the_cpu_backend(family, model_path, hf_greedy):
    mixed_run(model_path(family), hf_greedy, attention_backend="cpu")


@pytest.mark.parametrize("family", ["qwen3-moe", "mistral", "gemma3"])
def test_the_triton_kernels_match_transformers(family, model_path, hf_greedy):
    """Triton attention and, for the experts, the fused MoE kernels, once per path of
    the kernels: a window on every layer (Mistral), on some (Gemma 3), fused experts
    (Qwen3-MoE; Mixtral and Qwen2's window take the same paths, on the CPU backends
    above). Fewer tokens: the interpreter is slow."""
    llm = mixed_run(
        model_path(family),
        hf_greedy,
        SamplingParams(temperature=0, max_tokens=16),
        attention_backend="triton",
    )
    if family in ("qwen3-moe", "mixtral"):
        block = next(
            m
            for m in llm.engine.runner.model.modules()
            if isinstance(m, SparseMoeBlock)
        )
        assert block.run_experts.__name__ == "_fused_experts"


@pytest.mark.parametrize("family", ["mistral", "qwen2-sliding", "gemma3"])
def test_the_window_changes_the_tokens(family, model_path, hf_greedy, tmp_path):
    """The same weights with a window longer than the prompts give other tokens: the
    window is not a no-op on these prompts."""
    path = model_path(family)
    full = broken_copy(path, tmp_path, {"sliding_window": 4096})
    prompts = random_prompts([60, 45], seed=23)
    windowed = token_ids(LLM(path).generate(prompts, GREEDY, use_tqdm=False))
    unwindowed = token_ids(LLM(full).generate(prompts, GREEDY, use_tqdm=False))
    assert windowed == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert unwindowed == hf_greedy(full, prompts, GREEDY.max_tokens) != windowed


def test_a_long_sliding_generation_holds_window_over_block_size_plus_one_blocks(
    model_path, hf_greedy, tmp_path
):
    """Mistral, window 32: while it decodes, a sequence holds at most 32 / 16 + 1
    blocks, the ones before given back (-1 in its block table); the prefix cache still
    serves them to a later prompt, with the right K/V."""
    path = broken_copy(model_path("mistral"), tmp_path, {"sliding_window": 32})
    prompt = random_prompts([40], seed=24)[0]
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    llm = LLM(path, max_model_len=512, kvcache_block_size=BLOCK_SIZE)
    pool = llm.engine.block_manager
    llm.add_request({"prompt_token_ids": prompt}, params)
    held, output = [], None
    while not llm.is_finished():
        for output in llm.step():  # noqa: B007 (the step's last output is kept)
            pass
        [seq] = llm.engine.scheduler.running or [None]
        if seq is not None and seq.num_completion_tokens > 1:
            held.append(pool.num_blocks - pool.num_free_blocks)
            assert sorted(b for b in seq.block_table if b >= 0) == sorted(
                b for b, count in enumerate(pool.ref_counts) if count
            )
    assert max(held) == 32 // BLOCK_SIZE + 1 and len(held) > 250
    assert output.outputs[0].token_ids == greedy_past_eos(path, prompt, 300)
    # the first 160 tokens again, and more: the blocks given back are still in the cache
    again = prompt + output.outputs[0].token_ids[:120]
    [out] = llm.generate([again], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 144  # every full block before the last token's
    assert out.outputs[0].token_ids == hf_greedy(path, [again], GREEDY.max_tokens)[0]


def greedy_past_eos(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, going on past EOS as `ignore_eos` does."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_moe_matches_transformers_on_two_ranks(family, model_path, hf_greedy):
    """Tensor parallelism (gloo): each rank holds half of every expert's intermediate
    size."""
    path = model_path(family)
    prompts = random_prompts([30, 45, 12], seed=25)
    with LLM(
        path, max_model_len=512, tensor_parallel_size=2, max_num_batched_tokens=32
    ) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_the_sparse_layers_are_those_of_transformers(model_path):
    """Qwen3-MoE's `decoder_sparse_step` and `mlp_only_layers` pick the sparse
    layers."""
    config = AutoConfig.from_pretrained(model_path("qwen3-moe"))
    config.num_hidden_layers, config.decoder_sparse_step, config.mlp_only_layers = (
        6,
        2,
        [3],
    )
    hf = AutoModelForCausalLM.from_config(config)
    ours = MoeForCausalLM(config, BACKENDS["torch"].kernels())
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert sparse == [False, True, False, False, False, True]


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        (
            "gemma3",
            {"use_bidirectional_attention": True},
            "use_bidirectional_attention",
        ),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": 10000.0,
                    },
                    "full_attention": {
                        "rope_type": "yarn",
                        "factor": 2.0,
                        "rope_theta": 1e6,
                        "original_max_position_embeddings": 1024,
                    },
                }
            },
            "rope_type='yarn'",
        ),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen3-moe", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ],
)
def test_a_field_the_model_does_not_implement_is_named(
    family, changes, message, model_path, tmp_path
):
    with pytest.raises(ValueError, match=message):
        LLM(broken_copy(model_path(family), tmp_path, changes))


def test_every_expert_matrix_is_required(model_path, tmp_path):
    from safetensors.torch import load_file, save_file

    path = broken_copy(model_path("mixtral"), tmp_path)
    weights = load_file(f"{path}/model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"missing weights.*layers.1.mlp.experts.gate_up "
        r"\(part \(2, 1\)\)",
    ):
        LLM(path)


@pytest.mark.parametrize(
    "shape", ["qwen3", "qwen3-moe", "mixtral", "mistral", "gemma3"]
)
def test_the_random_checkpoint_command_writes_each_family(
    shape, tmp_path, capsys, hf_greedy
):
    """`python -m nanopaged.random_checkpoint DIR --shape S` writes a checkpoint of each
    family that the engine runs as transformers does."""
    from nanopaged.random_checkpoint import SHAPES, main

    path = str(tmp_path / shape)
    main([path, "--shape", shape])
    architecture = SHAPES[shape]["architectures"][0]
    assert f"a random-weight {architecture} checkpoint" in capsys.readouterr().out
    prompts = random_prompts([7, 12], seed=31)
    outputs = LLM(path, max_model_len=256).generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_speculation_on_a_sliding_window_model(model_path, qwen3_path, hf_greedy):
    """n-gram proposals verified over the window give transformers' tokens; a draft
    model that attends further back than the window is refused (it would read blocks
    given back)."""
    path = model_path("mistral")
    prompts = [random_prompts([20], seed=26)[0] * 3, random_prompts([50], seed=27)[0]]
    llm = LLM(
        path,
        max_model_len=512,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
        },
    )
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(
        path, prompts, GREEDY.max_tokens
    )
    assert llm.stats().num_accepted_tokens > 0
    with pytest.raises(
        ValueError, match="attends further back than the model's sliding window"
    ):
        LLM(path, speculative_config={"model": qwen3_path, "num_speculative_tokens": 2})


def test_layers_share_a_rope_table_when_their_parameters_agree(model_path):
    """Gemma 3's two sliding layers share one cos/sin table; its full layer has its
    own."""
    llm = LLM(model_path("gemma3"))
    tables = [
        layer.self_attn.rotary_emb.cos_sin
        for layer in llm.engine.runner.model.model.layers
    ]
    assert tables[0] is tables[1] and not torch.equal(tables[0], tables[2])
