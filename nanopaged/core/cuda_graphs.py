"""CUDA graphs of the decode step: a few hundred kernel launches replayed as one."""
from collections.abc import Callable

import torch
from torch import nn

from nanopaged.core.attention import AttentionMetadata
from nanopaged.core.config import Config


def capture_cuda_graph(forward: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """The kernels `forward()` launches, recorded once as a graph in the memory `pool`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool):
        forward()
    torch.cuda.synchronize()
    return graph


class DecodeGraphs:
    """One graph of the model's decode forward per batch size (1, 2, 4, 8, then steps of 16),
    captured largest first into one memory pool by `capture`. A batch replays the next larger
    size's graph, over static buffers where padding rows get slot -1 and no context."""

    def __init__(self, model: nn.Module, config: Config, max_blocks_per_seq: int,
                 capture: Callable = capture_cuda_graph):
        max_batch = min(config.max_num_seqs, 512)
        self.batch_sizes = [s for s in [1, 2, 4, 8, *range(16, 513, 16)] if s <= max_batch]
        self.max_batch = size = self.batch_sizes[-1]
        with torch.device(config.device):
            self.input_ids = torch.zeros(size, dtype=torch.int64)
            self.positions = torch.zeros(size, dtype=torch.int64)
            self.meta = AttentionMetadata(
                ragged=False, slot_mapping=torch.full((size,), -1, dtype=torch.int64),
                context_lens=torch.zeros(size, dtype=torch.int32),
                block_tables=torch.full((size, max_blocks_per_seq), -1, dtype=torch.int32),
                max_seqlen_k=config.max_model_len)
            self.hidden = torch.zeros(size, config.hf_config.hidden_size, dtype=config.dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        with torch.inference_mode():
            for batch_size in reversed(self.batch_sizes):
                self.graphs[batch_size] = self._capture(model, batch_size, capture)

    def _capture(self, model: nn.Module, n: int, capture: Callable) -> torch.cuda.CUDAGraph:
        meta = self.meta
        args = (self.input_ids[:n], self.positions[:n], AttentionMetadata(
            False, meta.slot_mapping[:n], meta.context_lens[:n], meta.block_tables[:n],
            meta.max_seqlen_k))

        def forward() -> None:
            self.hidden[:n] = model(*args)
        forward()  # warm-up
        return capture(forward, next(iter(self.graphs.values())).pool() if self.graphs else None)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a decode batch of at most `max_batch` sequences."""
        n = input_ids.shape[0]
        graph_size = next(size for size in self.batch_sizes if size >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.meta.slot_mapping[:graph_size].fill_(-1)
        self.meta.slot_mapping[:n] = meta.slot_mapping
        self.meta.context_lens[:graph_size].zero_()
        self.meta.context_lens[:n] = meta.context_lens
        self.meta.block_tables[:n, :meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[graph_size].replay()
        return self.hidden[:n]
