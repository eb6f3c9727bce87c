"""What one decode step runs, engine beside engine: `python bench.py --kernels
--engines nanopaged:triton,nano-vllm` fills a batch of `--batch-sizes` (the first)
requests of `--context`-token prompts in each engine, in its own process, lets it decode
a few steps, then records a few more whole steps (scheduling and bookkeeping included)
with torch.profiler. Per step: the wall time, the time some kernel ran (busy), what the
host left the device idle (wall - busy), the launches, and the kernels that took most.
"""

import time

from benchmarks.engines import run_engine
from benchmarks.workload import sync

WARM_STEPS, PROFILED_STEPS = 3, 5


def _profiled(step, num_steps: int) -> dict:
    """Runs `step()` `num_steps` times under torch.profiler -> per-step figures. On a
    GPU the kernels are the device's; on a CPU, the top-level torch ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        for _ in range(num_steps):
            step()
        sync()
        wall = time.perf_counter() - start
    if on_gpu:
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    else:
        kernels = [
            e
            for e in prof.events()
            if e.cpu_parent is None and e.name.startswith("aten")
        ]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")  # the union of the kernels' spans, in µs
    for lo, hi in spans:
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    return dict(
        wall_ms=wall / num_steps * 1e3,
        busy_ms=busy / num_steps / 1e3,
        idle_ms=max(0.0, wall * 1e3 - busy / 1e3) / num_steps,
        launches=len(kernels) / num_steps,
        kernels=[
            dict(
                name=name[:90], calls=len(us) / num_steps, ms=sum(us) / num_steps / 1e3
            )
            for name, us in top[:12]
        ],
    )


def _prompts(vocab_size: int, batch: int, context: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    top = min(10000, vocab_size)
    return torch.randint(0, top, (batch, context), generator=g).tolist()


def profile_nanopaged(model: str, work, args, backend: str = "auto") -> dict:
    from nanopaged import LLM, SamplingParams

    batch, context = args.batch_sizes[0], args.context
    llm = LLM(
        model,
        attention_backend=backend,
        max_num_seqs=batch,
        max_model_len=context + 64,
        enforce_eager=args.enforce_eager,
    )
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64)
    for prompt in _prompts(llm.config.hf_config.vocab_size, batch, context):
        llm.add_request(prompt, params)

    def decode() -> bool:
        step = llm.run_step()[0]
        return not step.ragged and len(step.seqs) == batch

    # chunked prefill puts a decode step between a prompt's chunks: until all are in
    while not decode():
        pass
    for _ in range(WARM_STEPS):
        decode()

    def profiled_step() -> None:
        if not decode():
            raise RuntimeError(f"a profiled step was not a decode of all {batch}")

    return _profiled(profiled_step, PROFILED_STEPS)


def profile_nano_vllm(model: str, work, args) -> dict:
    from nanovllm import LLM, SamplingParams
    from transformers import AutoConfig

    batch, context = args.batch_sizes[0], args.context
    llm = LLM(
        model,
        enforce_eager=args.enforce_eager,
        max_model_len=context + 64,
        max_num_seqs=batch,
    )
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64)
    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    for prompt in _prompts(vocab_size, batch, context):
        llm.add_request(prompt, params)
    while llm.step()[1] > 0:  # nano-vllm: a prefill step's count is positive
        pass
    for _ in range(WARM_STEPS):
        llm.step()
    return _profiled(llm.step, PROFILED_STEPS)


RUNNERS = {"nanopaged": profile_nanopaged, "nano-vllm": profile_nano_vllm}


def kernel_profiles(model: str, args) -> dict:
    """engine -> its decode step's profile (or why there is none)."""
    return {
        engine: run_engine(engine, model, None, args, RUNNERS)
        if engine.partition(":")[0] in RUNNERS
        else {"skipped": f"no kernel profile of {engine}"}
        for engine in args.engines.split(",")
    }


def print_kernels(profiles: dict) -> None:
    for engine, result in profiles.items():
        if "wall_ms" not in result:
            print(f"{engine}: {result}")
            continue
        print(
            f"{engine}: {result['wall_ms']:.2f} ms a decode step, kernels busy "
            f"{result['busy_ms']:.2f} ms, idle {result['idle_ms']:.2f} ms, "
            f"{result['launches']:.0f} launches"
        )
        for kernel in result["kernels"]:
            print(f"  {kernel['ms']:8.3f} ms {kernel['calls']:6.0f}x  {kernel['name']}")
