"""vLLM's `PoolingParams` and the outputs of pooling requests (`vllm.outputs`'
names)."""

from dataclasses import dataclass

import torch

from nanopaged.checks import check_fields
from nanopaged.outputs import RequestMetrics

TASKS = ("embed", "classify", "score", "token_embed")


@dataclass
class PoolingParams:
    """How one input is pooled. `dimensions` cuts an embedding to its first
    `dimensions` values before it is normalized (Matryoshka: only where the model
    declares it can); `normalize` (embeddings) and `use_activation` (softmax, or the
    sigmoid of one label, of a classifier's logits) default to True, None meaning the
    model's choice; `truncate_prompt_tokens` keeps the input's last k tokens. `task` is
    set by the method that runs the request (`LLM.embed`: "embed", ...)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    def validate(self) -> None:
        check_fields(
            self,
            {"task": (None, *TASKS)},
            ("dimensions", "truncate_prompt_tokens"),
        )

    def clone(self) -> "PoolingParams":
        return PoolingParams(**vars(self))


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """One pooling request's output: `outputs` is a PoolingOutput (`encode`), or an
    Embedding-, Classification- or ScoringOutput (the subclasses below). `error` says
    why a request failed alone (its outputs then None)."""

    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None


class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput


class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput


class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput
