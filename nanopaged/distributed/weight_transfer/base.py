"""vLLM's `vllm.distributed.weight_transfer.base`: the requests that the engine's
`init_weight_transfer_engine` and `update_weights` take (a dict of the same field is
taken too)."""

from dataclasses import dataclass, field


@dataclass
class WeightTransferInitRequest:
    """`init_info`: master_address, master_port, world_size and rank_offset (the
    engine's first rank in the group; the trainer is rank 0)."""

    init_info: dict = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """`update_info`: names, dtype_names and shapes of the weights the trainer sends,
    in its order."""

    update_info: dict = field(default_factory=dict)
