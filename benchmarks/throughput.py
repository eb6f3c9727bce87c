"""Offline throughput: each engine on the workload, beside the physical floor."""

import statistics
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


def median_run(runs: list[dict], base_runs: list[dict] | None) -> dict:
    """An engine's run of median time, with every round's time (`elapsed_rounds`) and
    each round's ratio to the base engine's run of that round (`ratio_rounds`)."""
    if "elapsed" not in runs[0]:
        return runs[0]
    chosen = dict(sorted(runs, key=lambda r: r["elapsed"])[len(runs) // 2])
    chosen["elapsed_rounds"] = [r["elapsed"] for r in runs]
    base_runs = base_runs if base_runs and "elapsed" in base_runs[0] else []
    chosen["ratio_rounds"] = [
        b["elapsed"] / r["elapsed"] for b, r in zip(base_runs, runs)
    ]
    return chosen


def run_throughput(model: str, args) -> dict:
    """Each engine in turn on the workload; a row is printed as soon as its engine
    finishes (a run cut short still shows what it measured), and the engines that could
    not run are listed once at the end. With `--rounds N`, N rounds, every other one in
    reverse order; each engine's result is its run of median time, and its ratio to the
    first nanopaged engine is taken round by round (both ran in the same minutes)."""
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
            f"expect {expected / 60:.0f}-{3 * expected / 60:.0f} min (seconds per "
            f"engine, loading included, on a fast 2-core CPU: "
            f"{', '.join(f'{e} {s}' for e, s in CPU_PRESET_SECONDS.items())}; up to "
            f"three times as long on a slow or busy one)"
        )
    print(
        f"{'engine':18} {'time s':>8} {'out tok/s':>10} {'total tok/s':>11} "
        f"{'vs nanopaged':>12}  floor",
        flush=True,
    )
    not_run, runs = {}, {engine: [] for engine in engines}
    base = next((e for e in engines if e.startswith("nanopaged")), None)
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}", flush=True)
        # every other round in reverse, so that no engine always runs first
        for engine in engines if i % 2 == 0 else engines[::-1]:
            if engine in not_run:
                continue
            print(f"running {engine} ...", file=sys.stderr)
            r = run_engine(engine, model, work, args)
            if "elapsed" not in r:
                not_run[engine] = r.get("skipped") or r.get("error")
                runs[engine] = [r]
                continue
            r["output_tok_per_s"] = r["output_tokens"] / r["elapsed"]
            r["total_tok_per_s"] = (r["output_tokens"] + prompt_tokens) / r["elapsed"]
            r["share_of_floor"] = share_of_floor(floor["seconds"], r["elapsed"])
            runs[engine].append(r)
            # against the first nanopaged engine's run of this round, if it has run
            paired = base in runs and base not in not_run and len(runs[base]) == i + 1
            ratio = f"{runs[base][i]['elapsed'] / r['elapsed']:.2f}x" if paired else "-"
            print(
                f"{engine:18} {r['elapsed']:8.2f} {r['output_tok_per_s']:10,.0f} "
                f"{r['total_tok_per_s']:11,.0f} {ratio:>12}  {r['share_of_floor']}",
                flush=True,
            )
    results = {engine: median_run(rs, runs.get(base)) for engine, rs in runs.items()}
    if args.rounds > 1:
        print(f"\nmedians of {args.rounds} rounds (ratios: round by round)")
        for engine, r in results.items():
            if "elapsed" in r:
                ratios = r["ratio_rounds"]
                print(
                    f"{engine:18} {r['elapsed']:8.2f} {r['output_tok_per_s']:10,.0f} "
                    f"{r['total_tok_per_s']:11,.0f} "
                    f"{statistics.median(ratios):11.3f}x  "
                    f"({min(ratios):.2f}-{max(ratios):.2f})  {r['share_of_floor']}"
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
