"""The GPU's run simulated on a CPU (`bench.py --simulate`): the whole workload through
`LLM.generate`, the model replaced by a device that takes, per step, the kernel-busy
time an H200 measured (a sleep, on a thread of its own, as a GPU's stream runs beside
the host), with async scheduling off and on. The host's work is the engine's own, all
of it: scheduling, inputs, random numbers, outputs and text; every row samples token 0.

How the device's time is made, from the H200 run of docs/speed.md (commit 6d610f9,
flash-attn, Qwen3-0.6B in bfloat16): a decode step of 256 sequences of 1,000 tokens kept
the GPU busy 9.09 ms, 7.39 of them in attention (docs/gpu-kernels.json); the weights'
1.15 GB read at its 4.18 TB/s take 0.28 ms; a prefill of 16 prompts of 1,000 tokens took
52.5 ms (`--steps`). So a step takes DECODE_FIXED_MS, and DECODE_ROW_MS a decoding
sequence, ATTENTION_MS_PER_TOKEN each token of their contexts, PREFILL_MS_PER_TOKEN each
prompt token. What it leaves out: the launches' own host cost (a decode step replays one
CUDA graph), and this machine's host being slower than the H200 machine's.
"""

import concurrent.futures
import time

from benchmarks.workload import make_workload, preset_checkpoint
from nanopaged.random_checkpoint import TINY_QWEN3

DECODE_FIXED_MS = 0.28
DECODE_ROW_MS = (9.09 - 7.39 - DECODE_FIXED_MS) / 256
ATTENTION_MS_PER_TOKEN = 7.39 / (256 * 1000)
PREFILL_MS_PER_TOKEN = 52.5 / 16000
NANO_VLLM_H200 = 19954  # out tok/s, the same run (docs/speed.md)


def busy_seconds(step) -> float:
    """The H200's kernel-busy time for a step (see the module's docstring)."""
    decodes = [i for i, n in enumerate(step.num_tokens) if n == 1]
    prompt_tokens = sum(step.num_tokens) - len(decodes)
    context = sum(step.starts[i] + 1 for i in decodes)
    ms = PREFILL_MS_PER_TOKEN * prompt_tokens
    if decodes:
        ms += DECODE_FIXED_MS + DECODE_ROW_MS * len(decodes)
        ms += ATTENTION_MS_PER_TOKEN * context
    return ms / 1e3


class SimulatedDevice:
    """An engine's runner with the model replaced: a step's host work is the runner's
    own (inputs, random numbers), its device work `busy_seconds` on a thread of its own
    (one step after another, as a stream), and every sampling row gets token 0."""

    def __init__(self, runner):
        self.runner, self.num_kvcache_blocks = runner, runner.num_kvcache_blocks
        self.model = runner.model
        self.stream = concurrent.futures.ThreadPoolExecutor(1)
        self.running, self.device_seconds = {}, 0.0

    def launch(self, step, pending=None):
        from nanopaged.core.step import Launched

        inputs = self.runner.prepare_inputs(step)
        rows = step.sampling_seqs
        uniform = self.runner.sampler.draw(rows, [0] * len(rows)) if rows else None
        launched = Launched(step, inputs, rows, uniform)
        seconds = busy_seconds(step)
        self.device_seconds += seconds
        self.running[launched] = self.stream.submit(time.sleep, seconds)
        return launched

    def collect(self, launched):
        from nanopaged.core.step import SamplerOutput

        self.running.pop(launched).result()
        return SamplerOutput([[0] for _ in launched.step.sampling_seqs])

    def close(self) -> None:
        self.stream.shutdown()


def simulate(args) -> list[dict]:
    """The workload's run with async scheduling off, then on: wall time, device time,
    the host's time (the rest, with overlap off), the share of it hidden, and the out
    tok/s it predicts."""
    from nanopaged import LLM, SamplingParams

    model = preset_checkpoint("tiny")  # the host's work does not depend on it
    work = make_workload(args, TINY_QWEN3["vocab_size"])
    rows = []
    for overlap in (False, True):
        llm = LLM(
            model,
            device="cpu",
            max_model_len=args.max_model_len,
            kvcache_block_size=256,  # the H200 run's: flash-attn's
            num_kvcache_blocks=4207,  # the H200 run's pool
            max_num_batched_tokens=16384,  # a GPU's default
            async_scheduling=overlap,
        )
        llm.engine.runner = SimulatedDevice(llm.engine.runner)
        params = [
            SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
            for n in work.output_lens
        ]
        start = time.perf_counter()
        outputs = llm.generate(work.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append(
            dict(
                async_scheduling=overlap,
                wall_s=wall,
                device_s=llm.engine.runner.device_seconds,
                output_tokens=tokens,
                out_tok_per_s=tokens / wall,
            )
        )
        llm.engine.runner.close()
    host = rows[0]["wall_s"] - rows[0]["device_s"]
    for row in rows:
        row["host_s"] = host
        row["hidden"] = (rows[0]["wall_s"] - row["wall_s"]) / host
        row["vs_nano_vllm"] = row["out_tok_per_s"] / NANO_VLLM_H200
    return rows


def print_simulation(rows: list[dict]) -> None:
    print(
        f"{'async scheduling':18} {'wall s':>7} {'device s':>9} {'host s':>7} "
        f"{'hidden':>7} {'out tok/s':>10} {'vs nano-vllm':>13}"
    )
    for r in rows:
        print(
            f"{'on' if r['async_scheduling'] else 'off':18} {r['wall_s']:7.2f} "
            f"{r['device_s']:9.2f} {r['host_s']:7.2f} {r['hidden']:7.0%} "
            f"{r['out_tok_per_s']:10,.0f} {r['vs_nano_vllm']:12.2f}x"
        )
