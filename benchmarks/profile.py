"""Where a step's time goes, by stage: `python bench.py --profile` runs nanopaged on the
workload with a clock around each stage of a step, and prints each stage's own time
(less the stages inside it), prefill steps and decode steps apart. On a GPU every clock
reading waits for the queued kernels first, which slows the run but charges each kernel
to its stage."""

import functools
import importlib
import time
from collections import defaultdict

from benchmarks.workload import Workload, warmup_prompts

# (module, class, method) -> the stage its calls are charged to, outermost first
STAGES = {
    (
        "nanopaged.engine.llm",
        "LLM",
        "run_step",
    ): "engine bookkeeping (requests, outputs)",
    ("nanopaged.core.scheduler", "Scheduler", "schedule"): "schedule",
    ("nanopaged.core.model_runner", "ModelRunner", "prepare_inputs"): "inputs",
    ("nanopaged.core.model_runner", "ModelRunner", "device_inputs"): "inputs",
    (
        "nanopaged.core.model_runner",
        "ModelRunner",
        "execute",
    ): "norms, RoPE, activations",
    ("nanopaged.core.layers", "LinearBase", "forward"): "linear layers",
    ("nanopaged.core.layers", "RowParallelLinear", "forward"): "linear layers",
    ("nanopaged.core.layers", "ParallelLMHead", "forward"): "LM head",
    ("nanopaged.core.attention", "Attention", "forward"): "attention",
    ("nanopaged.core.sampler", "Sampler", "__call__"): "sample",
}


class StageClock:
    """Self time per stage: a stage's elapsed time, less that of the stages called
    inside it."""

    def __init__(self, sync):
        self.sync = sync
        self.step: dict[str, float] = defaultdict(float)  # the running step's stages
        self.totals = {"prefill": defaultdict(float), "decode": defaultdict(float)}
        self.steps = {"prefill": 0, "decode": 0}
        self.inner = [0.0]  # time of the stages inside each open one

    def wrap(self, owner: type, name: str, stage: str) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            self.inner.append(0.0)
            try:
                result = method(*args, **kwargs)
            finally:
                self.sync()
                elapsed = time.perf_counter() - start
                self.step[stage] += elapsed - self.inner.pop()
                self.inner[-1] += elapsed
            if name == "run_step":  # the step is over: charge it to its kind
                kind = "prefill" if result[0].ragged else "decode"
                for key, seconds in self.step.items():
                    self.totals[kind][key] += seconds
                self.steps[kind] += 1
                self.step.clear()
            return result

        setattr(owner, name, timed)


def profile(model: str, work: Workload, args) -> dict:
    import torch

    from nanopaged import LLM, SamplingParams

    clock = StageClock(
        torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    )
    originals = []
    for (module, cls, name), stage in STAGES.items():
        owner = getattr(importlib.import_module(module), cls)
        originals.append((owner, name, owner.__dict__[name]))
        clock.wrap(owner, name, stage)
    try:
        llm = LLM(
            model,
            max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager,
            max_num_seqs=args.max_num_seqs,
        )
        params = [
            SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
            for n in work.output_lens
        ]
        llm.generate(warmup_prompts(work), params[:4], use_tqdm=False)
        clock.totals = {"prefill": defaultdict(float), "decode": defaultdict(float)}
        clock.steps = {"prefill": 0, "decode": 0}
        start = time.perf_counter()
        llm.generate(work.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        backend = llm.config.attention_backend
        llm.close()
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)
    stages = list(dict.fromkeys(STAGES.values()))
    return dict(
        wall=wall,
        backend=backend,
        steps=clock.steps,
        stages=[
            dict(
                stage=stage,
                prefill=clock.totals["prefill"][stage],
                decode=clock.totals["decode"][stage],
            )
            for stage in stages
        ],
    )


def print_profile(result: dict) -> None:
    rows = result["stages"]
    total = sum(r["prefill"] + r["decode"] for r in rows)
    steps = result["steps"]
    print(
        f"{'stage (' + result['backend'] + ' backend)':40} {'prefill s':>9} "
        f"{'decode s':>9} {'share':>6}"
    )
    for r in sorted(rows, key=lambda r: -(r["prefill"] + r["decode"])):
        print(
            f"{r['stage']:40} {r['prefill']:9.3f} {r['decode']:9.3f} "
            f"{100 * (r['prefill'] + r['decode']) / total:5.1f}%"
        )
    print(
        f"{'all stages':40} {sum(r['prefill'] for r in rows):9.3f} "
        f"{sum(r['decode'] for r in rows):9.3f}  ({steps['prefill']} prefill and "
        f"{steps['decode']} decode steps; {result['wall']:.2f} s wall)"
    )
