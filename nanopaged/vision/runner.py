"""Images in the runner: the runner's extension that gives each step its images' tokens
and positions (`StepVision`), and the encoder cache.

On the host (`prepare_inputs`), for each sequence the step runs, the images its tokens
cover: which rows of the step they are, and which slice of which image's tokens goes
there; and every token's multimodal positions. On the device (`before_forward`), each
image the step needs is encoded unless the encoder cache holds it: an image is encoded
once for all its chunks, however a chunked prefill splits it, and for every request
that brings it while it stays cached. The cache holds images' tokens up to a budget,
least recently used first out, never one the step needs, and nothing once the weights
change (RL's updates, sleep). Whatever the device finds
missing it encodes, so a step is right however late it runs (async scheduling) and
after a failure.
"""

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from nanopaged.core.layers import to_device
from nanopaged.core.model_runner import ModelRunner, RunnerExtension
from nanopaged.core.sequence import Sequence
from nanopaged.core.step import ScheduledStep, StepInputs
from nanopaged.vision.model import StepVision


@dataclass
class ImageItem:
    """One image of a prompt: its tokens are [start, start + length) of the prompt;
    `key` names its content (see `images.image_key`); `inputs` are what its encoder
    takes (the processor's tensors for this image alone)."""

    start: int
    length: int
    key: int
    inputs: dict


@dataclass
class SequenceImages:
    """A sequence's images, in prompt order, and its multimodal positions: the
    prompt's (3, P), and `delta`, what a token after the prompt adds to its index."""

    items: list[ImageItem]
    positions: np.ndarray | None
    delta: int


@dataclass
class VisionInputs:
    """What a step tells the device about images: the step's rows of image tokens,
    for each a (key, image, first, end) slice of an image's tokens, in row order; and
    the step's (3, T) positions (None: none needed); and its (T, 2) spans, the first
    and last position each row sees besides its past (None: none needed)."""

    rows: np.ndarray
    pieces: list[tuple[int, ImageItem, int, int]]
    positions: np.ndarray | None
    spans: np.ndarray | None = None


class VisionExtension(RunnerExtension):
    """The runner's extension of a vision-language model. `images` maps each sequence
    to its `SequenceImages` (set as its request is made); `budget` is the encoder
    cache's, in image tokens."""

    def __init__(self, budget: int):
        self.images: weakref.WeakKeyDictionary[Sequence, SequenceImages] = (
            weakref.WeakKeyDictionary()
        )
        self.budget = budget
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images encoded, for the tests and the bench

    def prepare_model(self, runner: ModelRunner) -> None:
        self.model = runner.model

    def weights_changed(self) -> None:
        self.cache.clear()  # encoded by the old tower

    def prepare_inputs(self, step: ScheduledStep, inputs: StepInputs) -> VisionInputs:
        rows, pieces = [], []
        mrope = self.model.mrope
        positions = np.repeat(inputs.positions[None], 3, axis=0) if mrope else None
        bidirectional = self.model.bidirectional_images
        # each row's span, first > last for none (Gemma 3's only)
        spans = np.tile([0, -1], (len(inputs.positions), 1)) if bidirectional else None
        offset = 0
        counts = np.diff(inputs.cu_seqlens_q) if inputs.ragged else [1] * len(step.seqs)
        for seq, start, count in zip(step.seqs, step.starts, counts):
            found = self.images.get(seq)
            if found is not None:
                end = start + count
                if mrope:
                    tokens = np.arange(start, end)
                    prompt = tokens < found.positions.shape[1]
                    block = positions[:, offset : offset + count]
                    block[:, prompt] = found.positions[:, tokens[prompt]]
                    block[:, ~prompt] += found.delta
                for item in found.items:
                    first = max(start, item.start)
                    last = min(end, item.start + item.length)
                    if first < last:
                        here = slice(offset + first - start, offset + last - start)
                        rows.extend(range(here.start, here.stop))
                        if bidirectional:
                            spans[here] = item.start, item.start + item.length - 1
                        pieces.append(
                            (item.key, item, first - item.start, last - item.start)
                        )
            offset += count
        if positions is not None and not rows:
            # no image's token: the three positions agree, and the step runs on one,
            # as any model's (a decode step then replays its graph)
            inputs.positions[:] = positions[0]
            positions = None
        seen = spans if rows else None
        return VisionInputs(np.array(rows, dtype=np.int64), pieces, positions, seen)

    def before_forward(self, inputs: StepInputs) -> None:
        vision = inputs.extension
        if vision is None:  # a step no runner prepared (the profiling forward)
            return
        if not vision.pieces and vision.positions is None:
            self.model.step_vision = None  # a plain step (maybe a graph's)
            return
        device = self.model.device
        needed = {key: item for key, item, _, _ in vision.pieces}
        missing = [item for key, item in needed.items() if key not in self.cache]
        if missing:
            for item, tokens in zip(
                missing, self.model.encode([i.inputs for i in missing])
            ):
                self.cache[item.key] = tokens
            self.num_encoded += len(missing)
        for key in needed:
            self.cache.move_to_end(key)
        embeds = [self.cache[key][first:end] for key, _, first, end in vision.pieces]
        positions, spans = vision.positions, vision.spans
        self.model.step_vision = StepVision(
            to_device(device, vision.rows, torch.int64),
            torch.cat(embeds) if embeds else None,
            None if positions is None else to_device(device, positions, torch.int64),
            None if spans is None else to_device(device, spans, torch.int64),
        )
        self.evict(keep=needed)

    def evict(self, keep) -> None:
        """Drops the least recently used images past the budget, but those in `keep`."""
        held = sum(len(tokens) for tokens in self.cache.values())
        for key in list(self.cache):
            if held <= self.budget:
                break
            if key not in keep:
                held -= len(self.cache.pop(key))
