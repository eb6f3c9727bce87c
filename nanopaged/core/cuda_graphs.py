"""CUDA graphs of the decode step: a few hundred kernel launches replayed as one."""
import torch
from torch import nn

from nanopaged.core.attention import AttentionMetadata
from nanopaged.core.config import Config


class DecodeGraphs:
    """One graph of the model's decode forward per batch size (1, 2, 4, 8, then steps of 16),
    captured largest first into one memory pool. A batch replays the graph of the next larger
    size: the graphs read static buffers, where the padding rows get slot -1 (no cache write)
    and context length 0. The block-table buffer covers `max_model_len`."""

    def __init__(self, model: nn.Module, config: Config, max_blocks_per_seq: int):
        self.model = model
        self.max_model_len = config.max_model_len
        max_batch = min(config.max_num_seqs, 512)
        sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
        self.batch_sizes = [size for size in sizes if size <= max_batch]
        self.max_batch = max(self.batch_sizes)
        device = torch.cuda.current_device()
        self.buffers = {
            "input_ids": torch.zeros(self.max_batch, dtype=torch.int64, device=device),
            "positions": torch.zeros(self.max_batch, dtype=torch.int64, device=device),
            "slot_mapping": torch.full((self.max_batch,), -1, dtype=torch.int64, device=device),
            "context_lens": torch.zeros(self.max_batch, dtype=torch.int32, device=device),
            "block_tables": torch.full((self.max_batch, max_blocks_per_seq), -1,
                                       dtype=torch.int32, device=device),
            "hidden": torch.zeros(self.max_batch, config.hf_config.hidden_size, dtype=config.dtype,
                                  device=device),
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for batch_size in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            args = self._args(batch_size)
            self.buffers["hidden"][:batch_size] = self.model(*args)  # warm-up
            with torch.cuda.graph(graph, pool):
                self.buffers["hidden"][:batch_size] = self.model(*args)
            pool = graph.pool()
            self.graphs[batch_size] = graph
            torch.cuda.synchronize()

    def _args(self, batch_size: int):
        b = self.buffers
        meta = AttentionMetadata(
            ragged=False, slot_mapping=b["slot_mapping"][:batch_size],
            context_lens=b["context_lens"][:batch_size],
            block_tables=b["block_tables"][:batch_size],
            max_seqlen_k=self.max_model_len)
        return b["input_ids"][:batch_size], b["positions"][:batch_size], meta

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a decode batch of at most `max_batch` sequences."""
        batch_size = input_ids.shape[0]
        graph_size = next(size for size in self.batch_sizes if size >= batch_size)
        b = self.buffers
        b["input_ids"][:batch_size] = input_ids
        b["positions"][:batch_size] = positions
        b["slot_mapping"][:graph_size].fill_(-1)
        b["slot_mapping"][:batch_size] = meta.slot_mapping
        b["context_lens"][:graph_size].zero_()
        b["context_lens"][:batch_size] = meta.context_lens
        b["block_tables"][:batch_size, :meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[graph_size].replay()
        return b["hidden"][:batch_size]
