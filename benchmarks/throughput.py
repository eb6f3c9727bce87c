"""Offline throughput: each engine on the workload, beside the physical floor."""

import sys

from benchmarks.engines import engine_name, run_engine
from benchmarks.floor import (
    MEANINGFUL_FLOOR_S,
    engine_dtype,
    measure_device,
    model_shape,
    physical_floor,
    share_of_floor,
)
from benchmarks.workload import PHASES, make_workload

# Seconds each engine took with the --cpu preset on a 2-core cloud CPU (model load
# included)
CPU_PRESET_SECONDS = {"nanopaged": 20, "hf-static": 35, "hf": 40}


def run_throughput(model: str, args) -> dict:
    """Each engine in turn on the workload; a row is printed as soon as its engine
    finishes (a run cut short still shows what it measured), and the engines that could
    not run are listed once at the end."""
    shape = model_shape(model)
    work = make_workload(args, shape["vocab_size"])
    dtype = engine_dtype(model)
    device = measure_device(dtype)
    kv_bytes = 1 if args.kv_cache_dtype == "fp8" else dtype.itemsize
    floor = physical_floor(shape, work, device, dtype.itemsize, kv_bytes)
    engines = args.engines.split(",")
    prompt_tokens = sum(len(p) for p in work.prompts)
    print(
        f"{len(work.prompts)} requests, {prompt_tokens} prompt + "
        f"{sum(work.output_lens)} output tokens on {device['device']} "
        f"({device['bandwidth'] / 1e9:,.0f} GB/s copy, {device['flops'] / 1e12:,.2f} "
        f"TFLOP/s {device['dtype']} matmul: the fastest measured on this machine)"
    )
    if args.preset == "cpu":
        expected = sum(CPU_PRESET_SECONDS.get(engine_name(e), 60) for e in engines)
        print(
            f"expect about {expected / 60:.0f} min (seconds per engine on a 2-core "
            f"CPU: {', '.join(f'{e} {s}' for e, s in CPU_PRESET_SECONDS.items())})"
        )
    print(
        f"{'engine':18} {'time s':>8} {'out tok/s':>10} {'total tok/s':>11} "
        f"{'vs nanopaged':>12}  floor",
        flush=True,
    )
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
        print(
            f"{engine:18} {r['elapsed']:8.2f} {r['output_tok_per_s']:10,.0f} "
            f"{r['total_tok_per_s']:11,.0f} {ratio:>12}  {r['share_of_floor']}",
            flush=True,
        )
    for engine, r in results.items():
        if engine.startswith("nanopaged") and "elapsed" in r:
            print(
                f"\n{engine} ({r['backend']}): TTFT median {r['ttft_median']:.3f} s, "
                f"p99 {r['ttft_p99']:.3f} s; TPOT median {1e3 * r['tpot_median']:.2f} "
                f"ms, p99 {1e3 * r['tpot_p99']:.2f} ms; prefix-cache hits "
                f"{100 * r['prefix_hit_rate']:.1f}%; {r['preemptions']} preemptions; "
                f"{r['kv_blocks']} KV blocks"
            )
    timed = {e: r["phases"] for e, r in results.items() if "phases" in r}
    if timed:
        print(f"\n{'steps: count, seconds':22}" + "".join(f"{e:>24}" for e in timed))
        for kind in PHASES:
            print(
                f"{kind:22}"
                + "".join(
                    f"{p[kind]['steps']:>14,} {p[kind]['seconds']:8.3f} s"
                    for p in timed.values()
                )
            )
    if floor["seconds"] >= MEANINGFUL_FLOOR_S:
        print(
            f"physical floor {floor['seconds']:.2f} s "
            f"({floor['weight_bytes'] / 1e9:,.1f} GB "
            f"weights + {floor['kv_bytes'] / 1e9:,.1f} GB KV reads, "
            f"{floor['flops'] / 1e12:,.1f} TFLOP)"
        )
    for engine, why in not_run.items():
        print(f"not run: {engine}: {why}")
    return dict(
        device=device,
        floor=floor,
        engines=results,
        workload=dict(
            num_requests=len(work.prompts),
            prompt_tokens=prompt_tokens,
            output_tokens=sum(work.output_lens),
            prefix_len=args.prefix_len,
        ),
    )
