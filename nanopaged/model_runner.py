"""Runs the model: owns the weights, the KV cache, the decode graphs, and the sampler."""
import itertools
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from nanopaged import parallel
from nanopaged.attention import AttentionMetadata
from nanopaged.config import Config
from nanopaged.cuda_graphs import DecodeGraphs
from nanopaged.loader import load_model
from nanopaged.sampler import Sampler, SamplerOutput
from nanopaged.sampling_params import SamplingParams
from nanopaged.scheduler import ScheduledStep
from nanopaged.sequence import Sequence

# On CPU the KV cache takes at most this share of the RAM available at start-up.
CPU_KV_CACHE_FRACTION = 0.25


@dataclass
class StepInputs:
    """One step's model inputs as host arrays: built by rank 0, sent as they are to the other
    ranks. Ragged steps (prompt chunks) fill the `cu_seqlens`; `logits_indices` picks the rows
    whose next token is sampled (a row twice for two samples of one prompt), then the rows of
    the prompt tokens whose logprobs are asked for: `prompt_targets` lists, per sequence (by
    index into the step), the prompt tokens those rows predict. `block_copies` (K, 2) lists
    the copy-on-write block copies to make before the step."""
    ragged: bool
    block_copies: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    logits_indices: np.ndarray
    cu_seqlens_q: np.ndarray | None = None
    cu_seqlens_k: np.ndarray | None = None
    max_seqlen_q: int = 1
    prompt_targets: list[tuple[int, list[int]]] = field(default_factory=list)


class ModelRunner:
    """Turns a scheduled batch of sequences into model inputs, runs the model, and samples.

    Prefill steps run eagerly over a ragged batch; decode steps replay a CUDA graph captured for
    the next larger batch size, when graphs are on. With tensor parallelism, the runner of
    rank 0 starts the other ranks' runners (`run_worker`) and sends them every step's inputs;
    under torchrun, every rank's runner runs every step as the engine beside it asks.
    """

    def __init__(self, config: Config, rank: int = 0):
        self.config = config
        self.rank = rank
        self.workers = []
        self.group = None  # gloo: rank 0's messages, and the host's collectives
        if config.tensor_parallel_size == 1:
            self._build()
        elif config.external_launcher:  # every rank runs the whole engine
            self.rank = int(os.environ["RANK"])
            self.group = parallel.join_torchrun(config)
            self._build()
        else:
            self._start_ranks()

    def _start_ranks(self) -> None:
        if self.rank == 0:
            self.workers = parallel.start_workers(self.config, run_worker)
        try:
            with parallel.in_lockstep(self.workers):
                self.group = parallel.join_ranks(self.config, self.rank, self.workers)
                self._build()
        except BaseException:
            parallel.stop_workers(self.workers, None)
            raise

    def _build(self) -> None:
        config = self.config
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        self.model = load_model(config.model, config.hf_config, config.dtype, self.device,
                                config.attention_backend)
        samples = self.rank == 0 or config.external_launcher
        self.proposer = None
        if config.speculative is not None and samples:
            from nanopaged.speculative import make_proposer
            self.proposer = make_proposer(config, self.device, self.device_inputs)
        self.sampler = Sampler(self.device, config.seed) if samples else None
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.graphs: DecodeGraphs | None = None
        self.num_kvcache_blocks = self._allocate_kv_cache()
        if self.device.type == "cuda":
            if self.sampler:
                self._compile_sampler()
            if not config.enforce_eager and config.attention_backend != "torch":
                self.graphs = DecodeGraphs(self.model, config, self.max_blocks_per_seq)

    def close(self) -> None:
        """Stops the other ranks' processes, if it started them, and leaves the process group
        (tensor parallelism)."""
        if self.group is not None:
            parallel.stop_workers(self.workers, self.group)
            self.workers, self.group = [], None

    # ---- the KV cache ----

    def _kv_bytes_per_block(self) -> int:
        """Bytes of one block in every layer, the draft model's included."""
        bytes_per_block = self.model.kv_bytes_per_block(self.block_size, self.config.dtype)
        return bytes_per_block + (self.proposer.kv_bytes_per_block() if self.proposer else 0)

    def _allocate_kv_cache(self) -> int:
        """Sizes the pool (unless `num_kvcache_blocks` forces it), allocates one tensor
        (2, num_layers, num_blocks, block_size, nkv, hs) and hands each layer its views."""
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            budget = self._kv_budget_cuda() if self.device.type == "cuda" else self._kv_budget_cpu()
            num_blocks = int(budget // self._kv_bytes_per_block())
        if self.group is not None:  # one block table addresses every rank's pool
            num_blocks = parallel.min_over_ranks(num_blocks, self.group)
        if num_blocks < 1:
            raise ValueError("not enough memory left for even one KV-cache block; lower "
                             "max_num_batched_tokens or raise gpu_memory_utilization")
        self._make_kv_cache(num_blocks)
        return num_blocks

    def _make_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # free the old one first
        self.kv_cache = self.model.allocate_kv_cache(num_blocks, self.block_size,
                                                     self.config.dtype, self.device)
        if self.proposer:  # a draft model has a cache of its own, in the same blocks
            self.proposer.allocate_kv_cache(num_blocks)

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
        if self.sampler:
            vocab_size = self.config.hf_config.vocab_size
            logits = torch.randn(config.max_num_seqs, vocab_size, device=self.device)
            params = SamplingParams(temperature=1.0, top_p=0.9)
            self.sampler(logits, [Sequence([0], params, 1)] * config.max_num_seqs)
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
        seq = Sequence([0], SamplingParams(temperature=1.0), 1)
        for batch_size in (1, 2):
            logits = torch.randn(batch_size, vocab_size, device=self.device)
            self.sampler(logits, [seq] * batch_size)

    # ---- inputs ----

    def prepare_inputs(self, step: ScheduledStep, proposals: dict[int, list[int]] | None = None
                       ) -> StepInputs:
        """The step's model inputs, as host arrays: all the host work of a step but scheduling.
        `proposals` (by index into the step's sequences) are run after their sequence's token,
        each row's logits sampled."""
        copies = np.array(step.block_copies, dtype=np.int64).reshape(-1, 2)
        if step.ragged or proposals:
            return self._prepare_ragged(step, copies, proposals or {})
        return self._prepare_decode(step, copies)

    def _prepare_ragged(self, step: ScheduledStep, block_copies: np.ndarray,
                        proposals: dict[int, list[int]]) -> StepInputs:
        input_ids, positions, slots, num_tokens = [], [], [], []
        for i, (seq, start, n) in enumerate(zip(step.seqs, step.starts, step.num_tokens)):
            tokens = seq.token_ids[start:start + n] + proposals.get(i, [])
            pos = np.arange(start, start + len(tokens))
            input_ids.append(np.asarray(tokens))
            positions.append(pos)
            slots.append(self._slots(seq, pos))
            num_tokens.append(len(tokens))
        cu_seqlens_q = np.cumsum([0, *num_tokens])
        context_lens = np.add(step.starts, num_tokens)
        # a sampling row's logits: its sequence's last token, then one per proposal
        counts = np.array([1 + len(proposals.get(i, ())) for i in step.sample_rows], np.int64)
        ends = np.repeat(cu_seqlens_q[1:][step.sample_rows], counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts), counts)
        prompt_rows, prompt_targets = _prompt_logprob_rows(step, cu_seqlens_q)
        return StepInputs(
            ragged=True, block_copies=block_copies, input_ids=np.concatenate(input_ids),
            positions=np.concatenate(positions), slot_mapping=np.concatenate(slots),
            context_lens=context_lens, block_tables=self._block_tables(step.seqs),
            logits_indices=np.concatenate([ends + offsets, prompt_rows]),
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=np.cumsum([0, *context_lens]),
            max_seqlen_q=max(num_tokens), prompt_targets=prompt_targets)

    def _prepare_decode(self, step: ScheduledStep, block_copies: np.ndarray) -> StepInputs:
        positions = np.array(step.starts)
        block_tables = self._block_tables(step.seqs)
        # the block of the token being decoded (blocks reserved for proposals may follow it)
        blocks = block_tables[np.arange(len(positions)), positions // self.block_size]
        return StepInputs(
            ragged=False, block_copies=block_copies,
            input_ids=np.array([seq.token_ids[-1] for seq in step.seqs]), positions=positions,
            slot_mapping=blocks.astype(np.int64) * self.block_size + positions % self.block_size,
            context_lens=positions + 1, block_tables=block_tables,
            logits_indices=np.arange(len(step.seqs)))

    def _slots(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        block_table = np.asarray(seq.block_table)
        blocks = block_table[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """(num_seqs, longest block table) int32, padded with -1."""
        lengths = np.array([len(seq.block_table) for seq in seqs])
        table = np.full((len(seqs), lengths.max()), -1, dtype=np.int32)
        table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(seq.block_table for seq in seqs), np.int32, lengths.sum())
        return table

    def _to_device(self, values: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
        if values is None:
            return None
        tensor = torch.as_tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    # ---- running ----

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> SamplerOutput:
        """One step (rank 0): makes its block copies, runs the model, and samples every row of
        `step.samplers`. With speculative decoding, the sequences with lookahead slots run
        their proposals too, and their rows verify them."""
        inputs = self.prepare_inputs(step)
        proposals = None
        if self.proposer:
            proposals = self.proposer.propose(step, inputs)
            if proposals:
                inputs = self.prepare_inputs(step, proposals)
        if not self.workers:
            return self._run_and_sample(inputs, step, proposals)
        with parallel.in_lockstep(self.workers):
            parallel.broadcast(inputs, self.group, self.workers)
            return self._run_and_sample(inputs, step, proposals)

    def _run_and_sample(self, inputs: StepInputs, step: ScheduledStep,
                        proposals: dict[int, list[int]] | None) -> SamplerOutput:
        logits = self.execute(inputs)
        row_proposals = [proposals.get(i, []) for i in step.sample_rows] if proposals else None
        num_rows = len(step.samplers) + sum(map(len, row_proposals or []))
        sampled = SamplerOutput([], [])
        if step.samplers:
            sampled = self.sampler(logits[:num_rows], step.samplers, row_proposals)
            sampled.num_proposed = row_proposals and list(map(len, row_proposals))
        if inputs.prompt_targets:
            sampled.prompt_logprobs = self._prompt_logprobs(logits[num_rows:], step,
                                                            inputs.prompt_targets)
        if self.workers and self.device.type == "cuda":
            parallel.wait_for_gpu(self.workers)
        return sampled

    def _prompt_logprobs(self, logits: torch.Tensor, step: ScheduledStep,
                         targets: list[tuple[int, list[int]]]) -> dict:
        """The logprobs of the prompt tokens that the rows of `logits` (R, V) predict."""
        ks = [step.seqs[i].sampling_params.prompt_logprobs for i, ids in targets for _ in ids]
        token_ids = torch.tensor([t for _, ids in targets for t in ids], device=self.device)
        entries = iter(self.sampler.logprobs(logits, token_ids, ks))
        return {i: [next(entries) for _ in ids] for i, ids in targets}

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Runs the model over one step's inputs; returns the logits of the sampling rows, or
        None when no row samples."""
        if len(inputs.block_copies):
            source, destination = torch.as_tensor(inputs.block_copies, device=self.device).T
            self.kv_cache[:, :, destination] = self.kv_cache[:, :, source]
        hidden = self._run_model(*self.device_inputs(inputs))
        if len(inputs.logits_indices) == 0:
            return None
        if inputs.ragged:  # a decode step samples every row, once
            hidden = hidden[self._to_device(inputs.logits_indices, torch.int64)]
        return self.model.compute_logits(hidden)

    def device_inputs(self, inputs: StepInputs
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The model's arguments for a step's inputs: token ids, positions, attention metadata."""
        meta = AttentionMetadata(
            ragged=inputs.ragged,
            slot_mapping=self._to_device(inputs.slot_mapping, torch.int64),
            context_lens=self._to_device(inputs.context_lens, torch.int32),
            block_tables=self._to_device(inputs.block_tables, torch.int32),
            max_seqlen_k=int(inputs.context_lens.max()),
            cu_seqlens_q=self._to_device(inputs.cu_seqlens_q, torch.int32),
            cu_seqlens_k=self._to_device(inputs.cu_seqlens_k, torch.int32),
            max_seqlen_q=inputs.max_seqlen_q)
        return (self._to_device(inputs.input_ids, torch.int64),
                self._to_device(inputs.positions, torch.int64), meta)

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        if meta.ragged or self.graphs is None or input_ids.shape[0] > self.graphs.max_batch:
            return self.model(input_ids, positions, meta)
        return self.graphs.replay(input_ids, positions, meta)


def run_worker(config: Config, rank: int) -> None:
    """The life of a tensor-parallel worker process: run every step rank 0 sends, until `None`."""
    runner = ModelRunner(config, rank)
    while (inputs := parallel.receive(runner.group)) is not None:
        runner.execute(inputs)
    runner.close()


def _prompt_logprob_rows(step: ScheduledStep, cu_seqlens_q: np.ndarray
                         ) -> tuple[np.ndarray, list[tuple[int, list[int]]]]:
    """The rows of the step whose next token is a prompt token of a sequence that asks for
    prompt logprobs, and per such sequence (its index in the step) the tokens they predict."""
    rows, targets = [], []
    for i, (seq, start, num_tokens) in enumerate(zip(step.seqs, step.starts, step.num_tokens)):
        end = min(start + num_tokens, seq.num_prompt_tokens - 1)
        if seq.sampling_params.prompt_logprobs is not None and start < end:
            rows.append(np.arange(end - start) + cu_seqlens_q[i])
            targets.append((i, seq.token_ids[start + 1:end + 1]))
    return np.concatenate(rows or [np.zeros(0, np.int64)]), targets


def _profiling_step(num_seqs: int, length: int, block_size: int) -> ScheduledStep:
    """The largest prefill step: `num_seqs` prompts of `length` tokens, all in block 0."""
    step = ScheduledStep()
    for _ in range(num_seqs):
        seq = Sequence([0] * length, SamplingParams(), block_size)
        seq.block_table = [0] * seq.num_blocks
        step.add(seq, length)
    return step


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2  # not Linux: a guess
