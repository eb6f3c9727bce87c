"""LoRA adapters, off and on: the preset's workload with LoRA off, with it on and every
request on the base model (what enabling it costs), and with request i under adapter i
mod N of N random adapters in peft's format (max_loras=N: one step runs them all)."""

import argparse
import json
import os
import sys
import tempfile

from benchmarks.engines import run_engine
from benchmarks.floor import model_shape
from benchmarks.workload import make_workload

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    """The (out, in) features of each projection an adapter may change: attention's, and
    the MLP's in a dense model."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    hidden = c.hidden_size
    shapes = {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
    }
    if not getattr(c, "num_experts", None) and not getattr(
        c, "num_local_experts", None
    ):
        inter = c.intermediate_size
        shapes.update(
            gate_proj=(inter, hidden),
            up_proj=(inter, hidden),
            down_proj=(hidden, inter),
        )
    return dict(shapes, layers=c.num_hidden_layers)


def write_adapters(model: str, count: int, rank: int, root: str) -> list[str]:
    """`count` random rank-`rank` adapters of every projection, as peft saves them."""
    import torch
    from safetensors.torch import save_file

    shapes = projection_shapes(model)
    layers = shapes.pop("layers")
    paths = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(layers):
            for name, (out, features) in shapes.items():
                block = "self_attn" if name in ATTENTION else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, features, generator=g) * 0.01
                )
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(out, rank, generator=g) * 0.01
                )
        path = os.path.join(root, f"adapter{i}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(
                {
                    "peft_type": "LORA",
                    "r": rank,
                    "lora_alpha": 2 * rank,
                    "target_modules": list(shapes),
                    "base_model_name_or_path": model,
                },
                f,
            )
        paths.append(path)
    return paths


def lora_times(model: str, args) -> list[dict]:
    """nanopaged on the preset's workload: LoRA off, on with no adapter, on with N
    adapters."""
    work = make_workload(args, model_shape(model)["vocab_size"])
    rows, off = [], None
    with tempfile.TemporaryDirectory() as root:
        adapters = write_adapters(model, args.lora, args.lora_rank, root)
        for name, paths in (
            ("off", None),
            ("on, base model", []),
            (f"{args.lora} adapters", adapters),
        ):
            print(f"running LoRA {name} ...", file=sys.stderr)
            r = run_engine(
                "nanopaged",
                model,
                work,
                argparse.Namespace(**dict(vars(args), lora_paths=paths)),
            )
            if "elapsed" in r:
                r["output_tok_per_s"] = r["output_tokens"] / r["elapsed"]
                off = off or r["output_tok_per_s"]
                r["vs_off"] = r["output_tok_per_s"] / off
            rows.append(dict(lora=name, rank=args.lora_rank, **r))
    return rows


def print_lora(rows: list[dict]) -> None:
    print(f"{'LoRA':16} {'rank':>4} {'time s':>8} {'out tok/s':>10} {'vs off':>7}")
    for r in rows:
        if "elapsed" not in r:
            print(f"{r['lora']:16} {r['rank']:4} {r.get('error') or r.get('skipped')}")
            continue
        print(
            f"{r['lora']:16} {r['rank']:4} {r['elapsed']:8.2f} "
            f"{r['output_tok_per_s']:10,.0f} "
            f"{r['vs_off']:6.2f}x"
        )
