"""vLLM's `vllm.config`: `WeightTransferConfig`, which `LLM(...,
weight_transfer_config=...)` takes (a dict does as well)."""

from dataclasses import dataclass


@dataclass
class WeightTransferConfig:
    """The weight transfer's backend: "nccl" (vLLM's: NCCL on GPUs, gloo on CPUs) or
    "gloo"."""

    backend: str = "nccl"
