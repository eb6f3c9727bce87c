"""Runs the model: owns the weights, the KV cache, the decode graphs, and the sampler."""
import itertools
import math
import os

import numpy as np
import torch
import torch.distributed as dist

from nanopaged.core.attention import BACKENDS, AttentionMetadata
from nanopaged.core.config import Config
from nanopaged.core.cuda_graphs import DecodeGraphs
from nanopaged.core.layers import to_device
from nanopaged.core.loader import load_model
from nanopaged.core.sampler import Sampler
from nanopaged.core.sequence import SamplingOptions, Sequence, cdiv
from nanopaged.core.step import SamplerOutput, ScheduledStep, StepInputs

# On CPU the KV cache takes at most this share of the RAM available at start-up.
CPU_KV_CACHE_FRACTION = 0.25


class ModelRunner:
    """Turns a scheduled step into model inputs, runs the model, and samples. Prefill steps run
    eagerly over a ragged batch; decode steps replay a CUDA graph captured for the next larger batch
    size, when graphs are on. Seam: a subclass may run `execute` on several processes (tensor
    parallelism), or extend `_allocate_kv_cache` (to add weights before the pool is sized),
    `prepare_inputs` and `execute` (LoRA: `nanopaged/lora/`). `extra_kv_bytes_per_block` are left
    free, per block, for another model's cache in the same blocks (a speculative draft's)."""

    def __init__(self, config: Config, extra_kv_bytes_per_block: int = 0):
        self.config = config
        self.extra_kv_bytes_per_block = extra_kv_bytes_per_block
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        self.model = load_model(config.model, config.hf_config, config.dtype, self.device,
                                config.attention_backend)
        self.sampler = Sampler(self.device, config.seed, BACKENDS[config.attention_backend].sample)
        self.max_blocks_per_seq = cdiv(config.max_model_len, self.block_size)
        self.graphs: DecodeGraphs | None = None
        self.num_kvcache_blocks = self._allocate_kv_cache()
        if self.device.type == "cuda" and not config.enforce_eager \
                and config.attention_backend != "torch":
            self.graphs = DecodeGraphs(self.model, config, self.max_blocks_per_seq)

    def close(self) -> None:
        """Releases what the runner started (a subclass's processes)."""

    # ---- the KV cache ----

    def _kv_bytes_per_block(self) -> int:
        """Bytes of one block in every layer, another model's included."""
        shape = self.model.kv_cache_shape(1, self.block_size)
        own = math.prod(shape) * self.config.kv_cache_dtype.itemsize
        return own + self.extra_kv_bytes_per_block

    def _allocate_kv_cache(self) -> int:
        """Sizes the pool (unless `num_kvcache_blocks` forces it) and allocates it."""
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            budget = self._kv_budget_cuda() if self.device.type == "cuda" else self._kv_budget_cpu()
            num_blocks = int(budget // self._kv_bytes_per_block())
        if dist.is_initialized():  # one block table addresses every rank's pool
            count = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks < 1:
            raise ValueError("not enough memory left for even one KV-cache block; lower "
                             "max_num_batched_tokens or raise gpu_memory_utilization")
        self._make_kv_cache(num_blocks)
        return num_blocks

    def _make_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # free the old one first
        self.kv_cache = self.model.allocate_kv_cache(num_blocks, self.block_size,
                                                     self.config.kv_cache_dtype, self.device)

    def _kv_budget_cpu(self) -> int:
        available = _mem_available_bytes()
        enough = self.config.max_num_seqs * self.max_blocks_per_seq * self._kv_bytes_per_block()
        return min(int(available * CPU_KV_CACHE_FRACTION), enough)

    def _kv_budget_cuda(self) -> int:
        """Free GPU memory after a forward of the largest prefill the scheduler can issue, and
        after sampling the largest decode batch: what is left of `gpu_memory_utilization`."""
        self._make_kv_cache(1)  # the profiling forward writes and reads one block over and over
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        config = self.config
        seq_len = min(config.max_num_batched_tokens, config.max_model_len)
        num_seqs = max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
        self.execute(self.prepare_inputs(_profiling_step(num_seqs, seq_len, self.block_size)))
        seq = Sequence([0], SamplingOptions(temperature=1.0, top_p=0.9))
        logits = torch.randn(config.max_num_seqs, config.hf_config.vocab_size, device=self.device)
        self.sampler(logits, [seq] * config.max_num_seqs)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        activations = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        return int(total * config.gpu_memory_utilization - (total - free) - activations)

    # ---- inputs ----

    def prepare_inputs(self, step: ScheduledStep) -> StepInputs:
        """The step's model inputs, as host arrays: all the host work of a step but scheduling."""
        if step.ragged or step.proposals:
            return self._prepare_ragged(step)
        positions = np.array(step.starts)
        block_tables = self._block_tables(step.seqs)
        # the block of the token being decoded (blocks reserved for proposals may follow it)
        blocks = block_tables[np.arange(len(positions)), positions // self.block_size]
        return StepInputs(
            ragged=False, input_ids=np.array([seq.token_ids[-1] for seq in step.seqs]),
            positions=positions,
            slot_mapping=blocks.astype(np.int64) * self.block_size + positions % self.block_size,
            context_lens=positions + 1, block_tables=block_tables,
            logits_indices=np.arange(len(step.seqs)))

    def _prepare_ragged(self, step: ScheduledStep) -> StepInputs:
        proposals = step.proposals
        input_ids, positions, slots, num_tokens = [], [], [], []
        for i, (seq, start, n) in enumerate(zip(step.seqs, step.starts, step.num_tokens)):
            tokens = seq.token_ids[start:start + n] + proposals.get(i, [])
            pos = np.arange(start, start + len(tokens))
            input_ids.append(np.asarray(tokens))
            positions.append(pos)
            slots.append(np.asarray(seq.block_table)[pos // self.block_size] * self.block_size
                         + pos % self.block_size)
            num_tokens.append(len(tokens))
        cu_seqlens_q = np.cumsum([0, *num_tokens])
        context_lens = np.add(step.starts, num_tokens)
        # a sampling row's logits: its sequence's last token, then one per proposal
        counts = np.array([1 + len(proposals.get(i, ())) for i in step.sample_rows], np.int64)
        ends = np.repeat(cu_seqlens_q[1:][step.sample_rows], counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts), counts)
        prompt_rows = [(i, min(start + n, seq.num_prompt_tokens - 1) - start) for i, (seq, start, n)
                       in enumerate(zip(step.seqs, step.starts, step.num_tokens))
                       if seq.prompt_logits and start + 1 < seq.num_prompt_tokens]
        rows = [np.arange(n) + cu_seqlens_q[i] for i, n in prompt_rows]
        return StepInputs(
            ragged=True, input_ids=np.concatenate(input_ids),
            positions=np.concatenate(positions), slot_mapping=np.concatenate(slots),
            context_lens=context_lens, block_tables=self._block_tables(step.seqs),
            logits_indices=np.concatenate([ends + offsets, *rows]).astype(np.int64),
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=np.cumsum([0, *context_lens]),
            max_seqlen_q=max(num_tokens), prompt_rows=prompt_rows)

    def _block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """(num_seqs, longest block table) int32, padded with -1."""
        lengths = np.array([len(seq.block_table) for seq in seqs])
        table = np.full((len(seqs), lengths.max()), -1, dtype=np.int32)
        table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(seq.block_table for seq in seqs), np.int32, lengths.sum())
        return table

    # ---- running ----

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> SamplerOutput:
        """One step: runs the model over the step's tokens and samples every row of
        `step.samplers` (and after each of its proposals)."""
        inputs = self.prepare_inputs(step)
        return self.sample(self.execute(inputs), step, inputs)

    def sample(self, logits: torch.Tensor | None, step: ScheduledStep, inputs: StepInputs
               ) -> SamplerOutput:
        """A token for each sampling row, and one after each of its proposals (sampled at the
        position it would take: a seeded sequence's numbers stay its own)."""
        if not step.proposals:
            rows = step.samplers
            sampled = self.sampler(logits[:len(rows)], rows).view(-1, 1).tolist() if rows else []
            return SamplerOutput(sampled, logits, range(len(rows)),
                                 self.prompt_logits(logits, len(rows), inputs))
        counts = [1 + len(step.proposals.get(i, ())) for i in step.sample_rows]
        rows = [seq for seq, count in zip(step.samplers, counts) for _ in range(count)]
        offsets = [j for count in counts for j in range(count)]
        sampled = self.sampler(logits[:len(rows)], rows, offsets).tolist()
        first_rows = list(itertools.accumulate(counts[:-1], initial=0))
        return SamplerOutput([sampled[first:first + count] for first, count in
                              zip(first_rows, counts)], logits, first_rows,
                             self.prompt_logits(logits, len(rows), inputs))

    @staticmethod
    def prompt_logits(logits: torch.Tensor | None, first: int, inputs: StepInputs
                      ) -> dict[int, torch.Tensor]:
        """The rows of `logits` from `first` on, by the sequences that asked for them."""
        rows = inputs.prompt_rows
        starts = itertools.accumulate((count for _, count in rows), initial=first)
        return {i: logits[start:start + count] for (i, count), start in zip(rows, starts)}

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Runs the model over one step's inputs; returns the logits of the rows
        `inputs.logits_indices` picks (None when there are none)."""
        hidden = self._run_model(*self.device_inputs(inputs))
        if len(inputs.logits_indices) == 0:
            return None
        if inputs.ragged:  # a decode step samples every row, once
            hidden = hidden[to_device(self.device, inputs.logits_indices, torch.int64)]
        return self.model.compute_logits(hidden)

    def device_inputs(self, inputs: StepInputs
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The model's arguments for a step's inputs: token ids, positions, attention metadata."""
        meta = AttentionMetadata(
            ragged=inputs.ragged,
            slot_mapping=to_device(self.device, inputs.slot_mapping, torch.int64),
            context_lens=to_device(self.device, inputs.context_lens, torch.int32),
            block_tables=to_device(self.device, inputs.block_tables, torch.int32),
            max_seqlen_k=int(inputs.context_lens.max()),
            cu_seqlens_q=to_device(self.device, inputs.cu_seqlens_q, torch.int32),
            cu_seqlens_k=to_device(self.device, inputs.cu_seqlens_k, torch.int32),
            max_seqlen_q=inputs.max_seqlen_q)
        return (to_device(self.device, inputs.input_ids, torch.int64),
                to_device(self.device, inputs.positions, torch.int64), meta)

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        if meta.ragged or self.graphs is None or input_ids.shape[0] > self.graphs.max_batch:
            return self.model(input_ids, positions, meta)
        return self.graphs.replay(input_ids, positions, meta)


def _profiling_step(num_seqs: int, length: int, block_size: int) -> ScheduledStep:
    """The largest prefill step: `num_seqs` prompts of `length` tokens, all in block 0."""
    step = ScheduledStep()
    for _ in range(num_seqs):
        seq = Sequence([0] * length, SamplingOptions())
        seq.block_table = [0] * cdiv(length, block_size)
        step.add(seq, length)
    return step


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if "MemAvailable" in line)
    except OSError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2  # not Linux: a guess
