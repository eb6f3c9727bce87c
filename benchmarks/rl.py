"""What docs/rl.md states about an RL loop, measured on a Qwen3-0.6B-shaped model with
random weights (the default preset's checkpoint): a full update of the weights, in
process and through the weight transfer (gloo), the memory sleep gives back, and the
largest gap between the engine's logprobs and transformers' on the same tokens.

    python -m benchmarks.rl [--model PATH] [--device cpu]
"""

import argparse
import statistics
import threading
import time

import psutil
import torch
from transformers import AutoModelForCausalLM

from benchmarks.workload import preset_checkpoint
from nanopaged import LLM, SamplingParams
from nanopaged.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from nanopaged.utils import get_open_port


def resident_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the random Qwen3-0.6B shape")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model = args.model or preset_checkpoint("default")
    llm = LLM(
        model,
        max_model_len=1024,
        num_kvcache_blocks=256,
        enable_sleep_mode=True,
        weight_transfer_config={"backend": "gloo"},
        logprobs_mode="processed_logprobs",
    )
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    weights = [(name, p.detach()) for name, p in policy.named_parameters()]
    size_gb = sum(t.numel() * t.element_size() for _, t in weights) / 1e9
    engine_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    result = {"weights_gb": size_gb}

    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        engine_model.load_weights(weights)
        times.append(time.perf_counter() - start)
    result["load_weights_s"] = statistics.median(times)

    info = dict(master_address="127.0.0.1", master_port=get_open_port(), world_size=2)
    joined = {}
    thread = threading.Thread(
        target=lambda: joined.update(g=NCCLWeightTransferEngine.trainer_init(info))
    )
    thread.start()
    llm.init_weight_transfer_engine({"init_info": dict(info, rank_offset=1)})
    thread.join()
    update_info = {
        "names": [name for name, _ in weights],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        "shapes": [list(t.shape) for _, t in weights],
    }
    times = []
    for _ in range(args.rounds):
        sender = threading.Thread(
            target=NCCLWeightTransferEngine.trainer_send_weights,
            args=(iter(weights), {"group": joined["g"]}),
        )
        start = time.perf_counter()
        llm.start_weight_update()
        sender.start()
        llm.update_weights({"update_info": update_info})
        sender.join()
        llm.finish_weight_update()
        times.append(time.perf_counter() - start)
    result["weight_transfer_s"] = statistics.median(times)

    prompts = [list(range(100 + 7 * i, 164 + 7 * i)) for i in range(4)]
    params = SamplingParams(
        temperature=0.7, n=2, max_tokens=32, logprobs=0, ignore_eos=True, seed=0
    )
    gap = 0.0
    with torch.no_grad():
        for prompt, output in zip(
            prompts, llm.generate(prompts, params, use_tqdm=False)
        ):
            for completion in output.outputs:
                tokens = completion.token_ids
                logits = policy(torch.tensor([prompt + tokens])).logits[0]
                logits = logits[len(prompt) - 1 : -1] / 0.7
                trainer = logits.log_softmax(-1)[torch.arange(len(tokens)), tokens]
                engine = torch.tensor(
                    [e[t].logprob for e, t in zip(completion.logprobs, tokens)]
                )
                gap = max(gap, (trainer - engine).abs().max().item())
    result["logprob_gap"] = gap

    cache = llm.engine.runner.kv_cache
    result["kv_cache_mb"] = cache.numel() * cache.element_size() / 2**20
    for level in (1, 2):
        cache.fill_(0.0)  # every page of it resident
        before = resident_mb()
        start = time.perf_counter()
        llm.sleep(level=level)
        result[f"sleep{level}_s"] = time.perf_counter() - start
        result[f"sleep{level}_returned_mb"] = before - resident_mb()
        start = time.perf_counter()
        llm.wake_up()
        result[f"wake{level}_s"] = time.perf_counter() - start
        if level == 2:
            engine_model.load_weights(weights)
    for name, value in result.items():
        print(f"{name:24} {value:.3g}")
    return result


if __name__ == "__main__":
    main()
