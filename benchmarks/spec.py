"""Speculative decoding, off and on: a repetitive workload one request at a time, and
the preset's workload as a batch."""

import argparse
import os
import sys

from benchmarks.engines import run_engine
from benchmarks.floor import model_shape
from benchmarks.workload import make_workload, repetitive_workload

# What --spec tries when no --speculative-config is given
SPEC_CONFIGS = [
    {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    }
    for k in (4, 8)
]


def spec_times(model: str, args) -> list[dict]:
    """nanopaged without and with each speculative config: on the repetitive workload
    one request at a time, and on the preset's workload as a batch."""
    vocab_size = model_shape(model)["vocab_size"]
    workloads = [
        ("repetitive, batch 1", repetitive_workload(args, vocab_size), 1),
        (f"{args.preset} workload", make_workload(args, vocab_size), args.max_num_seqs),
    ]
    rows = []
    for name, work, max_num_seqs in workloads:
        off = None
        for spec in [None, *(args.speculative_configs or SPEC_CONFIGS)]:
            print(f"running {name} with {spec} ...", file=sys.stderr)
            run_args = argparse.Namespace(
                **dict(vars(args), speculative_config=spec, max_num_seqs=max_num_seqs)
            )
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
    return (
        f"ngram k={spec['num_speculative_tokens']} "
        f"n={spec.get('prompt_lookup_min', 5)}.."
        f"{spec.get('prompt_lookup_max', 5)}"
    )


def print_spec(rows: list[dict]) -> None:
    print(
        f"{'workload':22} {'speculation':24} {'out tok/s':>9} {'vs off':>6} "
        f"{'accepted':>8} {'mean len':>8}"
    )
    for r in rows:
        spec = spec_name(r["speculative_config"])
        if "elapsed" not in r:
            print(f"{r['workload']:22} {spec:24} {r.get('error')}")
            continue
        print(
            f"{r['workload']:22} {spec:24} {r['output_tok_per_s']:9,.0f} "
            f"{r['vs_off']:5.2f}x {100 * r['acceptance_rate']:7.1f}% "
            f"{r['mean_accepted_length']:8.2f}"
        )
