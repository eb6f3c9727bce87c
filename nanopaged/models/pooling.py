"""The pooling architectures, which `features.py` enters in the core's
`ARCHITECTURES`: each family's bare decoder (`Qwen3Model`: an embedding model's body,
as Sentence Transformers saves it) and its classifier (`Qwen3ForSequenceClassification`:
the body and a `score` head). Both are the core's `CausalLM`, whose LM head they tie to
the embedding: it costs no memory, and a checkpoint's `lm_head.weight` (a causal LM run
for pooling) is not read."""

from torch import nn
from transformers import PretrainedConfig

from nanopaged.core.layers import Kernels
from nanopaged.core.model import CausalLM

# the families with both a bare decoder and a classifier in transformers
FAMILIES = ("Qwen3", "Qwen2", "Llama", "Mistral")


class PoolingBody(CausalLM):
    """The decoder alone; its checkpoint may name its tensors without `model.`."""

    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        super().__init__(config, kernels)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.tie_word_embeddings = True

    def checkpoint_param(self, name: str) -> tuple[str, str | int | None]:
        own = name.startswith(("model.", "lm_head.", "score."))
        return super().checkpoint_param(name if own else f"model.{name}")


class SequenceClassifier(PoolingBody):
    """The decoder and `score`: the logits of `num_labels` classes of a pooled hidden
    state (replicated on every rank)."""

    def __init__(self, config: PretrainedConfig, kernels: Kernels):
        super().__init__(config, kernels)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
