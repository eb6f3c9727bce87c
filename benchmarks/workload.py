"""What the benchmarks run: the presets (a model shape, its dtype, the workload's
defaults), the workload itself (nano-vllm's: random token ids, lengths uniform in
ranges), and timing helpers."""

import os
import statistics
import sys
import time
from dataclasses import dataclass

from nanopaged.random_checkpoint import TINY_QWEN3

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanopaged")


# Qwen3-0.6B's published shape, for benchmarks with random weights.
QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)


# A small model for CPUs: 4 layers of width 256, a 32k vocabulary.
CPU_QWEN3 = dict(
    TINY_QWEN3,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=4096,
)


# name: (checkpoint, its shape and dtype, default flags)
PRESETS = {
    "default": (
        "random-qwen3-0.6b",
        QWEN3_0_6B,
        "bfloat16",
        dict(
            engines="nanopaged,nano-vllm",
            num_requests=256,
            prompt_len=[100, 1024],
            output_len=[100, 1024],
            max_model_len=4096,
            batch_sizes=[1, 64, 256],
            context=1000,
            prefill_seqs=16,
            request_rate=[8, 16, 24],
        ),
    ),
    "cpu": (
        "random-cpu-qwen3",
        CPU_QWEN3,
        "float32",
        dict(
            engines="nanopaged,hf-static,hf",
            num_requests=48,
            prompt_len=[64, 512],
            output_len=[32, 256],
            max_model_len=1024,
            batch_sizes=[1, 16, 48],
            context=512,
            prefill_seqs=4,
            request_rate=[1, 2, 4],
        ),
    ),
    "tiny": (
        "random-tiny-qwen3",
        TINY_QWEN3,
        "float32",
        dict(
            engines="nanopaged,nano-vllm",
            num_requests=8,
            prompt_len=[8, 64],
            output_len=[8, 32],
            max_model_len=512,
            batch_sizes=[1, 4],
            context=64,
            prefill_seqs=2,
            request_rate=[4, 16],
        ),
    ),
}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float


def make_workload(args, vocab_size: int) -> Workload:
    """nano-vllm's benchmark: random token ids below 10,000, lengths uniform in the
    ranges."""
    import torch

    g = torch.Generator().manual_seed(args.seed)
    top = min(10000, vocab_size)

    def uniform(low, high):
        return torch.randint(low, high + 1, (args.num_requests,), generator=g).tolist()

    prompt_lens, output_lens = uniform(*args.prompt_len), uniform(*args.output_len)
    prefixes = [
        torch.randint(0, top, (args.prefix_len,), generator=g).tolist()
        for _ in range(args.prefix_groups)
    ]
    prompts = [
        prefixes[i % args.prefix_groups]
        + torch.randint(0, top, (n,), generator=g).tolist()
        for i, n in enumerate(prompt_lens)
    ]
    return Workload(prompts, output_lens, args.temperature)


def warmup_prompts(work: Workload) -> list[list[int]]:
    """Four prompts the timed run does not contain, so the warm-up leaves no
    prefix-cache hits."""
    return [p[::-1] for p in work.prompts[:4]]


def repetitive_workload(args, vocab_size: int, num_requests: int = 8) -> Workload:
    """Prompts that quote a random text twice, greedy: proposals can hit (in the quote,
    and in the loops a random-weight model falls into)."""
    import torch

    g = torch.Generator().manual_seed(args.seed)
    low, high = args.prompt_len
    texts = [
        torch.randint(0, min(10000, vocab_size), (n,), generator=g).tolist()
        for n in torch.randint(low // 2, high // 2 + 1, (num_requests,), generator=g)
    ]
    return Workload(
        [text * 2 for text in texts], [args.output_len[1]] * num_requests, 0.0
    )


def resolve_model(args) -> str:
    """--model, or the preset's random-weight checkpoint."""
    return args.model or preset_checkpoint(args.preset)


def preset_checkpoint(preset: str) -> str:
    """A preset's random-weight checkpoint (written on first use)."""
    from nanopaged.random_checkpoint import write_random_checkpoint

    name, shape, dtype, _ = PRESETS[preset]
    path = os.path.join(CACHE_DIR, name)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        print(f"writing a random-weight {name} checkpoint to {path}", file=sys.stderr)
        write_random_checkpoint(path, shape, dtype=dtype)
    return path


def timed(fn):
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


# where a run's steps are counted: its prefill steps, then its decode steps by batch
# size (the run's tail is its small batches)
PHASES = ("prefill", "decode b<=16", "decode b<=64", "decode b<=128", "decode b>128")


class StepClock:
    """Wraps an engine's step function and times each call by phase: `phase(result)`
    says ("prefill" or "decode", batch size). Where a whole run's time went, engine
    beside engine; each step ends with its sampled tokens on the host, so its wall time
    is its own."""

    def __init__(self, step, phase):
        self.step, self.phase = step, phase
        self.times: dict[str, list[float]] = {kind: [] for kind in PHASES}

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        result = self.step(*args, **kwargs)
        seconds = time.perf_counter() - start
        kind, batch = self.phase(result)
        if kind == "decode":
            kind = next(
                (k for k in PHASES[1:-1] if batch <= int(k.partition("=")[2])),
                PHASES[-1],
            )
        self.times[kind].append(seconds)
        return result

    def phases(self) -> dict:
        """phase -> its steps and seconds."""
        return {
            kind: dict(steps=len(times), seconds=sum(times))
            for kind, times in self.times.items()
        }


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def repeated_time(fn, repeat: int = 10, pick=statistics.median) -> float:
    """`pick` (the median: a slow moment moves it little) of `repeat` timed runs of
    `fn`, after one to warm up."""
    fn()
    times = []
    for _ in range(repeat):
        elapsed, _ = timed(fn)
        times.append(elapsed)
    return pick(times)


def bar(items, desc: str, shown: bool):
    """`items`, with a progress bar on stderr when `shown`."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=not shown, dynamic_ncols=True)
