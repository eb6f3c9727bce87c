"""Offline throughput of nanopaged beside the engines people would use instead.

    python bench.py                                   # nano-vllm's workload, Qwen3-0.6B shape
    python bench.py --engines nanopaged,hf,hf-static,nano-vllm,vllm \
        --out bench.json --plot bench.png
    python bench.py --cpu                             # a small model on a CPU, beside transformers
    python bench.py --prefix-len 512                  # every prompt shares 512 leading tokens
    python bench.py --steps                           # decode step time per batch, prefill tok/s
    python bench.py --host                            # host time per decode step (no GPU needed)
    python bench.py --tiny                            # a seconds-long run on CPU
    python bench.py --serve                           # the server at several request rates,
                                                      # prefill-first beside mixed scheduling
    python bench.py --serve --url http://host:8000/v1 # ... and another OpenAI-compatible server

Every engine runs in its own process on the same workload, after a warm-up outside the timed
region. The physical floor is the time a perfect engine needs to move the bytes the workload
must move (weights once per decode step, each cached K/V once per generated token) at the
bandwidth measured here, or to do its arithmetic at the matmul rate measured here in the
model's dtype, whichever is longer. A preset (--cpu, --tiny) only sets defaults: flags win.

--serve sends the workload to a server as streamed completions, arriving as a Poisson process
at each --request-rate, and reports what its users feel, as vLLM's benchmark_serving does:
time to first token (TTFT), time per output token after it (TPOT), and the inter-token latency
between streamed chunks (ITL), at the median and the 99th percentile.
"""

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from nanopaged.random_checkpoint import TINY_QWEN3

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanopaged")
MEANINGFUL_FLOOR_S = 0.01
# Seconds each engine took with the --cpu preset on a 2-core cloud CPU (model load included)
CPU_PRESET_SECONDS = {"nanopaged": 20, "hf-static": 35, "hf": 40}
ENGINES = ("nanopaged", "hf", "hf-static", "nano-vllm", "vllm")
# Qwen3-0.6B's published shape, for benchmarks with random weights.
QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# A small model for CPUs: 4 layers of width 256, a 32k vocabulary.
CPU_QWEN3 = dict(TINY_QWEN3, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000,
                 max_position_embeddings=4096)
# name: (checkpoint, its shape and dtype, default flags)
PRESETS = {
    "default": ("random-qwen3-0.6b", QWEN3_0_6B, "bfloat16", dict(
        engines="nanopaged,nano-vllm", num_requests=256, prompt_len=[100, 1024],
        output_len=[100, 1024], max_model_len=4096, batch_sizes=[1, 64, 256], context=1000,
        prefill_seqs=16, request_rate=[8, 16, 24])),
    "cpu": ("random-cpu-qwen3", CPU_QWEN3, "float32", dict(
        engines="nanopaged,hf-static,hf", num_requests=48, prompt_len=[64, 512],
        output_len=[32, 256], max_model_len=1024, batch_sizes=[1, 16, 48], context=512,
        prefill_seqs=4, request_rate=[1, 2, 4])),
    "tiny": ("random-tiny-qwen3", TINY_QWEN3, "float32", dict(
        engines="nanopaged,nano-vllm", num_requests=8, prompt_len=[8, 64], output_len=[8, 32],
        max_model_len=512, batch_sizes=[1, 4], context=64, prefill_seqs=2, request_rate=[4, 16])),
}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float


def make_workload(args, vocab_size: int) -> Workload:
    """nano-vllm's benchmark: random token ids below 10,000, lengths uniform in the ranges."""
    import torch
    g = torch.Generator().manual_seed(args.seed)
    top = min(10000, vocab_size)
    def uniform(low, high):
        return torch.randint(low, high + 1, (args.num_requests,), generator=g).tolist()
    prompt_lens, output_lens = uniform(*args.prompt_len), uniform(*args.output_len)
    prefixes = [torch.randint(0, top, (args.prefix_len,), generator=g).tolist()
                for _ in range(args.prefix_groups)]
    prompts = [prefixes[i % args.prefix_groups] + torch.randint(0, top, (n,), generator=g).tolist()
               for i, n in enumerate(prompt_lens)]
    return Workload(prompts, output_lens, args.temperature)


def warmup_prompts(work: Workload) -> list[list[int]]:
    """Four prompts the timed run does not contain, so the warm-up leaves no prefix-cache hits."""
    return [p[::-1] for p in work.prompts[:4]]


# ---- the engines, each run in a child process ----

def run_nanopaged(model: str, work: Workload, args, backend: str = "auto") -> dict:
    from nanopaged import LLM, SamplingParams
    llm = LLM(model, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              attention_backend=backend, tensor_parallel_size=args.tensor_parallel_size,
              speculative_config=args.speculative_config, max_num_seqs=args.max_num_seqs,
              trace=args.trace)
    params = [SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
              for n in work.output_lens]
    llm.generate(warmup_prompts(work), params[:4], use_tqdm=False)
    elapsed, outputs = timed(lambda: llm.generate(work.prompts, params, use_tqdm=args.progress))
    llm.close()
    stats = llm.stats()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpot = [
        (o.metrics.finish_time - o.metrics.first_token_time)
        / max(1, len(o.outputs[0].token_ids) - 1)
        for o in outputs
    ]
    prompt_tokens = sum(len(p) for p in work.prompts)
    return dict(elapsed=elapsed, output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
                ttft_median=statistics.median(ttft), ttft_p99=percentile(ttft, 99),
                tpot_median=statistics.median(tpot), tpot_p99=percentile(tpot, 99),
                prefix_hit_rate=sum(o.num_cached_tokens for o in outputs) / prompt_tokens,
                preemptions=stats.num_preemptions, kv_blocks=stats.num_blocks,
                backend=llm.config.attention_backend, **speculation_stats(stats))


def speculation_stats(stats) -> dict:
    """vLLM's measures: the share of proposals accepted, and the tokens a sequence gets per
    step that verifies proposals (1 + accepted / drafts)."""
    return dict(drafts=stats.num_drafts, proposed=stats.num_proposed_tokens,
                acceptance_rate=stats.num_accepted_tokens / max(1, stats.num_proposed_tokens),
                mean_accepted_length=1 + stats.num_accepted_tokens / max(1, stats.num_drafts))


def run_nano_vllm(model: str, work: Workload, args) -> dict:
    from nanovllm import LLM, SamplingParams
    llm = LLM(model, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size)
    params = [SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
              for n in work.output_lens]
    llm.generate(warmup_prompts(work), params[:4], use_tqdm=False)
    elapsed, outputs = timed(lambda: llm.generate(work.prompts, params, use_tqdm=args.progress))
    return dict(elapsed=elapsed, output_tokens=sum(len(o["token_ids"]) for o in outputs))


def run_vllm(model: str, work: Workload, args) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt
    llm = LLM(model, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size)
    params = [SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
              for n in work.output_lens]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warmup_prompts(work)], params[:4],
                 use_tqdm=False)
    elapsed, outputs = timed(lambda: llm.generate(prompts, params, use_tqdm=args.progress))
    return dict(elapsed=elapsed, output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs))


def _hf_model(model: str, args):
    import torch
    from transformers import AutoModelForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


def run_hf(model: str, work: Workload, args) -> dict:
    """transformers' continuous batching (paged attention), one request per prompt."""
    from transformers import GenerationConfig
    os.environ["HF_HUB_OFFLINE"] = "1"  # else transformers may look for attention kernels online
    hf = _hf_model(model, args)
    hf.set_attn_implementation(args.hf_attn)
    config = GenerationConfig(do_sample=work.temperature > 0, temperature=work.temperature,
                              max_new_tokens=max(work.output_lens), eos_token_id=-1)
    manager = hf.init_continuous_batching(generation_config=config)
    manager.start()
    def generate(prompts, lens, progress=False):
        for i, (p, n) in enumerate(zip(prompts, lens)):
            manager.add_request(p, request_id=f"r{len(p)}-{i}-{time.time()}", max_new_tokens=n,
                                eos_token_id=-1)
        results = [manager.get_result(timeout=args.timeout)
                   for _ in bar(prompts, "Generating", progress)]
        if None in results:
            raise RuntimeError("transformers' continuous batching returned no result")
        return results
    generate(warmup_prompts(work), work.output_lens[:4])
    elapsed, outputs = timed(lambda: generate(work.prompts, work.output_lens, args.progress))
    manager.stop(block=True)
    return dict(elapsed=elapsed, output_tokens=sum(len(o.generated_tokens) for o in outputs),
                attention=args.hf_attn)


def run_hf_static(model: str, work: Workload, args) -> dict:
    """Plain `generate` with a static cache, batches of similar output length (no early exit)."""
    import torch
    hf = _hf_model(model, args)
    hf.generation_config.eos_token_id = None
    order = sorted(range(len(work.prompts)), key=lambda i: work.output_lens[i])
    batches = [order[i:i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]
    def generate(batches, progress=False):
        tokens = 0
        for batch in bar(batches, "Batches", progress):
            width = max(len(work.prompts[i]) for i in batch)
            n = max(work.output_lens[i] for i in batch)
            ids = torch.tensor(
                [[0] * (width - len(work.prompts[i])) + work.prompts[i] for i in batch],
                device=hf.device,
            )
            mask = (
                torch.arange(width, device=hf.device)[None, :]
                >= torch.tensor([width - len(work.prompts[i]) for i in batch], device=hf.device)[
                    :, None
                ]
            )
            hf.generate(ids, attention_mask=mask.long(), max_new_tokens=n, min_new_tokens=n,
                        do_sample=work.temperature > 0, temperature=work.temperature,
                        cache_implementation="static", pad_token_id=0)
            tokens += sum(work.output_lens[i] for i in batch)  # the tokens the requests asked for
        return tokens
    generate([batches[0][:2]])
    elapsed, tokens = timed(lambda: generate(batches, args.progress))
    return dict(elapsed=elapsed, output_tokens=tokens, batch_size=args.hf_batch_size)


def bar(items, desc: str, shown: bool):
    """`items`, with a progress bar on stderr when `shown`."""
    from tqdm.auto import tqdm
    return tqdm(items, desc=desc, disable=not shown, dynamic_ncols=True)


RUNNERS = {"nanopaged": run_nanopaged, "hf": run_hf, "hf-static": run_hf_static,
           "nano-vllm": run_nano_vllm, "vllm": run_vllm}
MODULES = {"nano-vllm": "nanovllm", "vllm": "vllm"}


def timed(fn):
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _child(engine: str, model: str, work: Workload, args, queue) -> None:
    name, _, backend = engine.partition(":")
    try:
        queue.put(RUNNERS[name](model, work, args, *([backend] if backend else [])))
    except Exception as error:  # report, so the other engines still run
        queue.put({"error": f"{type(error).__name__}: {error}"})


def run_engine(engine: str, model: str, work: Workload, args) -> dict:
    module = MODULES.get(engine)
    if module and importlib.util.find_spec(module) is None:
        return {"skipped": f"{module} is not importable"}
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_child, args=(engine, model, work, args, queue))
    process.start()
    process.join(args.timeout)
    if process.is_alive():
        process.kill()
        return {"error": f"no result within {args.timeout} s"}
    return queue.get() if not queue.empty() else {"error": f"exit code {process.exitcode}"}


# ---- the physical floor ----

def model_shape(model: str) -> dict:
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
                 + c.num_attention_heads * head_dim * c.hidden_size)
    # a token of a mixture of experts runs (and a step reads) its top_k experts at least (the
    # floor counts every layer sparse)
    active = getattr(c, "num_experts_per_tok", None) or 1
    mlp = 3 * c.hidden_size * (getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    embedding = c.vocab_size * c.hidden_size
    return dict(active_params=c.num_hidden_layers * (attention + active * mlp) + embedding,
                vocab_size=c.vocab_size,
                kv_elements_per_token=2 * c.num_hidden_layers * c.num_key_value_heads * head_dim,
                attention_flops_per_pair=4 * c.num_hidden_layers * c.num_attention_heads * head_dim)


def engine_dtype(model: str) -> "torch.dtype":
    """The dtype nanopaged (and the transformers peers) run the model in here."""
    import torch
    if not torch.cuda.is_available():
        return torch.float32
    from transformers import AutoConfig
    return getattr(AutoConfig.from_pretrained(model), "dtype", None) or torch.bfloat16


def measure_device(dtype: "torch.dtype") -> dict:
    """Copy bandwidth (bytes read + written) and the matmul rate in `dtype`, measured here."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 1 << 28 if device == "cuda" else 1 << 24
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_time = best_time(lambda: dst.copy_(src))
    size = 8192 if device == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    mm_time = best_time(lambda: a @ b)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return dict(device=name, dtype=str(dtype).removeprefix("torch."),
                bandwidth=2 * src.nbytes / copy_time, flops=2 * size ** 3 / mm_time)


def best_time(fn, repeat: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeat):
        elapsed, _ = timed(fn)
        times.append(elapsed)
    return statistics.median(times)


def physical_floor(shape: dict, work: Workload, device: dict, dtype_bytes: int) -> dict:
    """The least time any engine needs: every decode step reads the weights once (all requests
    decode together, so there are max(output_len) steps), and each generated token reads the
    K/V of its whole context once; or the arithmetic, at the measured matmul rate."""
    weight_bytes = shape["active_params"] * dtype_bytes * max(work.output_lens)
    context_pairs = sum(
        len(p) * n + n * (n - 1) // 2 for p, n in zip(work.prompts, work.output_lens)
    )
    kv_bytes = context_pairs * shape["kv_elements_per_token"] * dtype_bytes
    tokens = sum(len(p) for p in work.prompts) + sum(work.output_lens)
    flops = 2 * shape["active_params"] * tokens + shape["attention_flops_per_pair"] * context_pairs
    seconds = max((weight_bytes + kv_bytes) / device["bandwidth"], flops / device["flops"])
    return dict(weight_bytes=weight_bytes, kv_bytes=kv_bytes, flops=flops, seconds=seconds)


def share_of_floor(floor_seconds: float, seconds: float) -> str:
    """How close a measured time is to its floor. A floor cannot be beaten: a time under it
    means the floor's model of the work (or of the device) is wrong, and says so. A floor too
    small to mean anything (under 10 ms, or under 1% of the time) is not shown."""
    if seconds < floor_seconds:
        return "under the floor: the floor model is wrong here"
    if floor_seconds < MEANINGFUL_FLOOR_S or floor_seconds < seconds / 100:
        return ""
    return f"{100 * floor_seconds / seconds:.0f}% of the floor"


# ---- decode steps and prefill, one backend at a time ----

def step_times(model: str, args) -> list[dict]:
    """Decode step time at several batch sizes with `--context`-token contexts, and prefill tok/s,
    each against its floor: the bytes a decode step must move, the arithmetic of a prefill."""
    import torch
    from nanopaged import LLM
    dtype = engine_dtype(model)
    device = measure_device(dtype)
    shape = model_shape(model)
    on_gpu = torch.cuda.is_available()
    backends = (
        args.backends.split(",")
        if args.backends
        else (
            ["torch"]
            + (["triton"] if on_gpu else [])
            + (["flash"] if on_gpu and importlib.util.find_spec("flash_attn") else [])
        )
    )
    rows = []
    for backend in backends:
        # room for the largest batch at full context, and for the prefill step in one go
        llm = LLM(
            model,
            attention_backend=backend,
            max_num_seqs=max(args.batch_sizes),
            max_model_len=args.context + 64,
            enforce_eager=args.enforce_eager,
            max_num_batched_tokens=max(args.prefill_seqs * args.context, max(args.batch_sizes)),
        )
        dtype_bytes = llm.config.dtype.itemsize
        for batch in args.batch_sizes:
            seconds, step = _decode_step_time(llm, batch, args.context)
            moved = (
                shape["active_params"] + batch * args.context * shape["kv_elements_per_token"]
            ) * dtype_bytes
            rows.append(dict(backend=backend, kind=f"decode b={batch}", ms=seconds * 1e3,
                             floor_ms=moved / device["bandwidth"] * 1e3, tokens=len(step.seqs)))
        seconds, tokens = _prefill_step_time(llm, args.prefill_seqs, args.context)
        flops = (
            2 * shape["active_params"] * tokens
            + shape["attention_flops_per_pair"] * args.prefill_seqs * args.context**2 // 2
        )
        rows.append(dict(backend=backend, kind=f"prefill {tokens} tok", ms=seconds * 1e3,
                         floor_ms=flops / device["flops"] * 1e3, tok_per_s=tokens / seconds,
                         tokens=tokens))
        llm.close()
        del llm
        torch.cuda.empty_cache() if on_gpu else None
    return rows


def _random_requests(llm, count: int, context: int, seed: int) -> list[str]:
    import torch
    from nanopaged import SamplingParams
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64)
    top = min(10000, llm.config.hf_config.vocab_size)
    return [llm.add_request(torch.randint(0, top, (context,), generator=g).tolist(), params)
            for _ in range(count)]


def _decode_step_time(llm, batch: int, context: int):
    """The same decode step of `batch` sequences, timed again and again (it rewrites the same
    cache slots); the prompts are prefilled first, untimed. -> (seconds, the step)"""
    request_ids = _random_requests(llm, batch, context, seed=batch)
    engine = llm.engine
    while engine.scheduler.waiting:
        llm.run_step()
    step = engine.scheduler.schedule()
    assert not step.ragged and len(step.seqs) == batch
    seconds = best_time(lambda: engine.runner.run(step), repeat=20)
    engine.block_manager.commit()  # the step ran: its K/V is written
    for request_id in request_ids:
        llm.abort(request_id)
    return seconds, step


def _prefill_step_time(llm, count: int, context: int):
    """One step prefilling `count` new prompts (new each time: no prefix-cache hits).
    -> (seconds, tokens the step ran)"""
    times = []
    for seed in range(6):
        request_ids = _random_requests(llm, count, context, seed=1000 + seed)
        elapsed, (step, _) = timed(llm.run_step)
        times.append(elapsed)
        for request_id in request_ids:
            llm.abort(request_id)
    return statistics.median(times[1:]), step.num_scheduled_tokens


# ---- host work per step ----

class HostOnlyRunner:
    """The model runner less the model: builds each step's inputs and, for the rows with logits
    processors (a grammar), applies them; then "samples" token 0, or for a row with processors
    the allowed token that a fixed random score prefers (a model whose choices a grammar
    steers)."""

    def __init__(self, runner):
        import torch
        self.runner, self.proposer, self.steps = runner, None, 0
        vocab_size = runner.config.hf_config.vocab_size
        self.scores = torch.rand(1024, vocab_size, generator=torch.Generator().manual_seed(0))

    def run(self, step):
        from nanopaged.core.step import SamplerOutput
        self.runner.prepare_inputs(step)
        tokens = [[0]] * len(step.samplers)
        if any(seq.logits_processors for seq in step.samplers):
            first = self.steps % (len(self.scores) - len(step.samplers))
            self.steps += 1
            logits = self.runner.sampler.apply_processors(
                self.scores[first:first + len(step.samplers)], step.samplers)
            tokens = logits.argmax(dim=-1).view(-1, 1).tolist()
        return SamplerOutput(tokens)


# What --host --structured constrains each request to: a 10-field object
HOST_SCHEMA = {"type": "object", "properties": {
    f"field_{i}": [{"type": "string", "maxLength": 40}, {"type": "integer"},
                   {"enum": ["red", "green", "blue"]}, {"type": "array", "items": {
                       "type": "number"}, "maxItems": 4}][i % 4] for i in range(10)},
    "required": [f"field_{i}" for i in range(10)]}


# ---- speculative decoding ----

# What --spec tries when no --speculative-config is given
SPEC_CONFIGS = [{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                 "prompt_lookup_max": 5} for k in (4, 8)]


def repetitive_workload(args, vocab_size: int, num_requests: int = 8) -> Workload:
    """Prompts that quote a random text twice, greedy: proposals can hit (in the quote, and in
    the loops a random-weight model falls into)."""
    import torch
    g = torch.Generator().manual_seed(args.seed)
    low, high = args.prompt_len
    texts = [torch.randint(0, min(10000, vocab_size), (n,), generator=g).tolist()
             for n in torch.randint(low // 2, high // 2 + 1, (num_requests,), generator=g)]
    return Workload([text * 2 for text in texts], [args.output_len[1]] * num_requests, 0.0)


def spec_times(model: str, args) -> list[dict]:
    """nanopaged without and with each speculative config: on the repetitive workload one
    request at a time, and on the preset's workload as a batch."""
    vocab_size = model_shape(model)["vocab_size"]
    workloads = [("repetitive, batch 1", repetitive_workload(args, vocab_size), 1),
                 (f"{args.preset} workload", make_workload(args, vocab_size), args.max_num_seqs)]
    rows = []
    for name, work, max_num_seqs in workloads:
        off = None
        for spec in [None, *(args.speculative_configs or SPEC_CONFIGS)]:
            print(f"running {name} with {spec} ...", file=sys.stderr)
            run_args = argparse.Namespace(**dict(vars(args), speculative_config=spec,
                                                 max_num_seqs=max_num_seqs))
            r = run_engine("nanopaged", model, work, run_args)
            if "elapsed" in r:
                r["output_tok_per_s"] = r["output_tokens"] / r["elapsed"]
                off = off or r["output_tok_per_s"]
                r["vs_off"] = r["output_tok_per_s"] / off
            rows.append(dict(workload=name, speculative_config=spec, **r))
    return rows


def spec_name(spec: dict | None) -> str:
    if spec is None:
        return "off"
    if "model" in spec:
        name = os.path.basename(spec["model"].rstrip("/"))
        return f"draft {name} k={spec['num_speculative_tokens']}"
    return (f"ngram k={spec['num_speculative_tokens']} n={spec.get('prompt_lookup_min', 5)}.."
            f"{spec.get('prompt_lookup_max', 5)}")


def print_spec(rows: list[dict]) -> None:
    print(f"{'workload':22} {'speculation':24} {'out tok/s':>9} {'vs off':>6} {'accepted':>8} "
          f"{'mean len':>8}")
    for r in rows:
        spec = spec_name(r["speculative_config"])
        if "elapsed" not in r:
            print(f"{r['workload']:22} {spec:24} {r.get('error')}")
            continue
        print(f"{r['workload']:22} {spec:24} {r['output_tok_per_s']:9,.0f} {r['vs_off']:5.2f}x "
              f"{100 * r['acceptance_rate']:7.1f}% {r['mean_accepted_length']:8.2f}")


def host_times(model: str, args) -> list[dict]:
    """Host time of one decode step without the model: the engine's own step (schedule, build
    the inputs, apply the sampled tokens) with the forward left out. The GPU waits that long
    between two steps. With --structured, each request follows a JSON schema, on a checkpoint
    with a 32k-token vocabulary, beside the same requests without one."""
    from nanopaged.sampling_params import StructuredOutputsParams
    rows = []
    schemas = [None]
    if args.structured:
        model, schemas = realistic_checkpoint(), [None, StructuredOutputsParams(
            json=HOST_SCHEMA, disable_any_whitespace=True)]
    for batch in args.batch_sizes:
        for block_size in (16,) if args.structured else (16, 256):
            for schema in schemas:
                kind = f"decode b={batch} block={block_size}" + (" json schema" if schema else "")
                rows.append(dict(kind=kind, **_host_step_time(model, args, batch, block_size,
                                                              schema)))
    return rows


def _host_step_time(model: str, args, batch: int, block_size: int, schema) -> dict:
    import torch
    from nanopaged import LLM, SamplingParams
    max_model_len = args.context + 512
    from nanopaged.trace import TracedRunner
    trace = args.trace and "{0}.b{2}.block{3}{1}".format(*os.path.splitext(args.trace), batch,
                                                          block_size)
    llm = LLM(model, device="cpu", kvcache_block_size=block_size, max_model_len=max_model_len,
              num_kvcache_blocks=batch * -(-max_model_len // block_size), trace=trace)
    runner = HostOnlyRunner(llm.engine.runner.runner if trace else llm.engine.runner)
    llm.engine.runner = TracedRunner(runner, llm.tracer) if trace else runner
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_model_len,
                            structured_outputs=schema)
    vocab_size = min(llm.config.hf_config.vocab_size, len(llm.tokenizer))
    for _ in range(batch):
        llm.add_request(torch.randint(0, vocab_size, (args.context,), generator=g).tolist(),
                        params)
    while llm.engine.scheduler.waiting:
        llm.run_step()
    generated = llm.stats().num_generated_tokens
    ms = best_time(llm.run_step, repeat=100) * 1e3
    return dict(ms=ms, tokens_per_step=(llm.stats().num_generated_tokens - generated) / 101)


def realistic_checkpoint() -> str:
    """The tiny model with a 32k-token byte-level BPE tokenizer trained on Python's own library
    (once, cached): grammar masks cost what they cost with a real vocabulary."""
    import glob
    import sysconfig
    from nanopaged.random_checkpoint import write_random_checkpoint
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    path = os.path.join(CACHE_DIR, "random-tiny-qwen3-32k-vocab")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    print(f"training a 32k-token tokenizer for {path} (about a minute, once)", file=sys.stderr)
    def texts():
        for name in glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**/*.py"),
                              recursive=True):
            with open(name, encoding="utf-8", errors="ignore") as f:
                yield f.read()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=32000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    write_random_checkpoint(path, dict(TINY_QWEN3, vocab_size=32000))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(path)
    return path


# ---- serving: requests arriving over time ----

def serve_times(model: str, args) -> dict:
    """Each of nanopaged's scheduling policies behind its own server, then the --url server, at
    each request rate, on the same workload and arrival times."""
    work = make_workload(args, model_shape(model)["vocab_size"])
    results = {}
    flags = {f"nanopaged {policy}": ["--scheduling", policy]
             for policy in ("prefill-first", "mixed")}
    if args.data_parallel_size > 1:  # the routing policies instead
        size = str(args.data_parallel_size)
        flags = {f"nanopaged dp{size} {router}": ["--data-parallel-size", size, "--router", router]
                 for router in ("prefix", "least")}
    for name, server_flags in flags.items():
        with NanopagedServer(model, args, server_flags) as url:
            results[name] = {rate: asyncio.run(send_workload(url, work, rate, args))
                             for rate in args.request_rate}
    if args.url:
        results[args.url] = {rate: asyncio.run(send_workload(args.url, work, rate, args))
                             for rate in args.request_rate}
    return results


class NanopagedServer:
    """`python -m nanopaged serve` in a subprocess, for the length of a `with` block."""

    def __init__(self, model: str, args, flags: list[str]):
        from nanopaged.parallel import free_port
        self.port = free_port()
        self.command = [sys.executable, "-m", "nanopaged", "serve", model, "--port",
                        str(self.port),
                        *flags, "--max-model-len", str(args.max_model_len),
                        "--max-waiting", str(args.num_requests + 1), "--log-level", "warning"]
        if args.max_num_batched_tokens:
            self.command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]

    def __enter__(self) -> str:
        import httpx
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL)
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                    return f"http://127.0.0.1:{self.port}/v1"
            except httpx.HTTPError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.process.returncode}")
                time.sleep(0.5)

    def __exit__(self, *exc_info) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)


async def send_workload(url: str, work: Workload, rate: float, args) -> dict:
    """Streams every request of the workload, started at Poisson arrival times of `rate` a
    second; with --long-prompt, one more request of that many prompt tokens arrives halfway,
    and `itl_max_ms` shows how long it stalled the others' streams."""
    import torch
    import httpx
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = (await client.get(f"{url}/models")).json()["data"][0]["id"]
        warmup = work.prompts[0][::-1]
        await stream_completion(client, url, model, warmup, 4, work.temperature)
        g = torch.Generator().manual_seed(args.seed)
        arrivals = (torch.empty(len(work.prompts)).exponential_(generator=g) / rate).cumsum(0)
        start = time.perf_counter()
        async def request_at(delay, prompt, max_tokens):
            await asyncio.sleep(delay)
            return await stream_completion(client, url, model, prompt, max_tokens, work.temperature)
        requests = [request_at(*r) for r in zip(arrivals.tolist(), work.prompts, work.output_lens)]
        if args.long_prompt:
            # reversed: no prefix-cache hits on the workload's prompts
            tokens = [token for prompt in work.prompts for token in prompt[::-1]]
            long_prompt = tokens[:args.long_prompt]
            requests.append(request_at(arrivals[len(arrivals) // 2].item(), long_prompt, 1))
        records = await asyncio.gather(*requests)
        duration = time.perf_counter() - start
    long_record = records.pop() if args.long_prompt else None
    return dict(serving_stats(records, duration), request_rate=rate,
                long_prompt_ttft_ms=long_record and 1e3 * long_record["ttft"])


def serving_stats(records: list[dict], duration: float) -> dict:
    ttft = [r["ttft"] for r in records]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    itl = [gap for r in records for gap in r["itl"]]
    output_tokens = sum(r["tokens"] for r in records)
    prompt_tokens = sum(r["prompt_tokens"] for r in records)
    return dict(duration=duration, requests_per_s=len(records) / duration,
                prefix_hit_rate=sum(r["cached_tokens"] for r in records) / max(1, prompt_tokens),
                output_tok_per_s=output_tokens / duration, output_tokens=output_tokens,
                itl_max_ms=1e3 * max(itl),
                **{f"{name}_{q}_ms": 1e3 * percentile(values, q) for name, values in
                   (("ttft", ttft), ("tpot", tpot), ("itl", itl)) for q in (50, 99)})


async def stream_completion(client, url: str, model: str, prompt: list[int], max_tokens: int,
                            temperature: float) -> dict:
    """One streamed completion: when its chunks came, and how many tokens it had."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                ignore_eos=True, stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    times, usage = [], {}
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        if response.status_code != 200:
            error = (await response.aread())[:300]
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {error!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    return dict(ttft=times[0] - start, latency=times[-1] - start,
                tokens=usage["completion_tokens"], prompt_tokens=usage["prompt_tokens"],
                cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                itl=[b - a for a, b in zip(times, times[1:])])


def print_serving(results: dict) -> None:
    print(f"{'server':28} {'req/s in':>8} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>9} "
          f"{'p99':>8} {'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'max':>7}  (ms)")
    for server, rates in results.items():
        for rate, r in rates.items():
            print(f"{server[:28]:28} {rate:8g} {r['requests_per_s']:6.2f} "
                  f"{r['output_tok_per_s']:9,.0f} {r['ttft_50_ms']:9.1f} {r['ttft_99_ms']:8.1f} "
                  f"{r['tpot_50_ms']:9.2f} {r['tpot_99_ms']:7.2f} {r['itl_50_ms']:8.2f} "
                  f"{r['itl_99_ms']:7.2f} {r['itl_max_ms']:7.1f}"
                  f"  prefix hits {100 * r['prefix_hit_rate']:.0f}%"
                  + (f"  long prompt's TTFT {r['long_prompt_ttft_ms']:,.0f}"
                     if r["long_prompt_ttft_ms"] else ""))


# ---- the command line ----

def resolve_model(args) -> str:
    """--model, or the preset's random-weight checkpoint (written on first use)."""
    if args.model:
        return args.model
    from nanopaged.random_checkpoint import write_random_checkpoint
    name, shape, dtype, _ = PRESETS[args.preset]
    path = os.path.join(CACHE_DIR, name)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        print(f"writing a random-weight {name} checkpoint to {path}", file=sys.stderr)
        write_random_checkpoint(path, shape, dtype=dtype)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local checkpoint (default: the preset's random weights)")
    p.add_argument(
        "--engines",
        help=f"comma-separated, from {', '.join(ENGINES)}; nanopaged:BACKEND "
        f"picks an attention backend (torch, triton, flash)",
    )
    p.add_argument("--num-requests", type=int)
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--prefix-len", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--prefix-groups", type=int, default=1,
                   help="prompt i starts with prefix i mod this many (each --prefix-len long)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="with --serve: replicas behind one server, under each routing policy")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks for nanopaged, nano-vllm and vllm (one GPU each)")
    p.add_argument("--hf-attn", default="sdpa", help="attention for the hf engine")
    p.add_argument("--hf-batch-size", type=int, default=64, help="batch of the hf-static engine")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar per engine, on stderr (default: on)")
    presets = p.add_mutually_exclusive_group()
    presets.add_argument(
        "--cpu",
        action="store_true",
        help="preset: a 4-layer d=256 model on a CPU, " "48 requests, beside hf-static and hf",
    )
    presets.add_argument("--tiny", action="store_true", help="preset: a seconds-long run on CPU")
    p.add_argument("--steps", action="store_true", help="time decode steps and prefill instead")
    p.add_argument("--host", action="store_true", help="time the host's work per decode step")
    p.add_argument("--structured", action="store_true",
                   help="with --host: requests that follow a JSON schema, beside plain ones")
    p.add_argument("--spec", action="store_true", help="speculative decoding, off and on, on a "
                   "repetitive workload one request at a time and on the preset's as a batch")
    p.add_argument("--speculative-config", action="append", metavar="JSON",
                   help="a vLLM speculative_config; with --spec, repeat to compare several")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument(
        "--serve", action="store_true", help="time a server under requests that arrive over time"
    )
    p.add_argument("--request-rate", type=float, nargs="+", help="with --serve: requests a second")
    p.add_argument("--long-prompt", type=int, default=0,
                   help="with --serve: one more request, of this many prompt tokens, halfway")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="with --serve: the servers' token budget per step (their chunk size)")
    p.add_argument(
        "--url", help="with --serve: another OpenAI-compatible server, e.g. http://host:8000/v1"
    )
    p.add_argument("--backends", help="with --steps: comma-separated (default: all available)")
    p.add_argument("--batch-sizes", type=int, nargs="+")
    p.add_argument("--context", type=int)
    p.add_argument("--prefill-seqs", type=int)
    p.add_argument("--trace", metavar="PATH", help="nanopaged writes a trace of every step "
                   "here (python -m nanopaged.trace PATH makes its page)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG of the results here (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        args.speculative_configs = [json.loads(c) for c in args.speculative_config or []]
    except json.JSONDecodeError as error:
        p.error(f"--speculative-config is not JSON: {error}")
    args.speculative_config = (args.speculative_configs or [None])[0]
    # host work does not depend on the model's size
    args.preset = "cpu" if args.cpu else "tiny" if args.tiny or args.host else "default"
    for name, value in PRESETS[args.preset][3].items():
        if getattr(args, name) is None:  # flags given win over the preset
            setattr(args, name, value)
    if args.serve and importlib.util.find_spec("httpx") is None:
        p.error("--serve needs httpx: pip install -e \".[bench]\"")
    if args.plot and args.host:
        p.error("--plot draws throughput or --steps results, not --host")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install -e \".[bench]\"")
    unknown = {e.partition(":")[0] for e in args.engines.split(",")} - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = resolve_model(args)
    if args.host:
        rows = host_times(model, args)
        print(f"{'host work per step':28} {'ms':>7}")
        for r in rows:
            print(f"{r['kind']:28} {r['ms']:7.3f}")
        result = dict(host=rows)
    elif args.spec:
        result = dict(speculative=spec_times(model, args))
        print_spec(result["speculative"])
    elif args.serve:
        result = dict(serving=serve_times(model, args))
        print_serving(result["serving"])
    elif args.steps:
        rows = step_times(model, args)
        print(f"{'backend':8} {'step':24} {'ms':>9} {'floor ms':>9}  share")
        for r in rows:
            print(f"{r['backend']:8} {r['kind']:24} {r['ms']:9.3f} {r['floor_ms']:9.3f}  "
                  f"{share_of_floor(r['floor_ms'], r['ms'])}"
                  + (f"  {r['tok_per_s']:,.0f} tok/s" if "tok_per_s" in r else ""))
        result = dict(steps=rows)
    else:
        result = run_throughput(model, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
    return result


def run_throughput(model: str, args) -> dict:
    """Each engine in turn on the workload; a row is printed as soon as its engine finishes
    (a run cut short still shows what it measured), and the engines that could not run are
    listed once at the end."""
    shape = model_shape(model)
    work = make_workload(args, shape["vocab_size"])
    dtype = engine_dtype(model)
    device = measure_device(dtype)
    floor = physical_floor(shape, work, device, dtype.itemsize)
    engines = args.engines.split(",")
    prompt_tokens = sum(len(p) for p in work.prompts)
    print(f"{len(work.prompts)} requests, {prompt_tokens} prompt + {sum(work.output_lens)} "
          f"output tokens on {device['device']} ({device['bandwidth'] / 1e9:,.0f} GB/s copy, "
          f"{device['flops'] / 1e12:,.2f} TFLOP/s {device['dtype']} matmul, measured)")
    if args.preset == "cpu":
        expected = sum(CPU_PRESET_SECONDS.get(e.partition(":")[0], 60) for e in engines)
        print(f"expect about {expected / 60:.0f} min (seconds per engine on a 2-core CPU: "
              f"{', '.join(f'{e} {s}' for e, s in CPU_PRESET_SECONDS.items())})")
    print(f"{'engine':18} {'time s':>8} {'out tok/s':>10} {'total tok/s':>11} "
          f"{'vs nanopaged':>12}  floor", flush=True)
    results, base, not_run = {}, None, {}
    for engine in engines:
        print(f"running {engine} ...", file=sys.stderr)
        r = results[engine] = run_engine(engine, model, work, args)
        if "elapsed" not in r:
            not_run[engine] = r.get("skipped") or r.get("error")
            continue
        r["output_tok_per_s"] = r["output_tokens"] / r["elapsed"]
        r["total_tok_per_s"] = (r["output_tokens"] + prompt_tokens) / r["elapsed"]
        r["share_of_floor"] = share_of_floor(floor["seconds"], r["elapsed"])
        base = base or (r["elapsed"] if engine.startswith("nanopaged") else None)
        ratio = f"{base / r['elapsed']:.2f}x" if base else "-"
        print(f"{engine:18} {r['elapsed']:8.2f} {r['output_tok_per_s']:10,.0f} "
              f"{r['total_tok_per_s']:11,.0f} {ratio:>12}  {r['share_of_floor']}", flush=True)
    for engine, r in results.items():
        if engine.startswith("nanopaged") and "elapsed" in r:
            print(f"\n{engine} ({r['backend']}): TTFT median {r['ttft_median']:.3f} s, "
                  f"p99 {r['ttft_p99']:.3f} s; TPOT median {1e3 * r['tpot_median']:.2f} ms, "
                  f"p99 {1e3 * r['tpot_p99']:.2f} ms; prefix-cache hits "
                  f"{100 * r['prefix_hit_rate']:.1f}%; {r['preemptions']} preemptions; "
                  f"{r['kv_blocks']} KV blocks")
    if floor["seconds"] >= MEANINGFUL_FLOOR_S:
        print(f"physical floor {floor['seconds']:.2f} s ({floor['weight_bytes'] / 1e9:,.1f} GB "
              f"weights + {floor['kv_bytes'] / 1e9:,.1f} GB KV reads, "
              f"{floor['flops'] / 1e12:,.1f} TFLOP)")
    for engine, why in not_run.items():
        print(f"not run: {engine}: {why}")
    return dict(device=device, floor=floor, engines=results, workload=dict(
        num_requests=len(work.prompts), prompt_tokens=prompt_tokens,
        output_tokens=sum(work.output_lens), prefix_len=args.prefix_len))


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if "serving" in result:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for server, rates in result["serving"].items():
            for ax, key in zip(axes, ("ttft_99_ms", "itl_99_ms")):
                ax.plot(list(rates), [r[key] for r in rates.values()], marker="o", label=server)
        for ax, title in zip(axes, ("TTFT p99", "inter-token latency p99")):
            ax.set(xlabel="request rate (req/s)", ylabel="ms", title=title)
            ax.legend()
    elif "steps" in result:
        decode = [r for r in result["steps"] if r["kind"].startswith("decode")]
        fig, ax = plt.subplots(figsize=(6, 4))
        for backend in sorted({r["backend"] for r in decode}):
            rows = [r for r in decode if r["backend"] == backend]
            batches = [int(r["kind"].split("=")[1]) for r in rows]
            ax.plot(
                batches,
                [b / (r["ms"] / 1e3) for b, r in zip(batches, rows)],
                marker="o",
                label=backend,
            )
        ax.set(
            xlabel="batch size",
            ylabel="decode tok/s",
            xscale="log",
            title="decode throughput by batch size",
        )
        ax.legend()
    else:
        engines = {k: v for k, v in result["engines"].items() if "output_tok_per_s" in v}
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(engines), [v["output_tok_per_s"] for v in engines.values()])
        ax.set(
            ylabel="output tok/s",
            title=f"{result['workload']['num_requests']} requests on {result['device']['device']}",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
