"""Rollouts for RL (nanopaged/rl/): new weights in place give transformers' tokens on
the new weights, whatever was cached under the old ones and whatever runs the engine
(async scheduling, step graphs or eager, speculative decoding, LoRA, two ranks); every
bad weight is refused by name with the old weights whole; a Ctrl-C mid-update leaves
all old or all new; vLLM's weight transfer from a trainer, its sleep mode (memory given
back, tokens the same after waking), `collective_rpc`, and logprobs equal to the
trainer's."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading

import httpx
import psutil
import pytest
import torch
from conftest import TINY, random_prompts
from test_lora import adapters, peft_greedy, token_ids  # noqa: F401 (a fixture)
from test_quantization import write_quantized
from test_server import Server
from transformers import AutoModelForCausalLM

from nanopaged import LLM, SamplingParams
from nanopaged.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from nanopaged.parallel.tensor import free_port
from nanopaged.random_checkpoint import write_random_checkpoint
from nanopaged.rl.sleep import weight_tensors

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# two full blocks and more: the first run caches their prefix under the old weights
PROMPTS = random_prompts([40, 33, 9], seed=70)


def perturbed(base: str, path: str, seed: int) -> str:
    """A checkpoint of `base`'s weights, each moved by noise, at `path` (its
    tokenizer's files copied): what a training step gives."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    for name in os.listdir(base):
        if not name.endswith((".safetensors", "config.json")):
            shutil.copy(os.path.join(base, name), path)
    shutil.copy(os.path.join(base, "generation_config.json"), path)
    return path


@functools.cache
def state(path: str) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's weights as a trainer sends them: transformers' named
    parameters."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [(name, param.detach().clone()) for name, param in model.named_parameters()]


@pytest.fixture(scope="module")
def new_path(qwen3_path, tmp_path_factory) -> str:
    return perturbed(qwen3_path, str(tmp_path_factory.mktemp("trained")), seed=1)


def generate(llm, prompts=PROMPTS, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def driver_model(llm):
    """Where TRL's colocate mode takes the model to push weights into."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"async_scheduling": True},
        {"enforce_eager": True},  # no CPU step graphs
        {"attention_backend": "torch"},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
        {"speculative_config": "draft"},
    ],
    ids=["graphs", "async", "eager", "torch", "ngram", "draft"],
)
def test_new_weights_give_transformers_tokens_of_the_new_weights(
    options, qwen3_path, new_path, hf_greedy
):
    """The prompts ran under the old weights first (their prefixes cached): after the
    update none is served from the cache, and the tokens are the new weights'."""
    if options.get("speculative_config") == "draft":
        options = {
            "speculative_config": {"model": qwen3_path, "num_speculative_tokens": 3}
        }
    llm = LLM(qwen3_path, max_model_len=256, **options)
    before = generate(llm)
    assert [o.outputs[0].token_ids for o in before] == hf_greedy(
        qwen3_path, PROMPTS, 16
    )
    assert before[0].weight_version == 0
    names = driver_model(llm).load_weights(iter(state(new_path)))
    assert names == {name for name, _ in state(new_path)}
    after = generate(llm)
    assert [o.outputs[0].token_ids for o in after] == hf_greedy(new_path, PROMPTS, 16)
    assert [o.num_cached_tokens for o in after] == [0, 0, 0]
    assert after[0].weight_version == 1 and llm.get_weight_version() == "1"
    again = generate(llm)  # cached under the new weights now
    assert again[0].num_cached_tokens == 32
    assert [o.outputs[0].token_ids for o in again] == hf_greedy(new_path, PROMPTS, 16)


def test_two_tensor_parallel_ranks_take_their_shards(qwen3_path, new_path, hf_greedy):
    [full] = LLM(qwen3_path, max_model_len=256, enforce_eager=True).apply_model(
        lambda model: model
    )
    with LLM(
        qwen3_path, max_model_len=256, tensor_parallel_size=2, enable_sleep_mode=True
    ) as llm:
        generate(llm)
        driver_model(llm).load_weights(state(new_path))
        expected = hf_greedy(new_path, PROMPTS, 16)
        assert [o.outputs[0].token_ids for o in generate(llm)] == expected
        assert llm.collective_rpc(rank_of) == [0, 1]
        # vLLM's apply_model: each rank's model, with its half of the heads
        assert llm.apply_model(heads_of) == [heads_of(full) // 2] * 2
        llm.sleep(level=1)  # every rank sleeps
        assert llm.collective_rpc(asleep_of) == [{"kv_cache"}, {"kv_cache"}]
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in generate(llm)] == expected
        with pytest.raises(ValueError, match="travels pickled"):
            llm.collective_rpc(lambda worker: worker.rank)


def heads_of(model) -> int:
    """The query heads of the first layer of `model` (a rank's)."""
    return model.model.layers[0].self_attn.num_heads


def asleep_of(worker) -> set[str]:
    return worker.asleep()


def test_data_parallel_replicas_take_new_weights_sleep_and_join_a_transfer(
    qwen3_path, new_path, hf_greedy
):
    """Each replica is an engine of its own: all take the weights, all sleep, and each
    joins the trainer's group after the replicas before it."""
    with LLM(
        qwen3_path,
        max_model_len=256,
        data_parallel_size=2,
        enable_sleep_mode=True,
        weight_transfer_config={"backend": "gloo"},
    ) as llm:
        driver_model(llm).load_weights(state(new_path))
        outputs = generate(llm)
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(
            new_path, PROMPTS, 16
        )
        assert {o.weight_version for o in outputs} == {1}
        llm.sleep()
        assert llm.is_sleeping()
        llm.wake_up()
        info, joined = dict(transfer_info(free_port()), world_size=3), {}
        thread = in_thread(
            lambda: joined.update(group=NCCLWeightTransferEngine.trainer_init(info))
        )
        llm.init_weight_transfer_engine({"init_info": dict(info, rank_offset=1)})
        thread.join()
        weights = state(qwen3_path)  # back to the first weights, sent
        llm.start_weight_update()
        sender = in_thread(
            NCCLWeightTransferEngine.trainer_send_weights,
            iter(weights),
            {"group": joined["group"]},
        )
        llm.update_weights({"update_info": update_info(weights)})
        sender.join()
        llm.finish_weight_update()
        assert [o.outputs[0].token_ids for o in generate(llm)] == hf_greedy(
            qwen3_path, PROMPTS, 16
        )
        assert llm.get_weight_version() == "2"


def rank_of(worker) -> int:  # top level: tensor-parallel workers unpickle it
    return worker.rank


def test_lora_adapters_stay_over_the_new_base(adapters, tmp_path):  # noqa: F811
    """The base model's weights change; each adapter still adds its own delta, now to
    the new base: peft's merged model of the new base and the adapter."""
    base, (first, _) = adapters("qwen3")
    new_base = perturbed(base, str(tmp_path / "new"), seed=2)
    llm = LLM(base, enable_lora=True, max_lora_rank=8, max_model_len=256)
    prompts = PROMPTS[:2]
    assert token_ids(
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=first)
    ) == peft_greedy(base, [first, first], prompts)
    driver_model(llm).load_weights(state(new_base))
    got = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=first)
    assert token_ids(got) == peft_greedy(new_base, [first, first], prompts)
    with pytest.raises(ValueError, match="is a LoRA adapter's weight"):
        driver_model(llm).load_weights(
            [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(8, 64))]
        )


def bad_batches(new_path: str) -> list:
    good = state(new_path)
    name, tensor = good[3]
    return [
        ([("model.layers.9.mlp.up_proj.weight", tensor)], "is no weight of this"),
        ([(name, tensor[:-1])], f"{name!r} has shape"),
        ([(name, tensor.long())], f"{name!r} is torch.int64"),
        ([(name, tensor.to(torch.float8_e4m3fn))], "is torch.float8_e4m3fn"),
        ([(name,)], "is not a (name, tensor) pair"),
        ([(name, tensor.tolist())], "is not a (name, tensor) pair"),
        (good[:5] + [("lm_head.bias", tensor)], "'lm_head.bias' is no weight"),
    ]


def test_bad_weights_are_refused_by_name_and_the_old_weights_stay(
    qwen3_path, new_path, hf_greedy
):
    """Each batch has a fault, some beside good weights: none is written."""
    llm = LLM(qwen3_path, max_model_len=256)
    expected = hf_greedy(qwen3_path, PROMPTS, 16)
    for batch, message in bad_batches(new_path):
        with pytest.raises(ValueError, match="none written") as refused:
            driver_model(llm).load_weights(batch)
        assert message in str(refused.value)
        assert [o.outputs[0].token_ids for o in generate(llm)] == expected
    assert llm.get_weight_version() == "0"


def test_a_quantized_model_refuses_new_weights(qwen3_path, tmp_path):
    path = write_quantized(qwen3_path, str(tmp_path / "fp8"), "fp8-tensor")
    llm = LLM(path, max_model_len=256)
    with pytest.raises(ValueError, match=r"this model is quantized \(fp8"):
        driver_model(llm).load_weights([])


def test_an_engine_with_unfinished_requests_refuses_new_weights(qwen3_path, new_path):
    llm = LLM(qwen3_path, max_model_len=256)
    request_id = llm.add_request(PROMPTS[0], GREEDY)
    llm.step()
    with pytest.raises(ValueError, match="1 requests are unfinished"):
        driver_model(llm).load_weights(state(new_path))
    llm.abort(request_id)
    driver_model(llm).load_weights(state(new_path))


@pytest.mark.parametrize("at", ["check", "write"])
def test_ctrl_c_mid_update_leaves_all_old_or_all_new(
    at, qwen3_path, new_path, hf_greedy
):
    """Ctrl-C while the batch is checked: nothing was written (the old weights); once
    writing has begun, it is finished first (the new ones), never a mix."""
    llm = LLM(qwen3_path, max_model_len=256)
    generate(llm)
    writer = llm._rl().worker(llm).weights
    original, calls = getattr(writer, f"_{at}" if at == "write" else at), []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 3 or at == "check":
            raise KeyboardInterrupt
        return original(*args)

    setattr(writer, "_write" if at == "write" else "check", interrupted)
    with pytest.raises(KeyboardInterrupt):
        driver_model(llm).load_weights(state(new_path))
    delattr(writer, "_write" if at == "write" else "check")
    expected = hf_greedy(new_path if at == "write" else qwen3_path, PROMPTS, 16)
    after = generate(llm)
    assert [o.outputs[0].token_ids for o in after] == expected
    # new weights: no prefix of the old ones served; old ones: their prefixes still are
    assert after[0].num_cached_tokens == (0 if at == "write" else 32)


def test_collective_rpc_runs_a_method_or_a_function_on_every_rank(
    qwen3_path, new_path, hf_greedy
):
    llm = LLM(qwen3_path, max_model_len=256)
    generate(llm)
    assert llm.collective_rpc(lambda worker, n: worker.rank + n, args=(5,)) == [5]
    # a function that writes weights itself: the engine forgets the old prefixes
    llm.collective_rpc(
        lambda worker: worker.model_runner.model.load_weights(state(new_path))
    )
    assert llm.get_weight_version() == "1"
    after = generate(llm)
    assert [o.outputs[0].token_ids for o in after] == hf_greedy(new_path, PROMPTS, 16)
    assert after[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="neither a function of the worker"):
        llm.collective_rpc("no_such_method")


def transfer_info(port: int) -> dict:
    return dict(master_address="127.0.0.1", master_port=port, world_size=2)


def in_thread(function, *args) -> threading.Thread:
    thread = threading.Thread(target=function, args=args, daemon=True)
    thread.start()
    return thread


def update_info(weights) -> dict:
    return {
        "names": [name for name, _ in weights],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        "shapes": [list(t.shape) for _, t in weights],
    }


def test_a_trainer_sends_its_weights_through_vllms_weight_transfer(
    qwen3_path, new_path, hf_greedy
):
    """The trainer (a thread here; another process in docs/rl.md) joins as rank 0 and
    broadcasts; generation is refused between start and finish."""
    llm = LLM(qwen3_path, max_model_len=256, weight_transfer_config={"backend": "nccl"})
    generate(llm)
    info, joined = transfer_info(free_port()), {}
    thread = in_thread(
        lambda: joined.update(group=NCCLWeightTransferEngine.trainer_init(info))
    )
    llm.init_weight_transfer_engine({"init_info": dict(info, rank_offset=1)})
    thread.join()
    with pytest.raises(ValueError, match="needs start_weight_update"):
        llm.update_weights({"update_info": update_info(state(new_path))})
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="finish_weight_update"):
        generate(llm)
    sender = in_thread(
        NCCLWeightTransferEngine.trainer_send_weights,
        iter(state(new_path)),
        {"group": joined["group"]},
    )
    llm.update_weights({"update_info": update_info(state(new_path))})
    sender.join()
    llm.finish_weight_update(weight_version="step-1")
    after = generate(llm)
    assert [o.outputs[0].token_ids for o in after] == hf_greedy(new_path, PROMPTS, 16)
    assert after[0].num_cached_tokens == 0 and after[0].weight_version == 1
    assert llm.get_weight_version() == "step-1"
    # a batch the engine refuses is still received whole: the trainer is not left
    # waiting, and the weights stay
    bad = [("model.no_such.weight", state(qwen3_path)[0][1])]
    llm.start_weight_update()
    sender = in_thread(
        NCCLWeightTransferEngine.trainer_send_weights,
        iter(bad),
        {"group": joined["group"]},
    )
    with pytest.raises(ValueError, match="'model.no_such.weight' is no weight"):
        llm.update_weights({"update_info": update_info(bad)})
    sender.join(timeout=60)
    assert not sender.is_alive()
    llm.finish_weight_update()
    assert [o.outputs[0].token_ids for o in generate(llm)] == hf_greedy(
        new_path, PROMPTS, 16
    )


def test_weight_transfer_needs_its_config_and_well_formed_requests(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=256)
    with pytest.raises(ValueError, match="weight transfer is not configured"):
        llm.init_weight_transfer_engine({"init_info": transfer_info(1)})
    with pytest.raises(ValueError, match="weight_transfer_config takes backend"):
        LLM(qwen3_path, weight_transfer_config={"backend": "ipc"})
    llm = LLM(qwen3_path, weight_transfer_config={"backend": "gloo"})
    llm.start_weight_update()
    with pytest.raises(ValueError, match="differ in length"):
        llm.update_weights(
            {"update_info": {"names": ["a"], "dtype_names": [], "shapes": []}}
        )
    with pytest.raises(ValueError, match="expected {'update_info'"):
        llm.update_weights({"names": []})
    with pytest.raises(ValueError, match="before init_weight_transfer_engine"):
        llm.update_weights({"update_info": update_info([])})


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory) -> str:
    """A wider model than the tests' tiny one: its weights (tens of MB) show in the
    process's resident memory."""
    shape = dict(
        TINY["qwen3"], hidden_size=256, intermediate_size=1024, vocab_size=8192
    )
    return write_random_checkpoint(
        str(tmp_path_factory.mktemp("wide")), shape, initializer_range=0.1
    )


def resident() -> int:
    return psutil.Process().memory_info().rss


def test_sleep_gives_back_the_kv_cache_and_the_weights_memory(wide_path):
    """Level 1 gives back the KV cache's pages (on a CPU the weights already lie in
    host memory), level 2 the weights' too; generation is refused while anything
    sleeps, and after level 2 until new weights come; the tokens after level 1 are the
    same."""
    llm = LLM(
        wide_path, max_model_len=256, num_kvcache_blocks=2048, enable_sleep_mode=True
    )
    expected = [o.outputs[0].token_ids for o in generate(llm)]
    cache = llm.engine.runner.kv_cache
    cache.fill_(1.0)  # every page of the cache in memory
    kv_bytes = cache.numel() * cache.element_size()
    weight_bytes = sum(
        t.untyped_storage().nbytes() for t in weight_tensors(llm.engine.runner.model)
    )
    before = resident()
    llm.sleep(level=1)
    assert before - resident() > 0.9 * kv_bytes
    assert llm.llm_engine.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep .kv_cache.: wake_up"):
        generate(llm)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert [o.outputs[0].token_ids for o in generate(llm)] == expected
    cache.fill_(1.0)
    before = resident()
    llm.sleep(level=2)
    assert before - resident() > 0.9 * (kv_bytes + weight_bytes)
    llm.wake_up(tags=["weights"])
    with pytest.raises(RuntimeError, match="asleep .kv_cache."):
        generate(llm)
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(RuntimeError, match="discarded the weights"):
        generate(llm)
    weights = state(wide_path)
    driver_model(llm).load_weights(weights[:3])  # not all of them: still refused
    with pytest.raises(RuntimeError, match="discarded the weights"):
        generate(llm)
    driver_model(llm).load_weights(weights[3:])
    assert [o.outputs[0].token_ids for o in generate(llm)] == expected


def test_sleep_mode_is_asked_for_and_its_arguments_checked(qwen3_path):
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        LLM(qwen3_path, max_model_len=256).sleep()
    llm = LLM(qwen3_path, max_model_len=256, enable_sleep_mode=True)
    for call, message in [
        (lambda: llm.sleep(level=3), "level must be 1 or 2"),
        (lambda: llm.sleep(mode="later"), "mode must be one of abort, wait, keep"),
        (lambda: llm.wake_up(tags=["everything"]), "got everything"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    llm.sleep()
    with pytest.raises(ValueError, match="asleep already"):
        llm.sleep()


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_sleep_with_requests_unfinished_does_as_its_mode_says(
    mode, qwen3_path, hf_greedy
):
    """abort: they end; wait: they run to their end first (their outputs returned);
    keep: they stay, and go on after waking with transformers' tokens."""
    llm = LLM(qwen3_path, max_model_len=256, enable_sleep_mode=True)
    ids = [llm.add_request(prompt, GREEDY) for prompt in PROMPTS]
    for _ in range(3):
        llm.step()
    finished = llm.sleep(level=1, mode=mode)
    expected = hf_greedy(qwen3_path, PROMPTS, 16)
    if mode == "abort":
        assert llm.is_finished() and not llm.requests and finished == []
    elif mode == "wait":
        assert [o.outputs[0].token_ids for o in finished] == expected
        assert llm.is_finished()
    else:
        assert set(llm.requests) == set(ids) and finished == []
        with pytest.raises(RuntimeError, match="asleep"):
            llm.step()
        llm.wake_up()
        outputs = {}
        while not llm.is_finished():
            outputs.update((o.request_id, o) for o in llm.step() if o.finished)
        assert [outputs[i].outputs[0].token_ids for i in ids] == expected
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in generate(llm)] == expected


def test_sleep_under_async_scheduling_and_step_graphs(qwen3_path, hf_greedy):
    llm = LLM(
        qwen3_path, max_model_len=256, enable_sleep_mode=True, async_scheduling=True
    )
    expected = hf_greedy(qwen3_path, PROMPTS, 16)
    assert [o.outputs[0].token_ids for o in generate(llm)] == expected
    llm.add_request(PROMPTS[0], GREEDY)
    llm.step()
    with pytest.raises(ValueError, match="with async scheduling and a step in flight"):
        llm.sleep(mode="keep")
    llm.sleep()  # abort
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in generate(llm)] == expected


def test_logprobs_equal_the_trainers_at_its_temperature(qwen3_path, hf_model):
    """processed_logprobs: each sampled token's logprob is what a transformers forward
    of prompt + completion gives, log-softmax at the sampling temperature: 64
    completions of 64 tokens, float32 on a CPU, within 1e-5."""
    temperature = 0.7
    llm = LLM(qwen3_path, max_model_len=256, logprobs_mode="processed_logprobs")
    prompts = random_prompts([10 + 3 * i for i in range(8)], seed=71)
    params = SamplingParams(
        temperature=temperature, n=8, max_tokens=64, logprobs=0, ignore_eos=True, seed=0
    )
    worst, model = 0.0, hf_model(qwen3_path)
    with torch.no_grad():
        for prompt, output in zip(prompts, generate(llm, prompts, params)):
            for completion in output.outputs:
                tokens = completion.token_ids
                logits = model(torch.tensor([prompt + tokens])).logits[0]
                logits = logits[len(prompt) - 1 : -1] / temperature
                trainer = logits.log_softmax(-1)[torch.arange(len(tokens)), tokens]
                engine = [e[t].logprob for e, t in zip(completion.logprobs, tokens)]
                worst = max(worst, (trainer - torch.tensor(engine)).abs().max().item())
    assert worst <= 1e-5
    raw = LLM(qwen3_path, max_model_len=256)  # raw_logprobs: the model's own
    out = generate(
        raw,
        prompts[:1],
        SamplingParams(temperature=0.7, max_tokens=4, logprobs=0, seed=0),
    )
    logits = model(torch.tensor([prompts[0] + out[0].outputs[0].token_ids])).logits[0]
    first = out[0].outputs[0].token_ids[0]
    expected = logits[len(prompts[0]) - 1].log_softmax(-1)[first].item()
    assert abs(out[0].outputs[0].logprobs[0][first].logprob - expected) <= 1e-5


def test_the_servers_rl_routes(qwen3_path, new_path, hf_greedy, monkeypatch):
    """Behind $VLLM_SERVER_DEV_MODE, as vLLM's: sleep and wake (a completion meanwhile
    is a 503), and a weight transfer whose trainer is this test."""
    plain = Server(qwen3_path)
    try:
        assert httpx.post(plain.url + "/sleep").status_code == 404
    finally:
        plain.stop()
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    server = Server(
        qwen3_path,
        "--enable-sleep-mode",
        "--weight-transfer-config",
        '{"backend": "gloo"}',
        "--max-model-len",
        "256",
    )
    url = server.url

    def complete() -> httpx.Response:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16}
        return httpx.post(url + "/v1/completions", json=dict(body, temperature=0))

    try:
        assert complete().status_code == 200
        assert httpx.post(url + "/sleep", params={"level": 1}).status_code == 200
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        refused = complete()
        assert refused.status_code == 503 and "asleep" in refused.text
        assert httpx.post(url + "/wake_up").status_code == 200
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert httpx.get(url + "/get_world_size").json() == {"world_size": 1}
        info, joined = transfer_info(free_port()), {}
        thread = in_thread(
            lambda: joined.update(group=NCCLWeightTransferEngine.trainer_init(info))
        )
        answer = httpx.post(
            url + "/init_weight_transfer_engine",
            json={"init_info": dict(info, rank_offset=1)},
            timeout=60,
        )
        thread.join()
        assert answer.status_code == 200
        assert httpx.post(url + "/start_weight_update").status_code == 200
        weights = state(new_path)
        sender = in_thread(
            NCCLWeightTransferEngine.trainer_send_weights,
            iter(weights),
            {"group": joined["group"]},
        )
        answer = httpx.post(
            url + "/update_weights",
            json={"update_info": update_info(weights)},
            timeout=60,
        )
        sender.join()
        assert answer.status_code == 200
        assert (
            httpx.post(
                url + "/finish_weight_update", json={"weight_version": "v2"}
            ).status_code
            == 200
        )
        offline = LLM(new_path, max_model_len=256)
        [expected] = generate(offline, PROMPTS[:1])
        assert complete().json()["choices"][0]["text"] == expected.outputs[0].text
        bad = httpx.post(url + "/sleep", params={"level": 5})
        assert bad.status_code == 400 and "level must be 1 or 2" in bad.text
    finally:
        server.stop()


def test_the_loop_of_docs_rl_md_learns_with_no_logprob_drift(qwen3_path, tmp_path):
    """docs/rl.md's programs, on the tiny model: GRPO's reward rises over 20
    iterations, the engine's logprobs stay the trainer's within float32's rounding,
    and the trainer in another process, sent the same rollouts, makes the same weights
    (the same rewards, round by round). They run as a user runs them, a script in a
    process of its own: the page forks its trainer, and a fork copies whatever the
    process running it holds (this one's tests' threads and groups)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "rl.md")) as f:
        page = f.read()
    code = "\n".join(re.findall(r"```python\n(.*?)```", page, re.S))
    script = tmp_path / "rl.py"
    script.write_text(
        re.sub(r"Qwen/Qwen3-[0-9.]+B", qwen3_path, code)
        + "\nimport json\nprint(json.dumps([rewards, gaps, remote_rewards, "
        "remote.get_weight_version()]))\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rewards, gaps, remote_rewards, version = json.loads(run.stdout.splitlines()[-1])
    assert len(rewards) == 20 and max(gaps) <= 1e-5
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2
    assert remote_rewards == rewards[:5] and version == "step-5"


def logprob_bits(output) -> list:
    """Each completion's tokens and the exact logprob of each."""
    return [
        (c.token_ids, [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)])
        for c in output.outputs
    ]


@pytest.mark.parametrize(
    "beside, options",
    [
        ("others", {}),
        ("others", {"scheduling": "mixed"}),
        ("others", {"max_num_batched_tokens": 16}),  # its prompt in chunks
        ("others", {"num_kvcache_blocks": 14}),  # preempted and computed again
        ("others", {"async_scheduling": True}),
        ("others", {"enforce_eager": True}),
        ("prefix", {}),  # its prefix cached by an earlier request
    ],
    ids=["batch", "mixed", "chunked", "preempted", "async", "eager", "prefix-hit"],
)
def test_a_requests_tokens_and_logprobs_are_the_same_bits_whatever_runs_beside_it(
    beside, options, qwen3_path
):
    """The CPU backend is batch-invariant: alone, or among 63 others in every way a
    batch can form, a seeded request's tokens and logprobs are bit for bit the same."""
    target = random_prompts([50], seed=72)[0]
    params = SamplingParams(
        temperature=0.9, max_tokens=40, logprobs=2, ignore_eos=True, seed=7
    )
    alone = LLM(qwen3_path, max_model_len=256)
    [expected] = generate(alone, [target], params)
    llm = LLM(qwen3_path, max_model_len=256, **options)
    assert llm.config.attention_backend == "cpu"
    if beside == "prefix":
        generate(llm, [target[:40] + [9, 9]], GREEDY)
        [got] = generate(llm, [target], params)
        assert got.num_cached_tokens == 32
    else:
        others = random_prompts([20 + i for i in range(63)], seed=73)
        got = generate(llm, [target] + others, params)[0]
    if "num_kvcache_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    assert logprob_bits(got) == logprob_bits(expected)


def test_vllms_batch_invariant_switch_is_refused_where_the_kernels_are_not(
    qwen3_path, monkeypatch
):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert LLM(qwen3_path, max_model_len=256).config.attention_backend == "cpu"
    with pytest.raises(ValueError, match="'torch' backend has none yet"):
        LLM(qwen3_path, attention_backend="torch")
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"  # read, never changed
