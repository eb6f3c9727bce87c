"""What every vision-language model here shares: the core's decoder as its language
model (built from the checkpoint's `text_config`), multimodal RoPE where the config asks
for it, the checkpoint's names of both halves, and a forward that puts each image's
tokens where its placeholders are.

A step's images reach the model through `step_vision`, which the vision extension
(`runner.py`) sets before each forward and the forward takes: the rows of the step
whose tokens are an image's, those tokens, every token's three positions, and for a
family whose images' tokens see each other, the span each row sees. A
placeholder's token id in the step is its image's pad id (past the vocabulary: see
`processing.py`), whose embedding is never read.
"""

import copy
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from nanopaged.core.layers import Kernels
from nanopaged.core.model import CausalLM
from nanopaged.vision.mrope import MRotaryEmbedding, sources


@dataclass
class StepVision:
    """One step's images, on the model's device: `rows` (R,) of the step take `embeds`
    (R, hidden; None: no image in the step); `positions` (3, T) are the step's
    multimodal positions (None: its 1-D ones); `spans` (T, 2), the first and last
    position each row sees besides its past (first > last: none; None: no row has
    one)."""

    rows: torch.Tensor
    embeds: torch.Tensor | None
    positions: torch.Tensor | None
    spans: torch.Tensor | None = None


def text_config(config: PretrainedConfig, architecture: str) -> PretrainedConfig:
    """The language model's config, as the core's decoder reads one."""
    text = copy.copy(config.get_text_config())
    text.architectures = [architecture]
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
    return text


class VisionLanguageModel(CausalLM):
    """A family's model: a `text_architecture` the core decodes, and `encode` (its
    vision tower) in the subclass. `bidirectional_images`: an image's tokens see each
    other both ways (the runner then gives each step its `spans`)."""

    text_architecture = "Qwen2ForCausalLM"
    # multimodal RoPE: None (1-D positions), "sections" or "interleaved" (`mrope.py`)
    mrope_layout: str | None = None
    bidirectional_images = False
    # checkpoint names of the vision tower and projector, the published and
    # transformers' own
    vision_prefixes = ("visual.", "vision_tower.", "multi_modal_projector.")

    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        text = text_config(config, self.text_architecture)
        super().__init__(text, kernels)
        self.vocab_size = text.vocab_size
        self.step_vision: StepVision | None = None
        self.mrope = self.mrope_layout is not None
        parameters = getattr(text, "rope_parameters", None) or {}
        # transformers' default where a config names no sections
        sections = parameters.get("mrope_section", [24, 20, 20])
        for layer in self.model.layers if self.mrope else ():
            attention = layer.self_attn
            attention.rotary_emb = MRotaryEmbedding(
                attention.head_dim,
                text.max_position_embeddings,
                parameters,
                kernels,
                sources(sections, self.mrope_layout == "interleaved"),
            )

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        vision, self.step_vision = self.step_vision, None
        # an image's placeholders hold its pad id (past the vocabulary): any row will do
        embeds = self.model.embed_tokens(input_ids.clamp(max=self.vocab_size - 1))
        if vision is not None and vision.positions is not None:
            positions = vision.positions
        hidden, residual = self.first_layer_inputs(embeds, vision)
        deepstack = self.deepstack(vision, embeds.shape[1])
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(positions, hidden, residual, meta)
            if i < len(deepstack):
                hidden[vision.rows] += deepstack[i].to(hidden.dtype)
        return self.model.norm(hidden, residual)[0]

    def first_layer_inputs(self, embeds: torch.Tensor, vision: StepVision | None):
        """The first layer's input and residual stream (None: the layer's own start):
        the step's embeddings, its images' tokens in their rows."""
        if vision is not None and vision.embeds is not None:
            embeds[vision.rows] = vision.embeds[:, : embeds.shape[1]].to(embeds.dtype)
        return embeds, None

    @staticmethod
    def deepstack(vision: StepVision | None, width: int) -> tuple:
        """What the first layers add to the image's rows (Qwen3-VL's DeepStack): an
        image's tokens wider than the model are its tokens, then one more of each
        width for each layer."""
        if vision is None or vision.embeds is None or vision.embeds.shape[1] == width:
            return ()
        return vision.embeds[:, width:].split(width, dim=-1)

    def checkpoint_param(self, name: str):
        if name.removeprefix("model.").startswith(self.vision_prefixes):
            return self.vision_param(name.removeprefix("model.")), None
        return super().checkpoint_param(name.replace("model.language_model.", "model."))

    def vision_param(self, name: str) -> str:
        """The vision tower's parameter a checkpoint tensor is (the family's names)."""
        return name

    def param_parts(self, name: str) -> list:
        if name.startswith(self.vision_prefixes):
            return [None]
        return super().param_parts(name)

    def encode(self, images: list[dict]) -> list[torch.Tensor]:
        """Each image's tokens for the language model (its processor's inputs)."""
        raise NotImplementedError
