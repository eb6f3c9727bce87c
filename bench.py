"""Offline throughput of nanopaged beside the engines people would use instead.

    python bench.py                      # nano-vllm's workload, Qwen3-0.6B shape
    python bench.py --engines nanopaged,hf,hf-static,nano-vllm,vllm \
        --out bench.json --plot bench.png
    python bench.py --cpu                # a small model on a CPU, beside transformers
    python bench.py --cpu --profile      # where a step's time goes, by stage
    python bench.py --prefix-len 512     # every prompt shares 512 leading tokens
    python bench.py --cpu --engines nanopaged@../before,nanopaged --rounds 6
                                         # a change's before and after, paired
    python bench.py --steps              # decode step time per batch, prefill tok/s
    python bench.py --host               # host time per decode step (no GPU needed)
    python bench.py --simulate           # the default workload on a simulated H200,
                                         # async scheduling off and on (no GPU needed)
    python bench.py --kernels --engines nanopaged:triton,nano-vllm
                                         # one decode step's kernels, engine by engine
    python bench.py --spec               # speculative decoding off and on
    python bench.py --lora 4             # LoRA off, on, and with 4 adapters
    python bench.py --pooling            # embeddings/s beside sentence-transformers
    python bench.py --cpu --vision       # image requests beside transformers
    python bench.py --tiny               # a seconds-long run on CPU
    python bench.py --serve              # the server at several request rates,
                                         # prefill-first beside mixed scheduling
    python bench.py --serve --url http://host:8000/v1
                                         # ... and another OpenAI-compatible server

Every engine runs in its own process on the same workload, after a warm-up outside the
timed region (benchmarks/engines.py), beside the physical floor: the time a perfect
engine needs to move the bytes and do the arithmetic of the workload on this machine
(benchmarks/floor.py). A preset (--cpu, --tiny) only sets defaults: flags win. Each mode
is a file of benchmarks/.
"""

import argparse
import importlib.util
import json

from benchmarks.engines import ENGINES, engine_name
from benchmarks.workload import PRESETS, resolve_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", help="local checkpoint (default: the preset's random weights)"
    )
    p.add_argument(
        "--engines",
        help=f"comma-separated, from {', '.join(ENGINES)}; nanopaged:BACKEND picks "
        "an attention backend (torch, cpu, triton, flash, auto), +async adds async "
        "scheduling; nanopaged@CHECKOUT is another checkout's (before/after)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="every other round in reverse; medians"
    )
    p.add_argument("--num-requests", type=int)
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument(
        "--prefix-len", type=int, default=0, help="tokens every prompt starts with"
    )
    p.add_argument(
        "--prefix-groups",
        type=int,
        default=1,
        help="prompt i starts with prefix i mod this many (each --prefix-len long)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="with --serve: replicas behind one server, under each routing policy",
    )
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks for nanopaged, nano-vllm and vllm (one GPU each)",
    )
    p.add_argument("--hf-attn", default="sdpa", help="attention for the hf engine")
    p.add_argument(
        "--hf-batch-size", type=int, default=64, help="batch of the hf-static engine"
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a progress bar per engine, on stderr (default: on)",
    )
    presets = p.add_mutually_exclusive_group()
    presets.add_argument(
        "--cpu",
        action="store_true",
        help="preset: a 4-layer d=256 model on a "
        "CPU, 48 requests, beside hf-static and hf",
    )
    presets.add_argument(
        "--tiny", action="store_true", help="preset: a seconds-long run on CPU"
    )
    modes = p.add_mutually_exclusive_group()
    modes.add_argument(
        "--profile",
        action="store_true",
        help="where nanopaged's time goes, by stage of a step",
    )
    modes.add_argument(
        "--steps", action="store_true", help="time decode steps and prefill instead"
    )
    modes.add_argument(
        "--host", action="store_true", help="time the host's work per decode step"
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="the workload through generate on a simulated H200 (its measured "
        "kernel-busy time per step), async scheduling off and on",
    )
    modes.add_argument(
        "--kernels",
        action="store_true",
        help="profile a decode step of each engine (--batch-sizes, --context)",
    )
    modes.add_argument(
        "--spec",
        action="store_true",
        help="speculative decoding, off and on, on "
        "a repetitive workload one request at a time and on the preset's as a batch",
    )
    modes.add_argument(
        "--lora",
        type=int,
        metavar="N",
        help="nanopaged with LoRA off, on, and with N random adapters",
    )
    modes.add_argument(
        "--pooling",
        action="store_true",
        help="embeddings a second, beside sentence-transformers on the same checkpoint",
    )
    modes.add_argument(
        "--vision",
        action="store_true",
        help="image requests on the preset's vision-language model, beside "
        "transformers' batched generate",
    )
    modes.add_argument(
        "--serve",
        action="store_true",
        help="time a server under requests that arrive over time",
    )
    p.add_argument(
        "--structured",
        action="store_true",
        help="with --host: requests that follow a JSON schema, beside plain ones",
    )
    p.add_argument(
        "--speculative-config",
        action="append",
        metavar="JSON",
        help="a vLLM speculative_config; with --spec, repeat to compare several",
    )
    p.add_argument(
        "--lora-rank", type=int, default=16, help="with --lora: the adapters' rank"
    )
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="nanopaged's KV cache (fp8: e4m3); the floor counts its bytes",
    )
    p.add_argument(
        "--request-rate", type=float, nargs="+", help="with --serve: requests a second"
    )
    p.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="with --serve: one more request, of this many prompt tokens, halfway",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="with --serve: the servers' token budget per step (their chunk size)",
    )
    p.add_argument(
        "--url",
        help="with --serve: another OpenAI-compatible server, e.g. http://host:8000/v1",
    )
    p.add_argument(
        "--backends", help="with --steps: comma-separated (default: all available)"
    )
    p.add_argument("--batch-sizes", type=int, nargs="+")
    p.add_argument("--context", type=int)
    p.add_argument("--prefill-seqs", type=int)
    p.add_argument(
        "--trace",
        metavar="PATH",
        help="nanopaged writes a trace of every step "
        "here (python -m nanopaged.trace PATH makes its page)",
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG of the results here (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        args.speculative_configs = [
            json.loads(c) for c in args.speculative_config or []
        ]
    except json.JSONDecodeError as error:
        p.error(f"--speculative-config is not JSON: {error}")
    args.speculative_config = (args.speculative_configs or [None])[0]
    # host work does not depend on the model's size
    args.preset = "cpu" if args.cpu else "tiny" if args.tiny or args.host else "default"
    for name, value in PRESETS[args.preset][3].items():
        if getattr(args, name) is None:  # flags given win over the preset
            setattr(args, name, value)
    if args.serve and importlib.util.find_spec("httpx") is None:
        p.error('--serve needs httpx: pip install -e ".[bench]"')
    other_modes = args.host, args.simulate, args.profile, args.spec, args.lora
    if args.plot and any((*other_modes, args.pooling, args.kernels, args.vision)):
        p.error("--plot draws throughput, --steps or --serve results")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error('--plot needs matplotlib: pip install -e ".[bench]"')
    unknown = {engine_name(e) for e in args.engines.split(",")} - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    return args


# the modes that time (model, args): flag -> (module, its function, its printer, key)
MODES = {
    "spec": ("spec", "spec_times", "print_spec", "speculative"),
    "lora": ("lora", "lora_times", "print_lora", "lora"),
    "pooling": ("pooling", "pooling_times", "print_pooling", "pooling"),
    "serve": ("serve", "serve_times", "print_serving", "serving"),
    "kernels": ("kernels", "kernel_profiles", "print_kernels", "kernels"),
    "steps": ("steps", "step_times", "print_steps", "steps"),
}


def main(argv=None) -> dict:
    args = parse_args(argv)
    # --simulate writes its own tiny model, --vision its vision-language one
    model = None if args.simulate or args.vision else resolve_model(args)
    if args.simulate:
        from benchmarks.simulate import print_simulation, simulate

        result = dict(simulation=simulate(args))
        print_simulation(result["simulation"])
    elif args.host:
        from benchmarks.host import host_times, print_host

        result = dict(host=host_times(model, args))
        print_host(result["host"])
    elif args.profile:
        from benchmarks.floor import model_shape
        from benchmarks.profile import print_profile, profile
        from benchmarks.workload import make_workload

        result = dict(
            profile=profile(
                model, make_workload(args, model_shape(model)["vocab_size"]), args
            )
        )
        print_profile(result["profile"])
    elif args.vision:
        from benchmarks.vision import print_vision, vision_times

        result = dict(vision=vision_times(args))
        print_vision(result["vision"])
    elif mode := next((m for m in MODES if getattr(args, m)), None):
        module, times, printer, key = MODES[mode]
        module = importlib.import_module(f"benchmarks.{module}")
        result = {key: getattr(module, times)(model, args)}
        getattr(module, printer)(result[key])
    else:
        from benchmarks.throughput import run_throughput

        result = run_throughput(model, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from benchmarks.plots import plot

        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
