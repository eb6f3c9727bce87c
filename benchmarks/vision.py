"""Images in, text out: nanopaged beside transformers' batched `generate` on one
vision-language checkpoint (the preset's language model with a Qwen2.5-VL vision tower,
random weights) and one set of requests: each an image (of a few sizes, each image sent
by several requests, after the same text) and a question, greedy, as many tokens out as
the preset's workload draws (uniform in its `output_len`). transformers runs them as
the hf-static engine does text: batches of `--hf-batch-size` of similar output length,
each to its longest, counting the tokens the requests asked for. Each engine runs in a
process of its own after a warm-up; nanopaged's row also says what share of its time
the vision tower took, how many images it encoded, and how much of the prompts the
prefix cache served."""

import os
import sys
import time

from benchmarks.engines import process_context
from benchmarks.workload import CACHE_DIR, PRESETS

ENGINES = ("nanopaged", "hf")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# (requests, distinct images) by preset
SIZES = {"default": (64, 16), "cpu": (32, 8), "tiny": (8, 2)}
SIDES = [(448, 448), (560, 392), (504, 504)]  # 256, 280 and 324 tokens
# the processor's pixel budget, as mm_processor_kwargs (its checkpoint's is small)
PIXELS = {"max_pixels": 28 * 28 * 400}


def vision_model(preset: str) -> str:
    """The preset's language model with a Qwen2.5-VL vision tower, written once."""
    from nanopaged.random_checkpoint import (
        VISION_SHAPES,
        write_random_vision_checkpoint,
    )

    _, text, dtype, _ = PRESETS[preset]
    path = os.path.join(CACHE_DIR, f"random-{preset}-qwen2.5-vl")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    tiny = VISION_SHAPES["qwen2.5-vl"]
    half = text["head_dim"] // 2
    sections = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    text_config = {
        k: v for k, v in text.items() if k not in ("architectures", "model_type")
    }
    text_config.update(
        model_type="qwen2_5_vl_text",
        rope_parameters=dict(tiny["text_config"]["rope_parameters"]),
    )
    text_config["rope_parameters"]["mrope_section"] = sections
    wide = preset != "tiny"
    vision = dict(
        tiny["vision_config"],
        out_hidden_size=text["hidden_size"],
        depth=8 if wide else 2,
        hidden_size=256 if wide else 32,
        intermediate_size=512 if wide else 64,
        num_heads=4 if wide else 2,
        fullatt_block_indexes=[3, 7] if wide else [1],
    )
    shape = dict(tiny, text_config=text_config, vision_config=vision)
    print(f"writing a random-weight vision model to {path}", file=sys.stderr)
    return write_random_vision_checkpoint(path, shape=shape)


def requests(args) -> tuple[list[str], list, list[int]]:
    """The prompts, their images and the tokens each generates."""
    import numpy as np
    from PIL import Image

    count, distinct = SIZES[args.preset]
    rng = np.random.RandomState(args.seed)
    images = [
        Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))
        for w, h in (SIDES[i % len(SIDES)] for i in range(distinct))
    ]
    prompts = [
        f"You look at pictures and answer in a few words. {IMAGE} Question {i}: "
        "what does the picture show?"
        for i in range(count)
    ]
    low, high = args.output_len
    lens = rng.randint(low, high + 1, count).tolist()
    return prompts, [images[i % distinct] for i in range(count)], lens


def run_nanopaged(path: str, prompts, images, lens: list[int], args) -> dict:
    from PIL import Image

    from nanopaged import LLM, SamplingParams

    llm = LLM(path, max_model_len=args.max_model_len, mm_processor_kwargs=PIXELS)
    greedy = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens
    ]
    model = llm.engine.runner.model
    encode, spent = model.encode, [0.0]

    def timed_encode(inputs):
        start = time.perf_counter()
        tokens = encode(inputs)
        spent[0] += time.perf_counter() - start
        return tokens

    model.encode = timed_encode
    requests = [
        {"prompt": p, "multi_modal_data": {"image": i}} for p, i in zip(prompts, images)
    ]
    # a warm-up on other images (mirrored), which neither cache holds for the run
    mirrored = [i.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for i in images[:2]]
    warmup = [
        {"prompt": p, "multi_modal_data": {"image": i}}
        for p, i in zip(prompts, mirrored)
    ]
    llm.generate(warmup, greedy[:2], use_tqdm=False)
    llm.reset_prefix_cache()
    spent[0], encoded = 0.0, llm.vision.num_encoded
    start = time.perf_counter()
    outputs = llm.generate(requests, greedy, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return dict(
        elapsed=elapsed,
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        encoder_share=spent[0] / elapsed,
        images_encoded=llm.vision.num_encoded - encoded,
        prefix_hit_rate=sum(o.num_cached_tokens for o in outputs) / prompt_tokens,
    )


def run_hf(path: str, prompts, images, lens: list[int], args) -> dict:
    import torch
    from transformers import (
        AutoImageProcessor,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    processor = AutoImageProcessor.from_pretrained(path, **PIXELS)
    image_id = model.config.image_token_id

    def generate(batch: list[int]) -> list[list[int]]:
        pixels = processor(images=[images[i] for i in batch], return_tensors="pt")
        sizes = [
            int(g.prod()) // processor.merge_size**2 for g in pixels.image_grid_thw
        ]
        texts = [
            prompts[i].replace("<|image_pad|>", "<|image_pad|>" * n)
            for i, n in zip(batch, sizes)
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True)
        longest = max(lens[i] for i in batch)
        with torch.no_grad():
            ids = model.generate(
                **inputs,
                **pixels,
                mm_token_type_ids=(inputs.input_ids == image_id).int(),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
            )
        out = ids[:, inputs.input_ids.shape[1] :].tolist()
        return [tokens[: lens[i]] for tokens, i in zip(out, batch)]

    order = sorted(range(len(prompts)), key=lambda i: lens[i])
    size = args.hf_batch_size
    batches = [order[i : i + size] for i in range(0, len(order), size)]
    generate(order[:2])  # warm-up
    start, tokens = time.perf_counter(), [None] * len(prompts)
    for batch in batches:
        for i, found in zip(batch, generate(batch)):
            tokens[i] = found
    return dict(elapsed=time.perf_counter() - start, tokens=tokens)


def _child(engine: str, path: str, work, args, queue) -> None:
    run = run_nanopaged if engine == "nanopaged" else run_hf
    try:
        queue.put(run(path, *work, args))
    except Exception as error:  # report, so that the other engine still runs
        queue.put({"error": f"{type(error).__name__}: {error}"})


def vision_times(args) -> list[dict]:
    """Each engine's output tokens a second on the preset's image requests, and how
    many of its requests' tokens equal nanopaged's."""
    path = args.model or vision_model(args.preset)
    work = requests(args)
    results = {}
    ctx = process_context()
    for engine in ENGINES:
        print(f"running {engine} ...", file=sys.stderr)
        queue = ctx.Queue()
        process = ctx.Process(target=_child, args=(engine, path, work, args, queue))
        process.start()
        results[engine] = queue.get(timeout=args.timeout)
        process.join()
    reference = results["nanopaged"].get("tokens")
    rows = []
    for engine, result in results.items():
        tokens = result.pop("tokens", None)
        row = dict(engine=engine, requests=len(work[0]), **result)
        if tokens is not None:
            row["output_tokens_per_s"] = sum(work[2]) / row["elapsed"]
            if reference is not None:
                row["same_tokens"] = sum(a == b for a, b in zip(tokens, reference))
        rows.append(row)
    baseline = results["hf"].get("elapsed")
    for row in rows:
        if baseline and "elapsed" in row:
            row["speedup_vs_hf"] = baseline / row["elapsed"]
    return rows


def print_vision(rows: list[dict]) -> None:
    print(
        f"{'engine':<10} {'requests':>8} {'time s':>8} {'out tok/s':>10} {'vs hf':>6} "
        f"{'same':>5} {'encoder':>8} {'encoded':>8} {'prefix hits':>11}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['engine']:<10} failed: {row['error']}")
            continue
        share = row.get("encoder_share")
        hits = row.get("prefix_hit_rate")
        print(
            f"{row['engine']:<10} {row['requests']:>8} {row['elapsed']:>8.2f} "
            f"{row['output_tokens_per_s']:>10.1f} {row['speedup_vs_hf']:>5.2f}x "
            f"{row.get('same_tokens', '-'):>5} "
            f"{'-' if share is None else f'{share:.0%}':>8} "
            f"{row.get('images_encoded', '-'):>8} "
            f"{'-' if hits is None else f'{hits:.0%}':>11}"
        )
