"""Images into a request, above the core: vLLM's `{"prompt": ..., "multi_modal_data":
{"image": ...}}` made into the token ids the engine runs.

Each image goes through the checkpoint's own image processor (transformers'
`AutoImageProcessor`, with `mm_processor_kwargs`), which gives its pixels and so how
many tokens the image is. The prompt holds one placeholder per image (the family's:
`<|image_pad|>` for Qwen2.5-VL), which becomes as many image tokens, as the family's
processor expands it: in the text, which is then tokenized, or in the token ids (unless
they hold every image's tokens already, as an output's `prompt_token_ids` do: a beam of
beam search, a conversation sent back).

Then, in each of the request's sequences, the image's tokens take its **pad id**: the
vocabulary's size plus a hash of the image (`images.image_key`). The engine never
embeds them (the model puts the image's tokens there), but the prefix cache hashes
blocks by their token ids: two prompts with the same text and other images share no
block, and the same image twice does. (SGLang pads its input ids the same way.)
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nanopaged.vision.images import image_key, load_image
from nanopaged.vision.mrope import prompt_positions
from nanopaged.vision.runner import ImageItem, SequenceImages

PAD_RANGE = 2**62  # pad ids are vocab_size + key % PAD_RANGE: within int64
PROCESSED_KEPT = 16  # the latest images' processed inputs kept, for requests again


@dataclass
class Family:
    """How a family's prompts hold images: `placeholder`, what a prompt has per image;
    `expansion(n)`, what it becomes for an image of n tokens; `image_token`, the token
    whose places take the image's tokens; `num_tokens(inputs)`, an image's tokens from
    its processed inputs; `grid(inputs)`, its grid (t, h, w) of tokens for multimodal
    RoPE (None: the family has none); `bidirectional`, whether an image's tokens see
    each other both ways (then no chunk of a prefill cuts an image: the sequence's
    `spans`)."""

    placeholder: str
    expansion: Callable[[int], str]
    image_token: str
    num_tokens: Callable[[dict], int]
    grid: Callable[[dict], tuple[int, int, int]] | None = None
    bidirectional: bool = False


def qwen_vl_family(config) -> Family:
    merge = config.vision_config.spatial_merge_size

    def grid(inputs: dict) -> tuple[int, int, int]:
        t, h, w = inputs["image_grid_thw"][0].tolist()
        return t, h // merge, w // merge

    return Family(
        "<|image_pad|>",
        lambda n: "<|image_pad|>" * n,
        "<|image_pad|>",
        lambda inputs: int(np.prod(grid(inputs))),
        grid,
    )


def gemma3_family(config) -> Family:
    def num_tokens(inputs: dict) -> int:
        if len(inputs["pixel_values"]) != 1:
            raise ValueError(
                "an image cut into crops (do_pan_and_scan) is not supported: each "
                "image is one square"
            )
        return config.mm_tokens_per_image

    return Family(
        "<start_of_image>",
        lambda n: f"\n\n<start_of_image>{'<image_soft_token>' * n}<end_of_image>\n\n",
        "<image_soft_token>",
        num_tokens,
        bidirectional=True,
    )


@dataclass
class ImagePrompt:
    """A prompt with its images made into tokens: the prompt for `InputProcessor` (its
    text and expanded token ids) and, per image, its first token, its length, its key
    and its inputs."""

    prompt: dict
    items: list[ImageItem]


class ImageProcessor:
    """The images of one engine's requests (see the module's docstring)."""

    def __init__(
        self,
        family: Family,
        model_path: str,
        tokenizer,
        vocab_size: int,
        limit: int,
        processor_kwargs: dict,
        allowed_local_media_path: str | None,
        allow_remote_media: bool = False,
    ):
        from transformers import AutoImageProcessor

        self.family, self.tokenizer, self.vocab_size = family, tokenizer, vocab_size
        self.limit, self.kwargs = limit, dict(processor_kwargs)
        self.allowed, self.allow_remote = allowed_local_media_path, allow_remote_media
        try:
            self.processor = AutoImageProcessor.from_pretrained(
                model_path, **self.kwargs
            )
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(
                f"cannot load the checkpoint's image processor with "
                f"mm_processor_kwargs={processor_kwargs}: {error}"
            ) from None
        self.processed: OrderedDict[int, dict] = OrderedDict()  # key -> inputs
        self.image_token_id = tokenizer.convert_tokens_to_ids(family.image_token)
        self.placeholder_id = tokenizer.convert_tokens_to_ids(family.placeholder)

    def images_of(self, data) -> list:
        """The images of a prompt's `multi_modal_data`, loaded (a ValueError names what
        is wrong)."""
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(
                f"multi_modal_data takes 'image' (an image or a list of them), got "
                f"{data!r:.80}"
            )
        images = data.get("image")
        images = images if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.limit:
            raise ValueError(
                f"a prompt has {len(images)} images, more than "
                f"limit_mm_per_prompt={{'image': {self.limit}}}"
            )
        return [load_image(i, self.allowed, self.allow_remote) for i in images]

    def process(self, prompt: dict, images: list) -> ImagePrompt:
        """`prompt` (a text, or token ids, and its own `mm_processor_kwargs` over the
        engine's) with its placeholders expanded for `images`. Token ids that hold each
        image's tokens already, as an output's `prompt_token_ids` do, stay as they
        are."""
        kwargs = prompt.get("mm_processor_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ValueError(
                f"mm_processor_kwargs must be a dict, got {type(kwargs).__name__}"
            )
        processing = {**self.kwargs, **kwargs}
        keys = [image_key(image, processing) for image in images]
        inputs = [
            self._pixels(i, key, image, kwargs)
            for i, (key, image) in enumerate(zip(keys, images))
        ]
        sizes = [self.family.num_tokens(i) for i in inputs]
        text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        placeholder = self.family.placeholder
        if token_ids is None:
            found = text.count(placeholder)
            self._check_count(found, len(images))
            pieces = text.split(placeholder)
            text = pieces[0] + "".join(
                self.family.expansion(n) + piece for n, piece in zip(sizes, pieces[1:])
            )
            token_ids = self.tokenizer.encode(text)
        elif [n for _, n in runs(list(token_ids), self.image_token_id)] == sizes:
            token_ids = list(token_ids)  # expanded already: an output's prompt ids
        else:
            token_ids = list(token_ids)
            found = token_ids.count(self.placeholder_id)
            self._check_count(found, len(images))
            expanded = []
            sizes_left = iter(sizes)
            for token in token_ids:
                if token != self.placeholder_id:
                    expanded.append(token)
                    continue
                text_of = self.family.expansion(next(sizes_left))
                expanded += self.tokenizer.encode(text_of, add_special_tokens=False)
            token_ids = expanded
        starts = runs(token_ids, self.image_token_id)
        if [n for _, n in starts] != sizes:
            raise ValueError(
                f"the prompt's image tokens ({[n for _, n in starts]}) do not match "
                f"its images ({sizes} tokens): an image token outside a placeholder?"
            )
        items = [
            ImageItem(start, length, key, image_inputs)
            for (start, length), key, image_inputs in zip(starts, keys, inputs)
        ]
        expanded = {"prompt_token_ids": token_ids}
        if text is not None:
            expanded["prompt"] = text
        if "cache_salt" in prompt:
            expanded["cache_salt"] = prompt["cache_salt"]
        return ImagePrompt(expanded, items)

    def _pixels(self, index: int, key: int, image, kwargs: dict) -> dict:
        """The processor's inputs for one image, with a prompt's own `kwargs` (a
        ValueError if it fails), kept for the requests that bring it again while they
        are among the latest few."""
        found = self.processed.pop(key, None)
        if found is None:
            try:
                inputs = self.processor(images=[image], return_tensors="pt", **kwargs)
                found = dict(inputs)
            except Exception as error:
                raise ValueError(
                    f"the image processor cannot take image {index} with "
                    f"mm_processor_kwargs={ {**self.kwargs, **kwargs} }: {error}"
                ) from None
        self.processed[key] = found
        while len(self.processed) > PROCESSED_KEPT:
            self.processed.popitem(last=False)
        return found

    def _check_count(self, found: int, images: int) -> None:
        if found != images:
            raise ValueError(
                f"the prompt has {found} image placeholders "
                f"({self.family.placeholder}) for {images} images: one per image"
            )

    def check_text_only(self, token_ids: list[int]) -> None:
        """A prompt without images may not hold image tokens (nothing would fill
        them)."""
        if self.image_token_id in token_ids or self.placeholder_id in token_ids:
            raise ValueError(
                f"the prompt holds image placeholders ({self.family.placeholder}) "
                f"but no images: pass them in multi_modal_data"
            )

    def attach(self, request, image_prompt: ImagePrompt, extension) -> None:
        """Gives each of the request's sequences its images: their pad ids in its
        tokens, their items and multimodal positions in the runner's extension."""
        items = image_prompt.items
        length = len(request.prompt_token_ids)
        positions, delta = None, 0
        if self.family.grid is not None:
            grids = [(item.start, self.family.grid(item.inputs)) for item in items]
            positions, delta = prompt_positions(length, grids)
        spans = [(i.start, i.start + i.length) for i in items]
        for seq in request.seqs:
            for item in items:
                pad = self.vocab_size + item.key % PAD_RANGE
                seq.token_ids[item.start : item.start + item.length] = [
                    pad
                ] * item.length
            if self.family.bidirectional:
                seq.spans = spans
            extension.images[seq] = SequenceImages(items, positions, delta)


def runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """The (start, length) of each run of `token` in `token_ids`."""
    found, start = [], None
    for i, t in enumerate([*token_ids, None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            found.append((start, i - start))
            start = None
    return found
