"""LoRA adapters (nanopaged/lora/): the tokens of base + adapters in one batch equal
transformers + peft's merged model on the same weights; the kernels equal their
definition; the slots, the admission and the prefix cache keep adapters apart; bad
adapters are refused."""

import concurrent.futures
import functools
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from conftest import checkpoint, random_prompts
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanopaged import LLM, LoRARequest, SamplingParams
from nanopaged.lora.punica import (
    lora_delta_reference,
    lora_delta_torch,
    lora_delta_triton,
)
from nanopaged.lora.runner import LoRALinear, RowSlots

GREEDY = SamplingParams(temperature=0, max_tokens=16)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERY = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def write_adapter(
    base: str, path: str, rank: int, targets: list[str], seed: int, **options
) -> str:
    """A peft adapter of `base` as peft saves one, its A and B random (not B = 0: it
    must change the tokens)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, **options)
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.15)
    adapted.save_pretrained(path)
    return path


@functools.cache
def _merged(base: str, adapter: str | None):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


@functools.cache
def _peft_greedy(
    base: str, adapter: str | None, prompt: tuple, max_tokens: int
) -> list[int]:
    with torch.no_grad():
        out = _merged(base, adapter).generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def peft_greedy(base, requests, prompts, max_tokens=GREEDY.max_tokens):
    return [
        _peft_greedy(base, r and r.lora_path, tuple(p), max_tokens)
        for r, p in zip(requests, prompts)
    ]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def adapters(checkpoint_root, tmp_path_factory):
    """adapters(arch) -> (base path, [a LoRARequest of rank 8 on q/v/down, one of rank 4
    with rslora on every projection]); for a mixture of experts, on attention alone."""
    root = tmp_path_factory.mktemp("adapters")

    @functools.cache
    def make(arch: str):
        base = checkpoint(arch, checkpoint_root)
        moe = "moe" in arch or arch == "mixtral"
        first = write_adapter(
            base,
            f"{root}/{arch}-a",
            8,
            ["q_proj", "v_proj"] if moe else ["q_proj", "v_proj", "down_proj"],
            1,
        )
        second = write_adapter(
            base, f"{root}/{arch}-b", 4, ATTENTION if moe else EVERY, 2, use_rslora=True
        )
        return base, [
            LoRARequest(f"{arch}-a", 1, first),
            LoRARequest(f"{arch}-b", 2, second),
        ]

    return make


def mixed_batch(requests, prompts):
    """Each prompt under the base model and every adapter: (prompts, lora requests)."""
    return (
        [p for p in prompts for _ in range(3)],
        [r for _ in prompts for r in [None, *requests]],
    )


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3-moe"])
def test_base_and_two_adapters_in_one_batch_give_peft_merged_tokens(arch, adapters):
    """The same prompt under the base model and two adapters, in one batch with prefix
    caching on: each gets its own model's tokens (a block one computed is not served to
    another)."""
    base, requests = adapters(arch)
    prompts, loras = mixed_batch(requests, random_prompts([40, 21], seed=11))
    llm = LLM(
        base,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kvcache_block_size=16,
        max_model_len=256,
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    expected = peft_greedy(base, loras, prompts)
    assert token_ids(outputs) == expected
    # the adapters matter
    assert expected[0] != expected[1] and expected[0] != expected[2]
    # the same prompt again: each adapter's (and the base's) own blocks are hits
    again = llm.generate(prompts[:3], GREEDY, use_tqdm=False, lora_request=loras[:3])
    assert token_ids(again) == expected[:3]
    assert [o.num_cached_tokens for o in again] == [32, 32, 32]


def test_a_cache_salt_and_an_adapter_both_name_the_blocks(adapters):
    """A prompt's cache_salt folds into its adapter's: the same prompt under the same
    adapter and salt hits the cache, under another salt or none, or another adapter,
    it does not; every sample of a request has the one salt; the tokens are peft's,
    and beam search's under the adapter too."""
    base, requests = adapters("qwen3")
    llm = LLM(
        base,
        enable_lora=True,
        max_lora_rank=8,
        kvcache_block_size=16,
        max_model_len=256,
    )
    prompt = random_prompts([40], seed=13)[0]
    cases = [
        (requests[0], "x"),
        (requests[0], "x"),
        (requests[0], None),
        (requests[0], "y"),
        (None, "x"),
        (requests[1], "x"),
    ]
    cached = []
    for lora, salt in cases:
        extra = {} if salt is None else {"cache_salt": salt}
        [output] = llm.generate(
            {"prompt_token_ids": prompt, **extra}, GREEDY, lora_request=lora
        )
        assert token_ids([output]) == peft_greedy(base, [lora], [prompt])
        cached.append(output.num_cached_tokens)
    assert cached == [0, 32, 0, 0, 0, 0]
    # beam search carries the adapter with every beam: one beam is its greedy tokens
    from nanopaged.sampling_params import BeamSearchParams

    params = BeamSearchParams(1, GREEDY.max_tokens, ignore_eos=GREEDY.ignore_eos)
    [beams] = llm.beam_search([prompt], params, lora_request=requests[1])
    assert [beams.sequences[0].tokens[len(prompt) :]] == peft_greedy(
        base, [requests[1]], [prompt]
    )
    two = SamplingParams(temperature=0, max_tokens=4, n=2)
    request = llm.make_request(
        {"prompt_token_ids": prompt, "cache_salt": "x"}, two, lora_request=requests[0]
    )
    assert len({seq.cache_salt for seq in request.seqs}) == 1


def test_preemption_chunked_prefill_and_n_samples(adapters):
    base, requests = adapters("qwen3")
    prompts, loras = mixed_batch(requests, random_prompts([60, 33, 45], seed=12))
    params = SamplingParams(temperature=0, max_tokens=24, n=2)
    llm = LLM(
        base,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kvcache_block_size=16,
        num_kvcache_blocks=14,
        max_num_batched_tokens=32,
        max_model_len=256,
    )
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert llm.engine.scheduler.num_preemptions > 0
    expected = peft_greedy(base, loras, prompts, params.max_tokens)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [
        [e, e] for e in expected
    ]


def test_speculative_decoding_verifies_under_each_rows_adapter(adapters):
    """n-gram drafts verified in one step per sequence: each of its tokens under its
    adapter."""
    base, requests = adapters("qwen3")
    prompts, loras = mixed_batch(
        requests, [p * 3 for p in random_prompts([10, 12], seed=18)]
    )
    llm = LLM(
        base,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_model_len=256,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert token_ids(outputs) == peft_greedy(base, loras, prompts)
    assert llm.stats().num_drafts > 0


def test_two_tensor_parallel_ranks_give_peft_merged_tokens(adapters):
    base, requests = adapters("qwen3")
    prompts, loras = mixed_batch(requests, random_prompts([40, 19], seed=13))
    with LLM(
        base,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        tensor_parallel_size=2,
        kvcache_block_size=16,
        max_model_len=256,
    ) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert token_ids(outputs) == peft_greedy(base, loras, prompts)


def test_one_slot_serves_two_adapters_in_turn(adapters):
    """With max_loras=1 the engine holds one adapter's sequences at a time (the others
    wait above it, in order); the base model's run beside them. Each gets its own
    tokens."""
    base, requests = adapters("qwen3")
    prompts, loras = mixed_batch(requests, random_prompts([30, 17], seed=14))
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=256)
    steps = []
    prepare = llm.engine.runner.prepare_inputs

    def record(step):
        inputs = prepare(step)
        steps.append(
            {llm.engine.runner.extension.adapters.get(seq) for seq in step.seqs}
            - {None}
        )
        return inputs

    llm.engine.runner.prepare_inputs = record
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert token_ids(outputs) == peft_greedy(base, loras, prompts)
    assert max(map(len, steps)) == 1 and set().union(*steps) == set(requests)


def test_a_request_waiting_for_a_slot_can_be_aborted(adapters):
    base, (first, second) = adapters("qwen3")
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=256)
    prompt = random_prompts([12], seed=19)[0]
    running = llm.add_request(prompt, GREEDY, lora_request=first)
    waiting = llm.add_request(prompt, GREEDY, lora_request=second)
    assert [r.request_id for r in llm.lora.held] == [waiting]
    llm.abort(waiting)
    assert not llm.lora.held
    outputs = {}
    while not llm.is_finished():
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert list(outputs) == [running]
    assert token_ids(outputs.values()) == peft_greedy(base, [first], [prompt])


def test_slots_are_refilled_least_recently_used_first(adapters, tmp_path):
    base, (first, second) = adapters("qwen3")
    third = LoRARequest(
        "third", 3, write_adapter(base, str(tmp_path / "c"), 2, ["o_proj"], 3)
    )
    llm = LLM(
        base,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=2,
        max_model_len=256,
    )
    runner = llm.engine.runner.extension
    prompt = random_prompts([20], seed=15)
    loads = []
    load = runner._load
    runner._load = lambda slot, request, generation: (
        loads.append((slot, request.lora_name)) or load(slot, request, generation)
    )
    for request in (first, second, first, third, first, second):
        output = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=request)
        assert token_ids(output) == peft_greedy(base, [request], prompt)
    # third evicts second (used before first's second run); second then evicts third
    assert loads == [(0, "qwen3-a"), (1, "qwen3-b"), (1, "third"), (1, "qwen3-b")]
    # max_cpu_loras=2
    assert [key[0] for key in runner.staged] == ["qwen3-a", "qwen3-b"]


def test_rows_slots_stay_in_the_tensor_a_cuda_graph_reads():
    rows = RowSlots(8, torch.device("cpu"))
    buffer = rows.buffer
    rows.set(np.array([1, -1, 0]))
    assert rows.slots is buffer and buffer.tolist() == [1, -1, 0, -1, -1, -1, -1, -1]
    assert rows.active
    rows.set(np.array([-1, -1]))
    assert not rows.active  # on CPU a batch of the base model skips the delta
    # a longer (eager) step: its own tensor, the graphs' untouched
    rows.set(np.arange(10) % 2)
    assert (
        rows.slots.tolist() == (np.arange(10) % 2).tolist() and rows.slots is not buffer
    )


@pytest.mark.parametrize("delta", [lora_delta_torch, lora_delta_triton])
@pytest.mark.parametrize(
    "rows, dtype", [(1, torch.float32), (7, torch.float32), (70, torch.bfloat16)]
)
def test_the_batched_delta_is_each_rows_own_adapter(delta, rows, dtype):
    """y += B[slot] A[slot] x for each row (slot -1: nothing), the torch path and the
    Triton kernels (under TRITON_INTERPRET=1 on CPU), tiles part-filled (in 72, out 130,
    ranks 20)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=g).to(dtype)
    a = torch.randn(3, 20, 72, generator=g).to(dtype)
    b = torch.randn(130, 3, 20, generator=g).to(dtype)
    slots = torch.randint(-1, 3, (rows,), generator=g)
    slots[0] = 2
    y = torch.randn(rows, 130, generator=g).to(dtype)
    expected, out = y.clone(), y.clone()
    lora_delta_reference(expected, x, a, b, slots)
    delta(out, x, a, b, slots)
    tolerance = 1e-6 if dtype == torch.float32 else 0.02  # of the largest entry
    error = (out.float() - expected.float()).abs().max()
    assert error <= tolerance * expected.float().abs().max()
    assert not torch.equal(expected, y)
    base_rows = slots == -1
    assert torch.equal(out[base_rows], y[base_rows])


def test_lora_off_leaves_the_projections_alone(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=128)
    assert llm.lora is None
    assert not any(
        isinstance(getattr(m, "method", None), LoRALinear)
        for m in llm.engine.runner.model.modules()
    )
    with pytest.raises(
        ValueError,
        match="lora_request needs LoRA enabled: create the engine "
        "with enable_lora=True",
    ):
        llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("a", 1, "/nowhere"))


def _broken(source: str, path, config=None, tensors=None) -> str:
    """A copy of the adapter at `source` with its config updated and tensors
    replaced."""
    os.makedirs(path)
    with open(f"{source}/adapter_config.json") as f:
        data = json.load(f)
    with open(f"{path}/adapter_config.json", "w") as f:
        json.dump({**data, **(config or {})}, f)
    save_file(
        tensors
        if tensors is not None
        else load_file(f"{source}/adapter_model.safetensors"),
        f"{path}/adapter_model.safetensors",
    )
    return str(path)


def test_bad_adapters_are_refused_when_added_and_the_engine_goes_on(adapters, tmp_path):
    base, (first, second) = adapters("qwen3")
    tensors = load_file(f"{first.lora_path}/adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    small = load_file(f"{second.lora_path}/adapter_model.safetensors")
    cases = {
        "cannot read .*adapter_config.json": str(tmp_path / "missing"),
        "use_dora=True is not supported": _broken(
            first.lora_path, tmp_path / "dora", {"use_dora": True}
        ),
        "bias='all' is not supported": _broken(
            first.lora_path, tmp_path / "bias", {"bias": "all"}
        ),
        "modules_to_save=.* is not supported": _broken(
            first.lora_path, tmp_path / "save", {"modules_to_save": ["lm_head"]}
        ),
        "rank 8 .* over max_lora_rank=4": first.lora_path,
        "targets model.layers.9.[a-z_.]+, which the model does not have": _broken(
            first.lora_path,
            tmp_path / "layer9",
            tensors={
                k.replace("layers.0.", "layers.9."): v for k, v in tensors.items()
            },
        ),
        "targets lm_head, which nanopaged does not adapt": _broken(
            first.lora_path,
            tmp_path / "head",
            tensors={
                "base_model.model.lm_head.lora_A.weight": tensors[key],
                "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 8),
            },
        ),
        "do not fit the model": _broken(
            second.lora_path,
            tmp_path / "shape",
            tensors={
                **small,
                next(k for k in small if "q_proj.lora_A" in k): torch.zeros(4, 48),
            },
        ),
    }
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4, max_model_len=128)
    for i, (message, path) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            llm.generate(
                [1, 2, 3],
                GREEDY,
                use_tqdm=False,
                lora_request=LoRARequest(f"bad{i}", i + 1, path),
            )
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.add_request([1, 2, 3], GREEDY, lora_request="qwen3-b")
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("x", 0, second.lora_path)
    prompt = random_prompts([20], seed=16)
    assert token_ids(
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=second)
    ) == peft_greedy(base, [second], prompt)


@pytest.mark.parametrize(
    "bad", ["nan-matrix", "inf-matrix", "nan-alpha", "inf-alpha", "overflowing-alpha"]
)
def test_an_adapter_with_non_finite_numbers_is_refused_and_no_row_is_touched(
    adapters, tmp_path, bad
):
    """A NaN or an infinity in a matrix, or a lora_alpha of NaN or Infinity (which
    `<= 0` lets through), or a finite one whose scaling of lora_B overflows the model's
    dtype, is refused by name when the adapter is read; the engine then serves the
    base model and a good adapter, batched together, as before."""
    base, (first, second) = adapters("qwen3")
    tensors = load_file(f"{first.lora_path}/adapter_model.safetensors")
    key = next(k for k in tensors if "v_proj.lora_B" in k)
    poisoned = tensors[key].clone()
    poisoned[0, 0] = float("nan") if bad.startswith("nan") else float("inf")
    if bad.endswith("matrix"):
        path = _broken(
            first.lora_path, tmp_path / bad, tensors={**tensors, key: poisoned}
        )
        message = f"tensor '{key}' in .* holds NaN or infinite values"
    elif bad == "overflowing-alpha":  # finite in its file, infinite times B
        path = _broken(first.lora_path, tmp_path / bad, {"lora_alpha": 1e300})
        message = "lora_B times its scaling is not finite in torch.float32"
    else:
        alpha = float("nan") if bad.startswith("nan") else float("inf")
        path = _broken(first.lora_path, tmp_path / bad, {"lora_alpha": alpha})
        message = "lora_alpha must be a positive number, got (nan|inf)"
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128)
    with pytest.raises(ValueError, match=message):
        llm.add_lora(LoRARequest("bad", 9, path))
    prompts = random_prompts([20, 14], seed=17)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[None, second])
    assert token_ids(outputs) == peft_greedy(base, [None, second], prompts)


def test_a_slot_holding_a_nan_reaches_no_other_row():
    """Rows of other slots and of the base model never meet a slot's numbers: a NaN
    there (never loaded: it is refused, but whatever is in a slot) stays in its rows."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 24, generator=g)
    a, b = torch.randn(3, 4, 16, generator=g), torch.randn(24, 3, 4, generator=g)
    a[1], b[:, 1] = float("nan"), float("inf")
    slots = torch.tensor([-1, 0, 1, 2, -1, 0])
    out, expected = y.clone(), y.clone()
    lora_delta_torch(out, x, a, b, slots)
    lora_delta_reference(expected, x, a, b, slots)
    clean = slots != 1
    assert torch.isfinite(out[clean]).all()
    assert torch.allclose(out[clean], expected[clean], atol=1e-5)


def test_the_server_answers_the_base_model_and_two_adapters_in_one_run(
    adapters, monkeypatch
):
    """`--lora-modules` in both of vLLM's forms; each model's text (streamed too) equals
    the offline engine's; adapters loaded and unloaded at run time as vLLM's endpoints
    do."""
    import httpx

    openai = pytest.importorskip("openai")
    from test_server import Server

    base, (first, second) = adapters("qwen3")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    server = Server(
        base,
        "--max-model-len",
        "256",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"a={first.lora_path}",
        json.dumps({"name": "b", "path": second.lora_path, "base_model_name": "tiny"}),
    )
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256)
    prompt = "LoRA adds a low-rank update to each projection"
    expected = {
        name: llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
        .outputs[0]
        .text
        for name, lora in (("tiny", None), ("a", first), ("b", second))
    }
    assert len(set(expected.values())) == 3
    client = server.client
    try:
        models = {m.id: m for m in client.models.list().data}
        assert list(models) == ["tiny", "a", "b"]
        assert (models["a"].root, models["a"].parent) == (first.lora_path, "tiny")

        def complete(name: str) -> tuple[str, str]:
            whole = client.completions.create(
                model=name, prompt=prompt, max_tokens=16, temperature=0
            )
            stream = client.completions.create(
                model=name, prompt=prompt, max_tokens=16, temperature=0, stream=True
            )
            assert whole.model == name
            return whole.choices[0].text, "".join(c.choices[0].text for c in stream)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = dict(zip(expected, pool.map(complete, [*expected] * 2)))
        assert answers == {name: (text, text) for name, text in expected.items()}
        with pytest.raises(openai.NotFoundError, match="'c' does not exist"):
            client.completions.create(model="c", prompt=prompt, max_tokens=2)

        def post(path: str, **body) -> httpx.Response:
            return httpx.post(
                f"{server.url}/v1/{path}_lora_adapter", json=body, timeout=60
            )

        assert post("load", lora_name="c", lora_path="/nowhere").status_code == 400
        loaded = post("load", lora_name="c", lora_path=first.lora_path)
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        assert post("load", lora_name="c", lora_path=first.lora_path).status_code == 400
        assert (
            client.completions.create(
                model="c", prompt=prompt, max_tokens=16, temperature=0
            )
            .choices[0]
            .text
            == expected["a"]
        )
        assert post("unload", lora_name="c").status_code == 200
        assert post("unload", lora_name="c").status_code == 404
        assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt=prompt, max_tokens=2)
    finally:
        assert server.stop()
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanopaged",
            "serve",
            base,
            "--enable-lora",
            "--lora-modules",
            "x=/nowhere",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "LoRA adapter 'x': cannot read" in refused.stderr


@pytest.mark.parametrize(
    "names", [["--served-model-name", "m", "m=A"], ["a=A", "a=B"], ["BASE=A"]]
)
def test_an_adapter_named_as_another_model_is_refused_at_start(names, adapters):
    """`--lora-modules m=PATH` beside `--served-model-name m` would list `m` twice and
    hide the base model: refused before the engine starts, as the runtime endpoint does;
    so is an adapter named twice, or named as the model's path."""
    from nanopaged.serving.args import parse_args

    base, (first, second) = adapters("qwen3")
    paths = {"A": first.lora_path, "B": second.lora_path}
    argv = [arg.replace("BASE", base) for arg in names]
    flags = [a for a in argv if "=" not in a]
    modules = [
        name + "=" + paths[path]
        for name, path in (a.split("=") for a in argv if "=" in a)
    ]
    with pytest.raises(SystemExit):
        parse_args([base, "--enable-lora", *flags, "--lora-modules", *modules])
    assert parse_args(
        [base, "--enable-lora", "--lora-modules", f"ok={first.lora_path}"]
    )


def test_the_runtime_adapter_endpoints_are_off_without_vllms_variable(
    adapters, qwen3_path
):
    from test_server import Server

    server = Server(qwen3_path, "--max-model-len", "128")
    try:
        import httpx

        response = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "a", "lora_path": "/x"},
        )
        assert response.status_code == 404
    finally:
        assert server.stop()


def test_an_adapter_removed_and_rewritten_is_read_again_and_its_blocks_not_served(
    adapters, tmp_path
):
    """`remove_lora` forgets the adapter's copies and its cached prefixes: new files at
    the same path give the new adapter's tokens, with no block of the old one served."""
    base, (first, _) = adapters("qwen3")
    path = write_adapter(base, str(tmp_path / "x"), 4, ["q_proj"], 5)
    lora = LoRARequest("x", 7, path)
    llm = LLM(
        base,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kvcache_block_size=16,
        max_model_len=256,
    )
    assert llm.add_lora(lora) and llm.list_loras() == {7}
    prompt = random_prompts([40], seed=17)
    old = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
    assert token_ids(old) == peft_greedy(base, [lora], prompt)
    # the same directory now holds another adapter
    for name in os.listdir(first.lora_path):
        shutil.copy(os.path.join(first.lora_path, name), path)
    assert llm.remove_lora(7) and not llm.remove_lora(7) and llm.list_loras() == set()
    new = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
    assert new[0].num_cached_tokens == 0
    assert token_ids(new) == peft_greedy(base, [first], prompt) != token_ids(old)


def test_the_slot_plan_holds_however_late_the_device_runs_a_step(adapters, tmp_path):
    """With async scheduling the host plans step n+1's slots before the device has run
    step n: here n loads a third adapter over the first one's slot, and n+1, planned
    before n ran, uses the first adapter. Each gets its own tokens."""
    base, (first, second) = adapters("qwen3")
    third = LoRARequest(
        "third", 3, write_adapter(base, str(tmp_path / "c"), 2, ["o_proj"], 3)
    )
    llm = LLM(
        base,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_model_len=256,
        async_scheduling=True,
    )
    prompts = random_prompts([20, 26], seed=16)
    for request in (first, second):  # first in slot 0 (the least recent), second in 1
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=request)
    runner = llm.engine.runner
    compute, launch = runner._compute, runner.launch
    second_launched = threading.Event()

    def late_compute(launched, *rest):  # the first step waits for the next one's launch
        if not second_launched.is_set():
            assert second_launched.wait(timeout=30)
        compute(launched, *rest)

    def noting_launch(step, pending=None):
        launched = launch(step, pending)
        if first in map(runner.extension.adapters.get, step.seqs):
            second_launched.set()
        return launched

    runner._compute, runner.launch = late_compute, noting_launch
    ids = [llm.add_request(prompts[0], GREEDY, lora_request=third)]
    llm.step()  # launches the third adapter's prefill, which loads it over slot 0
    ids.append(llm.add_request(prompts[1], GREEDY, lora_request=first))
    outputs = {}
    while not llm.is_finished():
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert second_launched.is_set()
    got = [outputs[i].outputs[0].token_ids for i in ids]
    assert got == peft_greedy(base, [third, first], prompts)
