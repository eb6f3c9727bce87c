"""Runs the model: owns the weights, the KV cache, the CUDA graphs, and the sampler."""
import os

import numpy as np
import torch

from nanopaged.attention import AttentionMetadata
from nanopaged.config import Config
from nanopaged.loader import load_weights
from nanopaged.model import CausalLM
from nanopaged.sampler import Sampler
from nanopaged.sampling_params import SamplingParams
from nanopaged.sequence import Sequence

# On CPU the KV cache takes at most this share of the RAM available at start-up.
CPU_KV_CACHE_FRACTION = 0.25


class ModelRunner:
    """Turns a scheduled batch of sequences into model inputs, runs the model, and samples.

    Prefill steps run eagerly over a ragged batch; decode steps replay a CUDA graph captured for
    the next larger batch size, when graphs are on.
    """

    def __init__(self, config: Config):
        self.config = config
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        hf_config = config.hf_config
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        with self.device:
            self.model = CausalLM(hf_config, config.attention_backend)
        torch.set_default_dtype(default_dtype)
        load_weights(self.model, config.model)
        self.sampler = Sampler(self.device)
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.device.type == "cuda":
            self._compile_sampler()
            if not config.enforce_eager and config.attention_backend != "torch":
                self._capture_cuda_graphs()

    # ---- the KV cache ----

    def _kv_bytes_per_block(self) -> int:
        attn = self.model.model.layers[0].self_attn
        num_layers = len(self.model.model.layers)
        dtype_size = torch.empty(0, dtype=self.config.dtype).element_size()
        return 2 * num_layers * self.block_size * attn.num_kv_heads * attn.head_dim * dtype_size

    def _allocate_kv_cache(self) -> int:
        """Sizes the pool (unless `num_kvcache_blocks` forces it), allocates one tensor
        (2, num_layers, num_blocks, block_size, nkv, hs) and hands each layer its views."""
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            budget = self._kv_budget_cuda() if self.device.type == "cuda" else self._kv_budget_cpu()
            num_blocks = int(budget // self._kv_bytes_per_block())
        if num_blocks < 1:
            raise ValueError("not enough memory left for even one KV-cache block; lower "
                             "max_num_batched_tokens or raise gpu_memory_utilization")
        attn = self.model.model.layers[0].self_attn
        layers = self.model.model.layers
        self.kv_cache = torch.zeros(2, len(layers), num_blocks, self.block_size,
                                    attn.num_kv_heads, attn.head_dim,
                                    dtype=self.config.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]
        return num_blocks

    def _kv_budget_cpu(self) -> int:
        available = _mem_available_bytes()
        enough = self.config.max_num_seqs * self.max_blocks_per_seq * self._kv_bytes_per_block()
        return min(int(available * CPU_KV_CACHE_FRACTION), enough)

    def _kv_budget_cuda(self) -> int:
        """Free GPU memory after a forward of the largest prefill the scheduler can issue, and
        after sampling the largest decode batch: what is left of `gpu_memory_utilization`."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        config = self.config
        seq_len = min(config.max_num_batched_tokens, config.max_model_len)
        num_seqs = max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
        seqs = [_dummy_sequence(seq_len, self.block_size) for _ in range(num_seqs)]
        input_ids, positions, meta, _ = self._prepare_prefill(seqs)
        self._run_model(input_ids, positions, meta)
        vocab_size = self.config.hf_config.vocab_size
        logits = torch.randn(config.max_num_seqs, vocab_size, device=self.device)
        self.sampler(logits, [_dummy_sequence(1, self.block_size, temperature=1.0, top_p=0.9)
                              for _ in range(config.max_num_seqs)])
        del logits
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        peak = torch.cuda.max_memory_allocated()
        current = torch.cuda.memory_allocated()
        return int(total * config.gpu_memory_utilization - used - (peak - current))

    def _compile_sampler(self) -> None:
        """torch.compile specialises on batches of one: compile both kinds now, not mid-run."""
        vocab_size = self.config.hf_config.vocab_size
        for batch_size in (1, 2):
            logits = torch.randn(batch_size, vocab_size, device=self.device)
            self.sampler(logits, [_dummy_sequence(1, self.block_size, temperature=1.0)] * batch_size)

    # ---- inputs ----

    def _prepare_prefill(self, seqs: list[Sequence]):
        input_ids, positions, slots, logits_indices = [], [], [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            pos = np.arange(start, end)
            input_ids.append(np.asarray(seq.token_ids[start:end]))
            positions.append(pos)
            slots.append(self._slots(seq, pos))
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            if seq.samples_this_step:
                logits_indices.append(cu_seqlens_q[-1] - 1)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._to_device(np.concatenate(slots), torch.int64),
            context_lens=self._to_device([s.num_computed_tokens + s.num_scheduled_tokens
                                          for s in seqs], torch.int32),
            block_tables=self._block_tables(seqs),
            max_seqlen_k=max(cu_seqlens_k[i + 1] - cu_seqlens_k[i] for i in range(len(seqs))),
            cu_seqlens_q=self._to_device(cu_seqlens_q, torch.int32),
            cu_seqlens_k=self._to_device(cu_seqlens_k, torch.int32),
            max_seqlen_q=max(s.num_scheduled_tokens for s in seqs),
        )
        return (self._to_device(np.concatenate(input_ids), torch.int64),
                self._to_device(np.concatenate(positions), torch.int64), meta, logits_indices)

    def _prepare_decode(self, seqs: list[Sequence]):
        positions = np.array([len(seq) - 1 for seq in seqs])
        # the token being decoded lives in the last block of its sequence
        slots = [seq.block_table[-1] * self.block_size + (len(seq) - 1) % self.block_size
                 for seq in seqs]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._to_device(slots, torch.int64),
            context_lens=self._to_device(positions + 1, torch.int32),
            block_tables=self._block_tables(seqs),
            max_seqlen_k=int(positions.max()) + 1,
        )
        input_ids = self._to_device([seq.last_token for seq in seqs], torch.int64)
        return input_ids, self._to_device(positions, torch.int64), meta, slice(None)

    def _slots(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        block_table = np.asarray(seq.block_table)
        return block_table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        table = np.full((len(seqs), width), -1, dtype=np.int32)
        for row, seq in zip(table, seqs):
            row[:len(seq.block_table)] = seq.block_table
        return self._to_device(table, torch.int32)

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.as_tensor(np.asarray(values), dtype=dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    # ---- running ----

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One step: returns the next token of every sequence whose last token ran."""
        prepare = self._prepare_prefill if is_prefill else self._prepare_decode
        input_ids, positions, meta, logits_indices = prepare(seqs)
        hidden = self._run_model(input_ids, positions, meta)
        sampling_seqs = [seq for seq in seqs if seq.samples_this_step]
        if not sampling_seqs:
            return []
        logits = self.model.compute_logits(hidden[logits_indices])
        return self.sampler(logits, sampling_seqs).tolist()

    @torch.inference_mode()
    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        batch_size = input_ids.shape[0]
        if meta.is_prefill or not self.graphs or batch_size > max(self.graphs):
            return self.model(input_ids, positions, meta)
        return self._replay_graph(input_ids, positions, meta)

    # ---- CUDA graphs ----

    def _graph_batch_sizes(self) -> list[int]:
        max_batch = min(self.config.max_num_seqs, 512)
        sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
        return [size for size in sizes if size <= max_batch]

    @torch.inference_mode()
    def _capture_cuda_graphs(self) -> None:
        """Captures one decode graph per batch size, largest first, all in one memory pool.
        The graphs read their inputs from static buffers that `_replay_graph` fills."""
        max_batch = max(self._graph_batch_sizes())
        hidden_size = self.config.hf_config.hidden_size
        self.graph_buffers = {
            "input_ids": torch.zeros(max_batch, dtype=torch.int64, device=self.device),
            "positions": torch.zeros(max_batch, dtype=torch.int64, device=self.device),
            "slot_mapping": torch.full((max_batch,), -1, dtype=torch.int64, device=self.device),
            "context_lens": torch.zeros(max_batch, dtype=torch.int32, device=self.device),
            "block_tables": torch.full((max_batch, self.max_blocks_per_seq), -1,
                                       dtype=torch.int32, device=self.device),
            "hidden": torch.zeros(max_batch, hidden_size, dtype=self.config.dtype, device=self.device),
        }
        pool = None
        for batch_size in reversed(self._graph_batch_sizes()):
            graph = torch.cuda.CUDAGraph()
            args = self._graph_args(batch_size)
            self.graph_buffers["hidden"][:batch_size] = self.model(*args)  # warm-up
            with torch.cuda.graph(graph, pool):
                self.graph_buffers["hidden"][:batch_size] = self.model(*args)
            pool = graph.pool()
            self.graphs[batch_size] = graph
            torch.cuda.synchronize()

    def _graph_args(self, batch_size: int):
        b = self.graph_buffers
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=b["slot_mapping"][:batch_size],
            context_lens=b["context_lens"][:batch_size], block_tables=b["block_tables"][:batch_size],
            max_seqlen_k=self.config.max_model_len)
        return b["input_ids"][:batch_size], b["positions"][:batch_size], meta

    def _replay_graph(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        batch_size = input_ids.shape[0]
        graph_size = next(size for size in sorted(self.graphs) if size >= batch_size)
        b = self.graph_buffers
        b["input_ids"][:batch_size] = input_ids
        b["positions"][:batch_size] = positions
        b["slot_mapping"][:graph_size].fill_(-1)
        b["slot_mapping"][:batch_size] = meta.slot_mapping
        b["context_lens"][:graph_size].zero_()
        b["context_lens"][:batch_size] = meta.context_lens
        b["block_tables"][:batch_size, :meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[graph_size].replay()
        return b["hidden"][:batch_size]


def _dummy_sequence(length: int, block_size: int, **sampling) -> Sequence:
    """A sequence for profiling runs: its tokens are computed in one step into no cache."""
    seq = Sequence([0] * length, SamplingParams(**sampling), block_size)
    seq.num_scheduled_tokens = length
    seq.block_table = [0] * seq.num_blocks
    return seq


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2  # not Linux: a guess
