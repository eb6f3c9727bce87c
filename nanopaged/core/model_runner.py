"""Runs the model: owns the weights, the KV cache, the decode graphs, the sampler."""

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
from nanopaged.core.sampler import SAMPLING_KERNELS, Sampler
from nanopaged.core.sequence import SamplingOptions, Sequence, cdiv
from nanopaged.core.step import (
    Launched,
    Pending,
    SamplerOutput,
    ScheduledStep,
    StepInputs,
)

# On CPU the KV cache takes at most this share of the RAM available at start-up.
CPU_KV_CACHE_FRACTION = 0.25


class RunnerExtension:
    """A feature's part in every rank's runner (LoRA's): `prepare_model(runner)` before
    the KV pool is sized (to add weights, wrap layers); `prepare_inputs(step, inputs)`
    on rank 0, whose result goes with the inputs to every rank (`StepInputs.extension`),
    and which may change `inputs.positions` (the vision models' text after an image);
    `before_forward(inputs)` on every rank, before the model runs the step;
    `weights_changed()` on every rank once the model's weights were written again or
    put to sleep (RL's updates), to drop whatever it computed from the old ones (the
    vision models' encoder cache). Without a feature that needs one, a runner has none
    (`extension` is None)."""

    def prepare_model(self, runner: "ModelRunner") -> None:
        pass

    def prepare_inputs(self, step: ScheduledStep, inputs: StepInputs) -> object:
        return None

    def before_forward(self, inputs: StepInputs) -> None:
        pass

    def weights_changed(self) -> None:
        pass


class ModelRunner:
    """Turns a scheduled step into model inputs, runs the model, and samples.

    Prefill steps run eagerly over a ragged batch; decode steps replay a graph when
    graphs are on: a CUDA graph captured for the next larger batch size, or the
    backend's own `graphs` (the CPU's step graphs). `enforce_eager=True` turns them off:
    the reading mode, in which every step runs the model's Python, so that a breakpoint
    in `Attention.forward` stops on every layer of every step.

    A step is launched, then collected: on a GPU, `launch` queues the device's work and
    `collect` waits for its tokens. Seams: a subclass may run `execute` on several
    processes (tensor parallelism), or `compute` the device's part elsewhere (async
    scheduling's thread on a CPU); an `extension` takes part in each step (LoRA,
    images); a `sampler` class samples (vLLM's). `extra_kv_bytes_per_block` is the room
    each block keeps for another model's cache in the same blocks (a speculative
    draft's)."""

    def __init__(
        self,
        config: Config,
        extra_kv_bytes_per_block: int = 0,
        extension: RunnerExtension | None = None,
        sampler: type[Sampler] = Sampler,
    ):
        self.config = config
        self.extra_kv_bytes_per_block = extra_kv_bytes_per_block
        self.extension = extension
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        self.backend = BACKENDS[config.attention_backend]
        self.model = load_model(config, self.device)
        kernel = SAMPLING_KERNELS.get(config.attention_backend)
        self.sampler = sampler(self.device, config.seed, kernel)
        self.max_blocks_per_seq = cdiv(config.max_model_len, self.block_size)
        self.graphs: DecodeGraphs | None = None
        if extension is not None:
            extension.prepare_model(self)
        self.num_kvcache_blocks = self.allocate_kv_cache()
        graphs = self.backend.graphs
        if graphs is None and self.device.type == "cuda":
            graphs = DecodeGraphs
        eager = config.enforce_eager or config.attention_backend == "torch"
        if graphs is not None and not eager:
            self.graphs = graphs(self.model, config, self.max_blocks_per_seq)

    def close(self) -> None:
        """Releases what the runner started (a subclass's processes)."""

    # ---- the KV cache ----

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block in every layer, another model's included."""
        own = kv_block_bytes(self.model, self.block_size, self.config.kv_cache_dtype)
        return own + self.extra_kv_bytes_per_block

    def allocate_kv_cache(self) -> int:
        """Sizes the pool (unless `num_kvcache_blocks` forces it) and allocates it."""
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            on_gpu = self.device.type == "cuda"
            budget = self.kv_budget_cuda() if on_gpu else self.kv_budget_cpu()
            num_blocks = int(budget // self.kv_bytes_per_block())
        if dist.is_initialized():  # one block table addresses every rank's pool
            count = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks < 1:
            raise ValueError(
                "not enough memory left for even one KV-cache block; lower "
                "max_num_batched_tokens or raise gpu_memory_utilization"
            )
        self.make_kv_cache(num_blocks)
        return num_blocks

    def make_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # free the old one first
        dtype = self.config.kv_cache_dtype
        self.kv_cache = new_kv_cache(
            self.model,
            num_blocks,
            self.block_size,
            dtype,
            self.device,
            self.backend.zeros,
        )

    def kv_budget_cpu(self) -> int:
        seqs, blocks = self.config.max_num_seqs, self.max_blocks_per_seq
        enough = seqs * blocks * self.kv_bytes_per_block()
        return min(int(available_memory() * CPU_KV_CACHE_FRACTION), enough)

    def kv_budget_cuda(self) -> int:
        """Free GPU memory after a forward of the largest prefill the scheduler can
        issue, and after sampling the largest decode batch: what is left of
        `gpu_memory_utilization`."""
        # the profiling forward writes and reads one block over and over
        self.make_kv_cache(1)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        config = self.config
        seq_len = min(config.max_num_batched_tokens, config.max_model_len)
        num_seqs = min(config.max_num_batched_tokens // seq_len, config.max_num_seqs)
        step = ScheduledStep()
        for _ in range(max(1, num_seqs)):  # every prompt in block 0
            seq = Sequence([0] * seq_len, SamplingOptions())
            seq.block_table = [0] * cdiv(seq_len, self.block_size)
            step.add(seq, seq_len)
        self.execute(self.prepare_inputs(step))
        rows = self.sampler.profile_rows(config.max_num_seqs)
        vocab_size = config.hf_config.vocab_size
        self.sampler(torch.randn(len(rows), vocab_size, device=self.device), rows)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        activations = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        return int(total * config.gpu_memory_utilization - (total - free) - activations)

    # ---- inputs ----

    def prepare_inputs(self, step: ScheduledStep) -> StepInputs:
        """The step's model inputs, as host arrays: all the host work of a step but
        scheduling. Each sequence runs its scheduled tokens, then its proposals."""
        block_size, proposals = self.block_size, step.proposals
        runs = enumerate(zip(step.seqs, step.starts, step.num_tokens))
        tokens = [
            seq.token_ids[start : start + n] + proposals.get(i, [])
            for i, (seq, start, n) in runs
        ]
        num_tokens = np.array([len(t) for t in tokens])
        cu_seqlens_q = np.cumsum([0, *num_tokens])
        # token t of sequence i sits at position starts[i] + t - cu_seqlens_q[i]
        seq_of_token = np.repeat(np.arange(len(tokens)), num_tokens)
        offsets = np.array(step.starts) - cu_seqlens_q[:-1]
        positions = np.arange(cu_seqlens_q[-1]) + offsets[seq_of_token]
        block_tables = self.block_tables(step.seqs)
        blocks = block_tables[seq_of_token, positions // block_size].astype(np.int64)
        context_lens = np.add(step.starts, num_tokens)
        # the rows whose logits are computed: each sampling sequence's last token and
        # its proposals, then the prompt tokens whose logits a sequence asks for
        counts = np.array(step.sample_counts, np.int64)
        firsts = np.repeat(cu_seqlens_q[1:][step.sampling_indices] - counts, counts)
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        prompts = [np.arange(n) + cu_seqlens_q[i] for i, n in step.prompt_logit_counts]
        ragged = step.ragged or bool(proposals)
        inputs = StepInputs(
            ragged=ragged,
            input_ids=np.fromiter(itertools.chain(*tokens), np.int64, len(positions)),
            positions=positions,
            slot_mapping=blocks * block_size + positions % block_size,
            context_lens=context_lens,
            block_tables=block_tables,
            logits_indices=np.concatenate([firsts + within, *prompts]).astype(np.int64),
            cu_seqlens_q=cu_seqlens_q if ragged else None,
            cu_seqlens_k=np.cumsum([0, *context_lens]) if ragged else None,
            max_seqlen_q=int(num_tokens.max()),
        )
        if self.extension is not None:
            inputs.extension = self.extension.prepare_inputs(step, inputs)
        return inputs

    def block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """(num_seqs, longest block table) int32, padded with -1."""
        lengths = np.array([len(seq.block_table) for seq in seqs])
        table = np.full((len(seqs), lengths.max()), -1, dtype=np.int32)
        entries = itertools.chain.from_iterable(seq.block_table for seq in seqs)
        in_use = np.arange(table.shape[1]) < lengths[:, None]
        table[in_use] = np.fromiter(entries, np.int32, lengths.sum())
        return table

    # ---- running ----

    @torch.inference_mode()
    def launch(self, step: ScheduledStep, pending: Pending | None = None) -> Launched:
        """Starts a step: its inputs are built and its random numbers drawn here, on
        the host; `compute` runs the model and samples, which on a GPU only queues the
        work. Seam: `pending` gives the input ids the host does not know yet (a
        sequence's `PENDING` tokens), taken from an earlier launched step's samples on
        the device (async scheduling)."""
        inputs = self.prepare_inputs(step)
        counts = step.sample_counts
        token_seqs = [s for s, n in zip(step.sampling_seqs, counts) for _ in range(n)]
        offsets = [j for n in counts for j in range(n)]
        uniform = self.sampler.draw(token_seqs, offsets) if token_seqs else None
        launched = Launched(step, inputs, token_seqs, uniform)
        self.compute(launched, pending)
        return launched

    def compute(self, launched: Launched, pending: Pending | None) -> None:
        """The device's part of a launch: the model run and the sampling, whose tokens
        (one per sampling sequence and proposal) stay on the device."""
        logits, hidden = self.execute(launched.inputs, pending)
        if launched.token_seqs:  # a token for each, at the position it would take
            seqs, uniform = launched.token_seqs, launched.uniform
            launched.tokens = self.sampler(logits[: len(seqs)], seqs, uniform)
            launched.tokens_on_host = launched.tokens
            # read back by a copy queued now: reading the tensor itself would also
            # wait for the steps queued after this one (async scheduling's)
            if self.device.type == "cuda":
                on_host = torch.empty_like(launched.tokens, device="cpu").pin_memory()
                launched.tokens_on_host = on_host.copy_(launched.tokens, True)
                launched.copied = torch.cuda.Event()
                launched.copied.record()
        launched.logits = logits
        launched.hidden = hidden

    def collect(self, launched: Launched) -> SamplerOutput:
        """Waits for a launched step and reads its tokens: a list per sampling sequence
        (one token, and one after each of its proposals); the hidden states if the step
        asks for them."""
        if launched.copied is not None:
            launched.copied.synchronize()
        step, on_host = launched.step, launched.tokens_on_host
        # in row order: each sampling sequence's token, then one after each proposal
        flat = iter([] if on_host is None else on_host.tolist())
        tokens = [list(itertools.islice(flat, n)) for n in step.sample_counts]
        hidden = launched.hidden if step.hidden_states else None
        return SamplerOutput(tokens, launched.logits, hidden)

    @torch.inference_mode()
    def execute(
        self, inputs: StepInputs, pending: Pending | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The model run over a step's inputs: the logits of the rows `logits_indices`
        picks (None when there are none), and every token's last hidden state."""
        if self.extension is not None:
            self.extension.before_forward(inputs)
        input_ids, positions, meta = self.device_inputs(inputs, pending)
        graphs = self.graphs
        if meta.ragged or graphs is None or len(input_ids) > graphs.max_batch:
            hidden = self.model(input_ids, positions, meta)
        else:  # a decode step the graphs hold
            hidden = graphs.replay(input_ids, positions, meta)
        if len(inputs.logits_indices) == 0:
            return None, hidden
        rows = hidden  # a decode step samples each of its rows, once
        if inputs.ragged:  # any other step picks the rows it samples
            rows = hidden[to_device(self.device, inputs.logits_indices, torch.int64)]
        return self.model.compute_logits(rows), hidden

    def device_inputs(
        self, inputs: StepInputs, pending: Pending | None = None
    ) -> tuple:
        """The model's arguments for a step's inputs: ids, positions, metadata."""
        device = self.device
        meta = AttentionMetadata(
            ragged=inputs.ragged,
            slot_mapping=to_device(device, inputs.slot_mapping, torch.int64),
            context_lens=to_device(device, inputs.context_lens, torch.int32),
            block_tables=to_device(device, inputs.block_tables, torch.int32),
            max_seqlen_k=int(inputs.context_lens.max()),
            cu_seqlens_q=to_device(device, inputs.cu_seqlens_q, torch.int32),
            cu_seqlens_k=to_device(device, inputs.cu_seqlens_k, torch.int32),
            max_seqlen_q=inputs.max_seqlen_q,
        )
        input_ids = to_device(device, inputs.input_ids, torch.int64)
        if pending is not None:  # on the device: no wait for the step that sampled them
            earlier = pending.launched.tokens[to_device(device, pending.token_indices)]
            input_ids[to_device(device, pending.input_rows)] = earlier
        return input_ids, to_device(device, inputs.positions, torch.int64), meta


def kv_block_bytes(model, block_size: int, dtype: torch.dtype) -> int:
    """The bytes of one KV-cache block of `model`, in all its layers."""
    return math.prod(model.kv_cache_shape(1, block_size)) * dtype.itemsize


def new_kv_cache(
    model, num_blocks: int, block_size: int, dtype: torch.dtype, device, zeros
) -> torch.Tensor:
    """A KV cache of `num_blocks` blocks for `model` on `device`, allocated by `zeros`
    (its backend's), bound to the model's layers."""
    kv_cache = zeros(
        model.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device
    )
    model.bind_kv_cache(kv_cache)
    return kv_cache


def available_memory() -> int:
    """The bytes of RAM available to a new allocation (Linux's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError):  # not Linux: a guess
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
