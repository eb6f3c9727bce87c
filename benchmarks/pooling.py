"""Embeddings a second: nanopaged's pooling runner beside Sentence Transformers'
`encode`, on one checkpoint (the preset's model saved as Sentence Transformers saves an
embedding model: its decoder, last-token pooling, a Normalize module) and the same texts
(the preset's prompts, decoded), each engine in a process of its own after a warm-up."""

import os
import sys
import tempfile

from benchmarks.engines import process_context
from benchmarks.floor import model_shape
from benchmarks.workload import PRESETS, make_workload, timed

ENGINES = ("nanopaged", "sentence-transformers")


def write_embedding_model(model: str, path: str) -> str:
    """`model`'s decoder as a Sentence Transformers embedding model, saved by it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )

    body = Transformer(model)
    pooling = Pooling(body.get_embedding_dimension(), "lasttoken")
    modules = [body, pooling, Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(path)
    return path


def texts(model: str, args) -> list[str]:
    """The preset's prompts as texts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    # ids the tokenizer has (a random checkpoint's is smaller than its model's)
    size = min(len(tokenizer), model_shape(model)["vocab_size"])
    prompts = make_workload(args, size).prompts
    return tokenizer.batch_decode([[t % size for t in p] for p in prompts])


def run_nanopaged(path: str, inputs: list[str], args) -> dict:
    from nanopaged import LLM

    llm = LLM(path, dtype=args.pooling_dtype, max_model_len=args.max_model_len)
    llm.embed(inputs[-4:], use_tqdm=False)  # warm-up
    elapsed, outputs = timed(lambda: llm.embed(inputs, use_tqdm=False))
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return dict(
        elapsed=elapsed, tokens=tokens, vectors=[o.outputs.embedding for o in outputs]
    )


def run_sentence_transformers(path: str, inputs: list[str], args) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.pooling_dtype)
    model = SentenceTransformer(path, device=device, model_kwargs={"dtype": dtype})
    model.encode(inputs[-4:])  # warm-up
    elapsed, vectors = timed(lambda: model.encode(inputs))
    return dict(elapsed=elapsed, vectors=vectors.tolist())


def _child(engine: str, path: str, inputs: list[str], args, queue) -> None:
    run = run_nanopaged if engine == "nanopaged" else run_sentence_transformers
    try:
        queue.put(run(path, inputs, args))
    except Exception as error:  # report, so that the other engine still runs
        queue.put({"error": f"{type(error).__name__}: {error}"})


def run_engine(engine: str, path: str, inputs: list[str], args) -> dict:
    ctx = process_context()
    queue = ctx.Queue()
    process = ctx.Process(target=_child, args=(engine, path, inputs, args, queue))
    process.start()
    result = queue.get(timeout=args.timeout)
    process.join()
    return result


def pooling_times(model: str, args) -> list[dict]:
    """Each engine's time to embed the preset's prompts, inputs and tokens a second,
    and how far its vectors are from nanopaged's."""
    import importlib.util

    import numpy as np
    import torch

    if importlib.util.find_spec("sentence_transformers") is None:
        raise SystemExit(
            '--pooling needs sentence-transformers: pip install ".[bench]"'
        )
    on_gpu = torch.cuda.is_available()
    args.pooling_dtype = PRESETS[args.preset][2] if on_gpu else "float32"
    inputs = texts(model, args)
    with tempfile.TemporaryDirectory() as root:
        path = write_embedding_model(model, os.path.join(root, "embedding"))
        results = {}
        for engine in ENGINES:
            print(f"running {engine} ...", file=sys.stderr)
            results[engine] = run_engine(engine, path, inputs, args)
    reference = results["nanopaged"].get("vectors")
    tokens = results["nanopaged"].get("tokens")
    rows = []
    for engine, result in results.items():
        vectors = result.pop("vectors", None)
        row = dict(engine=engine, inputs=len(inputs), **result)
        if vectors is not None:
            row["inputs_per_s"] = len(inputs) / row["elapsed"]
            row["tokens_per_s"] = tokens / row["elapsed"] if tokens else None
            if reference is not None:
                diff = np.abs(np.array(vectors) - np.array(reference)).max()
                row["max_abs_diff"] = float(diff)
        rows.append(row)
    baseline = results["sentence-transformers"].get("elapsed")
    for row in rows:
        if baseline and "elapsed" in row:
            row["vs_sentence_transformers"] = baseline / row["elapsed"]
    return rows


def print_pooling(rows: list[dict]) -> None:
    print(
        f"{'engine':22} {'inputs':>6} {'time s':>8} {'inputs/s':>9} {'tok/s':>9} "
        f"{'vs ST':>6} {'max |diff|':>10}"
    )
    for r in rows:
        if "elapsed" not in r:
            print(f"{r['engine']:22} {r.get('error')}")
            continue
        print(
            f"{r['engine']:22} {r['inputs']:6} {r['elapsed']:8.2f} "
            f"{r['inputs_per_s']:9,.1f} {r.get('tokens_per_s') or 0:9,.0f} "
            f"{r.get('vs_sentence_transformers', 0):5.2f}x "
            f"{r.get('max_abs_diff', float('nan')):10.1e}"
        )
