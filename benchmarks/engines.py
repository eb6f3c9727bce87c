"""The engines compared, each run in a fresh process of its own on the same workload,
after a warm-up outside the timed region: nanopaged, transformers (continuous batching,
and static batched `generate`: `hf.py`), nano-vllm and vLLM when importable."""

import importlib.util
import multiprocessing
import os
import statistics
import sys

from benchmarks.hf import run_hf, run_hf_static
from benchmarks.workload import (
    StepClock,
    Workload,
    percentile,
    timed,
    warmup_prompts,
)

ENGINES = ("nanopaged", "hf", "hf-static", "nano-vllm", "vllm")
# nanopaged's options at their defaults, which `run_nanopaged` does not pass
DEFAULTS = dict(
    enforce_eager=False,
    attention_backend="auto",
    async_scheduling=False,
    tensor_parallel_size=1,
    kv_cache_dtype="auto",
)


def run_nanopaged(model: str, work: Workload, args, backend: str = "auto") -> dict:
    """`backend`: an attention backend, and "+async" for async scheduling."""
    import nanopaged
    from nanopaged import LLM, LoRARequest, SamplingParams

    backend, _, mode = backend.partition("+")

    # benchmarks/lora.py's adapters (LoRA on), or None
    paths = getattr(args, "lora_paths", None)
    lora = (
        {}
        if paths is None
        else dict(
            enable_lora=True, max_loras=max(1, len(paths)), max_lora_rank=args.lora_rank
        )
    )
    options = dict(
        enforce_eager=args.enforce_eager,
        attention_backend=backend or "auto",
        async_scheduling=mode == "async",
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=args.speculative_config,
        max_num_seqs=args.max_num_seqs,
        trace=args.trace,
        kv_cache_dtype=args.kv_cache_dtype,
        **lora,
    )
    # the defaults left out: an older checkout (nanopaged@CHECKOUT) may not know them
    options = {
        k: v for k, v in options.items() if v is not None and v != DEFAULTS.get(k)
    }
    llm = LLM(model, max_model_len=args.max_model_len, **options)
    params = [
        SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
        for n in work.output_lens
    ]
    adapters = [
        LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(paths or [])
    ]
    loras = (
        [adapters[i % len(adapters)] for i in range(len(work.prompts))]
        if adapters
        else None
    )
    llm.generate(
        warmup_prompts(work),
        params[:4],
        use_tqdm=False,
        lora_request=loras and loras[:4],
    )
    llm.run_step = clock = StepClock(
        llm.run_step,
        lambda result: (
            "prefill" if result[0].ragged else "decode",
            len(result[0].seqs),
        ),
    )
    elapsed, outputs = timed(
        lambda: llm.generate(
            work.prompts, params, use_tqdm=args.progress, lora_request=loras
        )
    )
    # the adapters read
    loaded = sorted(llm.list_loras()) if paths is not None else None
    llm.close()
    stats = llm.stats()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpot = [
        (o.metrics.finish_time - o.metrics.first_token_time)
        / max(1, len(o.outputs[0].token_ids) - 1)
        for o in outputs
    ]
    prompt_tokens = sum(len(p) for p in work.prompts)
    return dict(
        elapsed=elapsed,
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        ttft_median=statistics.median(ttft),
        ttft_p99=percentile(ttft, 99),
        tpot_median=statistics.median(tpot),
        tpot_p99=percentile(tpot, 99),
        prefix_hit_rate=sum(o.num_cached_tokens for o in outputs) / prompt_tokens,
        preemptions=stats.num_preemptions,
        kv_blocks=stats.num_blocks,
        backend=llm.config.attention_backend,
        checkout=os.path.dirname(os.path.dirname(os.path.abspath(nanopaged.__file__))),
        loras=loaded,
        phases=clock.phases(),
        **speculation_stats(stats),
    )


def speculation_stats(stats) -> dict:
    """vLLM's measures: the share of proposals accepted, and the tokens a sequence gets
    per step that verifies proposals (1 + accepted / drafts)."""
    return dict(
        drafts=stats.num_drafts,
        proposed=stats.num_proposed_tokens,
        acceptance_rate=stats.num_accepted_tokens / max(1, stats.num_proposed_tokens),
        mean_accepted_length=1 + stats.num_accepted_tokens / max(1, stats.num_drafts),
    )


def run_nano_vllm(model: str, work: Workload, args) -> dict:
    from nanovllm import LLM, SamplingParams

    llm = LLM(
        model,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    params = [
        SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
        for n in work.output_lens
    ]
    llm.generate(warmup_prompts(work), params[:4], use_tqdm=False)
    # step() -> (outputs, a prefill's token count or minus the decode's batch size)
    llm.step = clock = StepClock(
        llm.step,
        lambda result: ("prefill", 0) if result[1] > 0 else ("decode", -result[1]),
    )
    elapsed, outputs = timed(
        lambda: llm.generate(work.prompts, params, use_tqdm=args.progress)
    )
    return dict(
        elapsed=elapsed,
        output_tokens=sum(len(o["token_ids"]) for o in outputs),
        phases=clock.phases(),
    )


def run_vllm(model: str, work: Workload, args) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    params = [
        SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
        for n in work.output_lens
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in warmup_prompts(work)],
        params[:4],
        use_tqdm=False,
    )
    elapsed, outputs = timed(
        lambda: llm.generate(prompts, params, use_tqdm=args.progress)
    )
    return dict(
        elapsed=elapsed, output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs)
    )


RUNNERS = {
    "nanopaged": run_nanopaged,
    "hf": run_hf,
    "hf-static": run_hf_static,
    "nano-vllm": run_nano_vllm,
    "vllm": run_vllm,
}


MODULES = {"nano-vllm": "nanovllm", "vllm": "vllm"}


def engine_name(engine: str) -> str:
    """The engine of a spec: "nanopaged" of "nanopaged@../old:cpu+async"."""
    return engine.partition(":")[0].partition("@")[0]


def _child(engine: str, model: str, work: Workload, args, runners, queue) -> None:
    name, _, backend = engine.partition(":")
    name, _, checkout = name.partition("@")
    if checkout:  # another checkout's nanopaged, in place of this one's (imported by
        # the harness's modules as this process was spawned)
        for module in [m for m in sys.modules if m.partition(".")[0] == "nanopaged"]:
            del sys.modules[module]
        sys.path.insert(0, os.path.abspath(checkout))
    try:
        queue.put(runners[name](model, work, args, *([backend] if backend else [])))
    except Exception as error:  # report, so the other engines still run
        queue.put({"error": f"{type(error).__name__}: {error}"})


def process_context() -> multiprocessing.context.BaseContext:
    """A fresh process per engine, forked from a server that has imported torch and
    transformers once (seconds a child would spend again); spawned where fork is
    missing."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "nanopaged.engine.llm"])
    return ctx


def run_engine(
    engine: str, model: str, work: Workload, args, runners: dict = RUNNERS
) -> dict:
    """`runners[engine](model, work, args)` in a fresh process: its result, or why
    there is none. "nanopaged@CHECKOUT" runs the nanopaged of another checkout (a
    worktree of an older commit: before and after in one run) in a spawned process."""
    module = MODULES.get(engine_name(engine))
    if module and importlib.util.find_spec(module) is None:
        return {"skipped": f"{module} is not importable"}
    checkout = engine.partition(":")[0].partition("@")[2]
    if checkout and not os.path.isfile(
        os.path.join(checkout, "nanopaged", "core", "llm_engine.py")
    ):
        return {"error": f"{checkout!r} is not a checkout of nanopaged"}
    ctx = multiprocessing.get_context("spawn") if "@" in engine else process_context()
    queue = ctx.Queue()
    process = ctx.Process(
        target=_child, args=(engine, model, work, args, runners, queue)
    )
    process.start()
    process.join(args.timeout)
    if process.is_alive():
        process.kill()
        return {"error": f"no result within {args.timeout} s"}
    return (
        queue.get() if not queue.empty() else {"error": f"exit code {process.exitcode}"}
    )
