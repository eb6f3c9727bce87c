"""One step at a time: decode step time at several batch sizes and prefill tok/s, per
attention backend, each against its floor."""

import importlib.util
import statistics

from benchmarks.floor import (
    engine_dtype,
    measure_device,
    model_shape,
    share_of_floor,
    weight_bytes,
)
from benchmarks.workload import repeated_time, timed


def step_times(model: str, args) -> list[dict]:
    """Decode step time at several batch sizes with `--context`-token contexts, and
    prefill tok/s, each against its floor: for a decode step the longer of moving its
    bytes (every weight, every K/V of its contexts) and doing its arithmetic (every
    weight, the LM head's too, and the attention's, for each sequence), for a prefill
    its arithmetic (the LM head's on each prompt's last token only)."""
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
            max_num_seqs=max(*args.batch_sizes, args.prefill_seqs),
            max_model_len=args.context + 64,
            enforce_eager=args.enforce_eager,
            max_num_batched_tokens=max(
                args.prefill_seqs * args.context, max(args.batch_sizes)
            ),
            kv_cache_dtype=args.kv_cache_dtype,
        )
        dtype_bytes = llm.config.dtype.itemsize
        for batch in args.batch_sizes:
            seconds, step = _decode_step_time(llm, batch, args.context)
            moved = weight_bytes(shape, dtype_bytes, device["gpu"]) + (
                batch
                * args.context
                * shape["kv_elements_per_token"]
                * llm.config.kv_cache_dtype.itemsize
            )
            flops = batch * (
                2 * shape["active_params"]
                + shape["attention_flops_per_pair"] * args.context
            )
            floor_seconds = max(moved / device["bandwidth"], flops / device["flops"])
            rows.append(
                dict(
                    backend=backend,
                    kind=f"decode b={batch}",
                    ms=seconds * 1e3,
                    floor_ms=floor_seconds * 1e3,
                    tokens=len(step.seqs),
                )
            )
        seconds, tokens, prompts = _prefill_step_time(
            llm, args.prefill_seqs, args.context
        )
        # the LM head runs on each prompt's last token only: no engine needs the
        # logits of the others (as the throughput floor counts it)
        decoder_params = shape["active_params"] - shape["lm_head_params"]
        flops = (
            2 * decoder_params * tokens
            + 2 * shape["lm_head_params"] * prompts
            + shape["attention_flops_per_pair"] * prompts * args.context**2 // 2
        )
        rows.append(
            dict(
                backend=backend,
                kind=f"prefill {tokens} tok",
                ms=seconds * 1e3,
                floor_ms=flops / device["flops"] * 1e3,
                tok_per_s=tokens / seconds,
                tokens=tokens,
            )
        )
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
    return [
        llm.add_request(torch.randint(0, top, (context,), generator=g).tolist(), params)
        for _ in range(count)
    ]


def _decode_step_time(llm, batch: int, context: int):
    """The same decode step of `batch` sequences, timed again and again (it rewrites the
    same cache slots); the prompts are prefilled first, untimed. -> (seconds, the
    step)"""
    request_ids = _random_requests(llm, batch, context, seed=batch)
    engine = llm.engine
    while engine.scheduler.waiting:
        llm.run_step()
    step = engine.scheduler.schedule()
    assert not step.ragged and len(step.seqs) == batch
    seconds = repeated_time(
        lambda: engine.runner.collect(engine.runner.launch(step)), repeat=20
    )
    engine.block_manager.commit()  # the step ran: its K/V is written
    for request_id in request_ids:
        llm.abort(request_id)
    return seconds, step


def _prefill_step_time(llm, count: int, context: int):
    """One step prefilling `count` new prompts (new each time: no prefix-cache hits).
    -> (seconds, tokens the step ran, prompts it ran)"""
    times = []
    for seed in range(6):
        request_ids = _random_requests(llm, count, context, seed=1000 + seed)
        elapsed, (step, _) = timed(llm.run_step)
        times.append(elapsed)
        for request_id in request_ids:
            llm.abort(request_id)
    return statistics.median(times[1:]), step.num_scheduled_tokens, len(step.seqs)


def print_steps(rows: list[dict]) -> None:
    print(f"{'backend':8} {'step':24} {'ms':>9} {'floor ms':>9}  share")
    for r in rows:
        print(
            f"{r['backend']:8} {r['kind']:24} {r['ms']:9.3f} {r['floor_ms']:9.3f}  "
            f"{share_of_floor(r['floor_ms'], r['ms'])}"
            + (f"  {r['tok_per_s']:,.0f} tok/s" if "tok_per_s" in r else "")
        )
