"""Writes a random-weight checkpoint (config, safetensors, tokenizer) for offline runs
and tests.

No model hub is needed: the model comes from `transformers` with random weights, and the
tokenizer is a small byte-level BPE trained here with the `tokenizers` library (both
imported when a checkpoint is written: the shapes below are for a command's arguments,
read at once).
"""

import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (
    "Paged attention stores the key and value cache in "
    "fixed-size blocks, like pages of\n"
    "virtual memory. A block table maps each sequence's logical "
    "blocks to physical blocks, so\n"
    "sequences that share a prefix can share its blocks. The "
    "scheduler admits waiting requests,\n"
    "prefills their prompts, then decodes one token per running "
    "sequence per step. When the pool of\n"
    "blocks runs out, the newest sequence is preempted and "
    "recomputed later. Introduce yourself.\n"
    "List all prime numbers within 100. Write a short poem about "
    "the sea. Explain how a hash chain\n"
    "identifies a prefix of tokens."
)

# A model small enough to run anywhere in seconds.
TINY_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
_DECODER = {
    k: v for k, v in TINY_QWEN3.items() if k not in ("architectures", "model_type")
}
# Tiny models of each family, by name: the same width, to try each one offline in
# seconds.
SHAPES = {
    "qwen3": TINY_QWEN3,
    "qwen3-moe": dict(
        _DECODER,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_hidden_layers=3,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    "mixtral": dict(
        _DECODER,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        _DECODER,
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        sliding_window=24,
        tie_word_embeddings=False,
    ),
    "gemma3": dict(
        _DECODER,
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        num_hidden_layers=3,
        sliding_window=24,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 100000.0,
            },
        },
    ),
}


def build_tokenizer(
    vocab_size: int,
    special_tokens: list[str] = SPECIAL_TOKENS,
    named_tokens: dict[str, str] | None = None,
):
    """A byte-level BPE tokenizer trained on a paragraph: encodes any text, offline.
    `named_tokens` are special tokens it names (Gemma 3's `boi_token`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens=named_tokens or {},
    )


def write_random_checkpoint(
    path: str,
    shape: dict,
    seed: int = 0,
    dtype="float32",
    initializer_range: float = 0.02,
) -> str:
    """Writes a checkpoint of the given config with random weights, in `dtype` (a
    torch.dtype or its name), into `path`; returns it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(min(shape["vocab_size"], 1000))
    config = AutoConfig.for_model(
        **shape,
        initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Tiny vision-language models, by family: their configs as their publishers write them
VISION_SHAPES = {
    "qwen2.5-vl": dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        model_type="qwen2_5_vl",
        text_config=dict(
            _DECODER,
            model_type="qwen2_5_vl_text",
            rope_parameters={
                "rope_type": "default",
                "type": "mrope",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        tie_word_embeddings=True,
    ),
}
VISION_SHAPES["qwen3-vl"] = dict(
    architectures=["Qwen3VLForConditionalGeneration"],
    model_type="qwen3_vl",
    text_config=dict(
        _DECODER,
        model_type="qwen3_vl_text",
        num_hidden_layers=3,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    ),
    vision_config=dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    ),
    tie_word_embeddings=True,
)
GEMMA3_TEXT = {k: v for k, v in SHAPES["gemma3"].items() if k not in ("architectures",)}
VISION_SHAPES["gemma3"] = dict(
    architectures=["Gemma3ForConditionalGeneration"],
    model_type="gemma3",
    text_config=GEMMA3_TEXT,
    vision_config=dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=112,
        patch_size=14,
        vision_use_head=False,
    ),
    mm_tokens_per_image=16,
    tie_word_embeddings=True,
)
# each family's image tokens, and how its chat template writes an image's placeholder
VISION_TOKENS = {
    "qwen2.5-vl": (
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "qwen3-vl": (
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "gemma3": (
        ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
        "<start_of_image>",
    ),
}
# the tokens Gemma 3's processor finds by name in its tokenizer
GEMMA3_NAMED_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def vision_template(placeholder: str) -> str:
    """The chat template of a tiny vision-language model: each image part becomes
    `placeholder`."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] == 'image' %}"
        f"{placeholder}"
        "{% elif part['type'] == 'text' %}"
        "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def write_random_vision_checkpoint(
    path: str,
    family: str = "qwen2.5-vl",
    seed: int = 0,
    initializer_range=0.02,
    shape: dict | None = None,
) -> str:
    """Writes a vision-language checkpoint of `family` with random weights into
    `path`, as its publisher lays one out: config, safetensors, tokenizer (with the
    family's image tokens) and image processor; returns it. Its config is `shape`,
    or the family's tiny one (VISION_SHAPES)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    shape = shape or VISION_SHAPES[family]
    os.makedirs(path, exist_ok=True)
    tokens, placeholder = VISION_TOKENS[family]
    named = GEMMA3_NAMED_TOKENS if family == "gemma3" else None
    tokenizer = build_tokenizer(500, SPECIAL_TOKENS + tokens, named)
    tokenizer.chat_template = vision_template(placeholder)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokens}
    text = dict(
        shape["text_config"],
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=initializer_range,
    )
    if family == "gemma3":
        token_ids = dict(
            boi_token_index=ids["<start_of_image>"],
            eoi_token_index=ids["<end_of_image>"],
            image_token_index=ids["<image_soft_token>"],
        )
    else:
        token_ids = dict(
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    config = AutoConfig.for_model(
        **dict(shape, text_config=text),
        **token_ids,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    write_image_processor(path, family, shape, tokenizer)
    return path


def write_image_processor(path: str, family: str, shape: dict, tokenizer) -> None:
    """The family's image processor (and for Gemma 3, its processor with the
    tokenizer), as its publisher saves it."""
    vision = shape["vision_config"]
    if family == "gemma3":
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        side = vision["image_size"]
        Gemma3Processor(
            Gemma3ImageProcessorPil(
                size={"height": side, "width": side},
                do_pan_and_scan=False,
                pan_and_scan_min_crop_size=256,
                pan_and_scan_max_num_crops=4,
                pan_and_scan_min_ratio_to_activate=1.2,
            ),
            tokenizer,
            image_seq_length=shape["mm_tokens_per_image"],
        ).save_pretrained(path)
        return
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer.save_pretrained(path)
    patch = vision["patch_size"] * vision["spatial_merge_size"]
    # Qwen3-VL's processor normalises to [-1, 1]; Qwen2.5-VL's by CLIP's statistics
    half = (
        dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if family == "qwen3-vl" else {}
    )
    Qwen2VLImageProcessorPil(
        min_pixels=patch * patch * 4,
        max_pixels=patch * patch * 64,
        patch_size=vision["patch_size"],
        merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        **half,
    ).save_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    """`python -m nanopaged.random_checkpoint DIR`: a tiny Qwen3-shaped checkpoint (or
    another family's, `--shape`) in DIR."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directory")
    parser.add_argument("--shape", choices=SHAPES, default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    path = write_random_checkpoint(args.directory, shape, seed=args.seed)
    print(
        f"wrote a random-weight {shape['architectures'][0]} checkpoint "
        f"({shape['num_hidden_layers']} layers, width 64, vocabulary 512; it prints "
        f"gibberish by design) to {path}\ntry: python example.py --model {path}\n     "
        f"nanopaged serve {path}"
    )


if __name__ == "__main__":
    main()
