"""vLLM's `vllm.distributed.weight_transfer`: what a trainer in another process uses to
send new weights to a running engine (`nccl_engine.NCCLWeightTransferEngine`), and the
requests of the engine's side (`base`). What they do: `nanopaged/rl/transfer.py`."""

from nanopaged.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

__all__ = ["WeightTransferInitRequest", "WeightTransferUpdateRequest"]
