"""CUDA graphs of the decode step: a few hundred kernel launches replayed as one."""

from collections.abc import Callable

import torch
from torch import nn

from nanopaged.core.attention import AttentionMetadata
from nanopaged.core.config import Config


def capture_cuda_graph(forward: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """The kernels `forward()` launches, recorded once as a graph in memory `pool`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool):
        forward()
    torch.cuda.synchronize()
    return graph


class DecodeGraphs:
    """One graph of the model's decode forward per batch size (1, 2, 4, 8, then steps of
    16), captured largest first into one memory pool. A batch replays the
    next larger size's graph over static buffers (padding rows: slot -1, no context)."""

    def __init__(self, model: nn.Module, config: Config, max_blocks_per_seq: int):
        sizes = [1, 2, 4, 8, *range(16, 513, 16)]
        self.batch_sizes = [s for s in sizes if s <= min(config.max_num_seqs, 512)]
        self.max_batch = size = self.batch_sizes[-1]
        with torch.device(config.device):
            self.input_ids = torch.zeros(size, dtype=torch.int64)
            self.positions = torch.zeros(size, dtype=torch.int64)
            table = torch.full((size, max_blocks_per_seq), -1, dtype=torch.int32)
            self.meta = AttentionMetadata(
                ragged=False,
                slot_mapping=torch.full((size,), -1, dtype=torch.int64),
                context_lens=torch.zeros(size, dtype=torch.int32),
                block_tables=table,
                max_seqlen_k=config.max_model_len,
            )
            hidden_size = config.hf_config.hidden_size
            self.hidden = torch.zeros(size, hidden_size, dtype=config.dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        with torch.inference_mode():
            for batch_size in reversed(self.batch_sizes):
                self.graphs[batch_size] = self.capture(model, batch_size)

    def capture(self, model: nn.Module, n: int) -> torch.cuda.CUDAGraph:
        """The graph of a decode batch of `n`, over the buffers' first `n` rows."""
        meta = self.meta
        rows = (meta.slot_mapping[:n], meta.context_lens[:n], meta.block_tables[:n])
        args = (self.input_ids[:n], self.positions[:n])
        args += (AttentionMetadata(False, *rows, meta.max_seqlen_k),)

        def forward() -> None:
            self.hidden[:n] = model(*args)

        forward()  # warm-up
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        return capture_cuda_graph(forward, pool)

    def replay(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a decode batch of at most `max_batch` sequences."""
        n = input_ids.shape[0]
        graph_size = next(size for size in self.batch_sizes if size >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.meta.slot_mapping[:graph_size].fill_(-1)
        self.meta.slot_mapping[:n] = meta.slot_mapping
        self.meta.context_lens[:graph_size].zero_()
        self.meta.context_lens[:n] = meta.context_lens
        self.meta.block_tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[graph_size].replay()
        return self.hidden[:n]
