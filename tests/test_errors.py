"""Bad input is a ValueError naming the problem, and the engine still works afterwards."""
import pytest

from nanopaged import LLM, SamplingParams
from conftest import random_prompts

GOOD = random_prompts([6])[0]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(qwen3_path, max_model_len=128, kvcache_block_size=16, num_kvcache_blocks=4)


@pytest.mark.parametrize("prompts, params, message", [
    ([GOOD, []], GREEDY, "prompt is empty"),
    ([GOOD, ""], GREEDY, "prompt is empty"),
    ([GOOD, [1, 2, 512]], GREEDY, "outside the vocabulary"),
    ([GOOD, [1, -1]], GREEDY, "outside the vocabulary"),
    ([GOOD, [1, 2.0]], GREEDY, "outside the vocabulary"),
    ([GOOD, list(range(3, 131))], GREEDY, "max_model_len"),
    ([GOOD, GOOD], [GREEDY], "2 prompts but 1 sampling params"),
    ([GOOD], "greedy", "must be SamplingParams"),
    ([GOOD], SamplingParams(max_tokens=100), "needs up to 7 KV-cache blocks"),
])
def test_bad_request_is_rejected_and_engine_still_works(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.is_finished() and llm.block_manager.num_free_blocks == 4
    [out] = llm.generate([GOOD], GREEDY, use_tqdm=False)
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(seed=-3), "seed"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "nowhere"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture.*Qwen3ForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(kvcache_block_size=0), "kvcache_block_size"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(num_kvcache_blocks=0), "num_kvcache_blocks"),
    (dict(attention_backend="magic"), "attention_backend"),
    (dict(attention_backend="flash", device="cpu"), "needs a CUDA GPU"),
    (dict(dtype="int8"), "dtype"),
    (dict(device="tpu"), "device"),
])
def test_invalid_config_names_the_field(qwen3_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(qwen3_path, **kwargs)


def test_missing_weight_is_named(qwen3_path, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_path, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights.*layers.1.self_attn.qkv_proj"):
        LLM(str(broken))


def test_unexpected_weight_is_named(qwen3_path, tmp_path):
    import shutil
    import torch
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "extra"
    shutil.copytree(qwen3_path, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mystery.weight'"):
        LLM(str(broken))
