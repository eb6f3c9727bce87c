"""Data parallelism on CPU: replicas in processes of their own give a single engine's
outputs, in order; the server's router sends a prompt where its prefix went, within a
balance."""

import gc
import os
import types

import psutil
import pytest
from conftest import random_prompts

from nanopaged import LLM, LoRARequest, SamplingParams
from nanopaged.engine.data_parallel import DataParallelLLM, Replica
from nanopaged.serving.router import Router

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def replica_processes() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    ]


@pytest.fixture(scope="module")
def single(qwen3_path):
    """prompts -> a single engine's greedy tokens."""
    llm = LLM(qwen3_path, max_model_len=256)
    yield lambda prompts, params=GREEDY: [
        o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
    ]
    llm.close()


def test_replicas_return_a_single_engines_outputs_in_order(qwen3_path, single):
    prompts = random_prompts([5, 30, 12, 44, 9, 17, 3], seed=70)  # not a multiple of 3
    params = [
        SamplingParams(temperature=0, max_tokens=4 + i) for i in range(len(prompts))
    ]
    with LLM(qwen3_path, max_model_len=256, data_parallel_size=3) as llm:
        assert isinstance(llm, DataParallelLLM) and len(replica_processes()) == 3
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == prompts
        assert [o.outputs[0].token_ids for o in outputs] == single(prompts, params)
        assert llm.stats().num_generated_tokens == sum(
            len(o.outputs[0].token_ids) for o in outputs
        )
        [chat] = llm.chat(
            [{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False
        )
        assert chat.outputs[0].token_ids == single([chat.prompt_token_ids])[0]
    assert not replica_processes()


def test_a_step_at_a_time_across_replicas(qwen3_path, single):
    prompts = random_prompts([6, 20, 11], seed=71)
    with LLM(qwen3_path, max_model_len=256, data_parallel_size=2) as llm:
        ids = [llm.add_request(p, GREEDY) for p in prompts]
        assert len(set(ids)) == 3
        # the least busy, in turn
        assert [llm.requests[i].index for i in ids] == [0, 1, 0]
        with pytest.raises(ValueError, match="requests added with add_request"):
            llm.generate(prompts, GREEDY)
        llm.abort(ids[2])
        finished = {}
        while not llm.is_finished():
            finished.update(
                {o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished}
            )
        assert finished == dict(zip(ids[:2], single(prompts[:2])))
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_bad_input_is_refused_before_any_replica_runs(qwen3_path):
    with LLM(qwen3_path, max_model_len=256, data_parallel_size=2) as llm:
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.generate([[5, 6], []], GREEDY)
        assert llm.stats().num_generated_tokens == 0
        with pytest.raises(ValueError, match="outside the vocabulary|vocabulary"):
            llm.add_request([10**6], GREEDY)
        assert llm.is_finished()
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        LLM(qwen3_path, data_parallel_size=0)


def test_tensor_parallel_replicas(qwen3_path, single):
    prompts = random_prompts([8, 25, 14], seed=72)
    with LLM(
        qwen3_path, max_model_len=256, data_parallel_size=2, tensor_parallel_size=2
    ) as llm:
        assert len(replica_processes()) == 4  # two replicas, each with a worker rank
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == single(prompts)
    assert not replica_processes()


class FakeLoop:
    def __init__(self, in_flight: int):
        self.outboxes = dict.fromkeys(range(in_flight))
        self.submitted = []

    def submit(self, request_id, prompt, params, outbox, lora_request=None):
        self.submitted.append(request_id)

    def is_alive(self) -> bool:
        return True


def make_router(loads: list[int], policy: str = "prefix") -> Router:
    llm = types.SimpleNamespace(config=types.SimpleNamespace(kvcache_block_size=4))
    return Router(
        llm, [FakeLoop(n) for n in loads], max_waiting=10, policy=policy, balance=2
    )


def test_the_router_follows_the_longest_prefix_within_the_balance():
    router = make_router([0, 0, 0])
    shared = list(range(8))  # two blocks of 4
    router.submit("a", {"prompt_token_ids": shared + [50]}, None, None)
    assert router.routed[0] == {"prefix": 0, "least_busy": 1}
    # busier by the balance: still chosen
    router.loops[0].outboxes = dict.fromkeys(range(2))
    router.submit("b", {"prompt_token_ids": shared + [51]}, None, None)
    assert router.loops[0].submitted == ["a", "b"] and router.routed[0]["prefix"] == 1
    router.loops[0].outboxes = dict.fromkeys(range(3))  # beyond it: the least busy
    router.submit("c", {"prompt_token_ids": shared[:4] + [52] * 4}, None, None)
    assert router.loops[1].submitted == ["c"] and router.routed[1]["least_busy"] == 1
    # the longest matching prefix wins: replica 1 now holds the first block, 0 holds two
    router.loops[0].outboxes = {}
    router.submit("d", {"prompt_token_ids": shared + [53]}, None, None)
    assert router.loops[0].submitted[-1] == "d"
    router.loops[0].outboxes = router.loops[1].outboxes = {0: None}
    # its blocks are not the base model's: no prefix
    adapter = LoRARequest("a", 1, "/a")
    router.submit("g", {"prompt_token_ids": shared + [53]}, None, None, adapter)
    assert router.loops[2].submitted == ["g"] and router.routed[2]["least_busy"] == 1
    router.loops[2].outboxes = {}
    router.submit("e", {"prompt_token_ids": [7, 7, 7]}, None, None)  # no whole block
    assert router.loops[2].submitted == ["g", "e"]
    router.loops[0].is_alive = lambda: False  # its engine loop ended: never chosen
    router.loops[0].outboxes = {}
    router.submit("f", {"prompt_token_ids": shared + [54]}, None, None)
    assert router.loops[0].submitted[-1] == "d" and router.loops[1].submitted[-1] == "f"


def test_the_least_busy_policy_ignores_prefixes():
    router = make_router([1, 0], policy="least")
    router.submit("a", {"prompt_token_ids": list(range(8))}, None, None)
    router.loops[1].outboxes = dict.fromkeys(range(2))
    router.submit("b", {"prompt_token_ids": list(range(8))}, None, None)
    assert [loop.submitted for loop in router.loops] == [["b"], ["a"]]
    assert router.routed == [
        {"prefix": 0, "least_busy": 1},
        {"prefix": 0, "least_busy": 1},
    ]


def interrupt_first_receive(monkeypatch):
    """Ctrl-C while the caller waits for the first answer of a replica."""
    receive, calls = Replica.receive, []

    def interrupted(self):
        if not calls:
            calls.append(self.index)
            raise KeyboardInterrupt
        return receive(self)

    monkeypatch.setattr(Replica, "receive", interrupted)


def test_ctrl_c_leaves_the_replicas_in_step(qwen3_path, single, monkeypatch):
    first, second = (
        random_prompts([7, 9], seed=73),
        random_prompts([11, 5, 13], seed=74),
    )
    with LLM(qwen3_path, max_model_len=256, data_parallel_size=2) as llm:
        interrupt_first_receive(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(first, GREEDY, use_tqdm=False)
        monkeypatch.undo()
        # the interrupted answer is not taken for the next call's
        outputs = llm.generate(second, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == single(second)
        for prompt in first:
            llm.add_request(prompt, GREEDY)
        interrupt_first_receive(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            llm.step()
        monkeypatch.undo()
        # every request of the step aborted: none waits forever
        assert llm.is_finished()
        outputs = llm.generate(second, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == single(second)
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_spawned_replicas_and_their_share_of_the_gpus(qwen3_path, single, monkeypatch):
    """On GPUs replicas are spawned (a forked child could not choose its GPUs), each
    seeing its own `tensor_parallel_size` of them; spawned on CPU here, as vLLM's
    variable asks."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    prompts = random_prompts([6, 15, 9], seed=75)
    with LLM(qwen3_path, max_model_len=256, data_parallel_size=2) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == single(prompts)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    on_gpus = types.SimpleNamespace(
        config=types.SimpleNamespace(device="cuda"),
        parallel=types.SimpleNamespace(tensor_parallel_size=2),
    )
    assert [DataParallelLLM._gpus(on_gpus, i) for i in range(2)] == [
        ["4", "5"],
        ["6", "7"],
    ]


def test_the_same_api_as_one_engine(qwen3_path, single):
    """stream, has_unfinished_requests, abort_request, get_default_sampling_params and
    reset_prefix_cache, as on a single engine."""
    prompt = random_prompts([9], seed=76)[0]
    with LLM(qwen3_path, max_model_len=256, data_parallel_size=2) as llm:
        streamed = "".join(llm.stream(prompt, GREEDY))
        [whole] = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert streamed == whole.outputs[0].text
        assert whole.outputs[0].token_ids == single([prompt])[0]
        first = llm.add_request(prompt, GREEDY)
        llm.add_request(prompt, GREEDY, request_id="x")
        assert llm.has_unfinished_requests()
        llm.abort_request([first, "x"])
        assert not llm.has_unfinished_requests()
        assert llm.get_default_sampling_params() == SamplingParams()
        assert llm.reset_prefix_cache() is True
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_a_replica_that_dies_fails_its_requests_and_the_others_go_on(
    qwen3_path, single
):
    prompts = random_prompts([6, 13, 8, 10], seed=77)
    with LLM(qwen3_path, max_model_len=256, data_parallel_size=2) as llm:
        ids = [llm.add_request(p, GREEDY) for p in prompts]
        owners = {request_id: llm.requests[request_id].index for request_id in ids}
        llm.step()
        llm.replicas[1].process.kill()
        llm.replicas[1].process.join()
        finished = {}
        while not llm.is_finished():
            finished.update({o.request_id: o for o in llm.step() if o.finished})
        assert sorted(finished) == sorted(ids)
        for request_id, want in zip(ids, single(prompts)):
            output = finished[request_id]
            if owners[request_id] == 1:
                assert "data-parallel replica 1 died" in output.error
            else:
                assert output.error is None and output.outputs[0].token_ids == want
        # the engine goes on with the live replica
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == single(prompts)
        assert llm.add_request(prompts[0], GREEDY) and llm.requests  # on replica 0
        assert all(owner.index == 0 for owner in llm.requests.values())


def test_ctrl_c_while_a_replica_takes_a_request_withdraws_it(
    qwen3_path, single, monkeypatch
):
    prompt = random_prompts([7], seed=78)[0]
    with LLM(qwen3_path, max_model_len=256, data_parallel_size=2) as llm:
        interrupt_first_receive(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            llm.add_request(prompt, GREEDY, request_id="r")
        monkeypatch.undo()
        assert llm.is_finished() and not llm.requests
        # nor is it queued in the replica
        assert llm.stats().num_unfinished_requests == 0
        [output] = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == single([prompt])[0]
        # the id is free again
        assert llm.add_request(prompt, GREEDY, request_id="r") == "r"


class Finalized:
    """An object in a reference cycle (only the collector frees it) whose finalizer
    notes, in `path`, the process that ran it."""

    def __init__(self, path: str):
        self.path, self.cycle = path, self

    def __del__(self):
        with open(self.path, "a") as notes:
            notes.write(f"{os.getpid()}\n")


def collect(worker) -> int:
    gc.collect()
    return os.getpid()


@pytest.mark.parametrize(
    "options",
    [{"data_parallel_size": 2}, {"tensor_parallel_size": 2}],
    ids=["replicas", "ranks"],
)
def test_a_forked_child_never_finalizes_what_it_inherited(
    qwen3_path, tmp_path, options
):
    """A replica or a rank forked from this process inherits its unreachable objects:
    their finalizers must run here alone (a torch.distributed group's, collected in a
    child, waits forever for threads that only this process has)."""
    notes = tmp_path / "finalized"
    gc.disable()  # the garbage lives until the children have been forked
    try:
        Finalized(str(notes))
        with LLM(qwen3_path, max_model_len=256, **options) as llm:
            children = set(llm.collective_rpc(collect)) - {os.getpid()}
    finally:
        gc.enable()
    gc.collect()
    assert len(children) == (2 if "data_parallel_size" in options else 1)
    assert notes.read_text() == f"{os.getpid()}\n"
