"""Images in, text out: vision-language models through vLLM's multimodal API, on the
paged cache. How an image travels through the engine (docs/vision.md draws it):

1. `processing.py`, above the core: the checkpoint's image processor turns each image
   into its pixels and says how many tokens it is; the prompt's placeholder for it is
   expanded to that many image tokens, and in the request's sequences they take the
   image's pad id, which names its content for the prefix cache.
2. The core schedules the sequence as any other: its image's tokens may be split over
   chunks of a prefill, preempted and computed again; its blocks are hashed by their
   ids, so they are shared only with the same image after the same text.
3. `runner.py`, the runner's extension: for each step, which rows are which image's
   tokens; on the device, the image encoded (once: an encoder cache keeps it), its
   tokens put in the step's rows, and every token's multimodal positions.
4. The model (`model.py` and a family's file: `qwen2_5_vl.py`, `qwen3_vl.py`,
   `gemma3.py`): the vision tower in plain PyTorch, the language model the core's
   decoder.

`FAMILIES` names each architecture's model class and how its prompts hold images.
"""

from nanopaged.vision.gemma3 import Gemma3VL
from nanopaged.vision.model import VisionLanguageModel
from nanopaged.vision.processing import (
    Family,
    ImageProcessor,
    gemma3_family,
    qwen_vl_family,
)
from nanopaged.vision.qwen2_5_vl import Qwen2_5_VL
from nanopaged.vision.qwen3_vl import Qwen3VL
from nanopaged.vision.runner import VisionExtension

# architecture -> (its model class, its prompts' family given its config)
FAMILIES = {
    "Qwen2_5_VLForConditionalGeneration": (Qwen2_5_VL, qwen_vl_family),
    "Qwen3VLForConditionalGeneration": (Qwen3VL, qwen_vl_family),
    "Gemma3ForConditionalGeneration": (Gemma3VL, gemma3_family),
}
# images a prompt may hold without limit_mm_per_prompt
DEFAULT_LIMIT = 4


def vision_parts(
    config, surface: dict, tokenizer
) -> tuple[VisionExtension, ImageProcessor]:
    """The runner's extension and the request side of a vision-language engine, made
    of its options (`limit_mm_per_prompt`, `mm_processor_kwargs`,
    `allowed_local_media_path`, `allow_remote_media`)."""
    architecture = next(a for a in config.hf_config.architectures if a in FAMILIES)
    _, family_of = FAMILIES[architecture]
    limits = surface["limit_mm_per_prompt"] or {}
    if set(limits) - {"image"} or not all(
        isinstance(n, int) and n >= 0 for n in limits.values()
    ):
        raise ValueError(
            f"limit_mm_per_prompt takes {{'image': N}} (N >= 0), got {limits!r}"
        )
    budget = max(config.max_num_batched_tokens, 16384)
    processor = ImageProcessor(
        family_of(config.hf_config),
        config.model,
        tokenizer,
        config.hf_config.vocab_size,
        limits.get("image", DEFAULT_LIMIT),
        surface["mm_processor_kwargs"] or {},
        surface["allowed_local_media_path"],
        surface["allow_remote_media"],
    )
    return VisionExtension(budget), processor


__all__ = ["FAMILIES", "Family", "VisionLanguageModel", "vision_parts"]
