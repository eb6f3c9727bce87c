"""LoRA on every rank, as the runner's extension: the projections' methods wrapped to
add each row's adapter delta (punica.py), `max_loras` device slots filled least recently
used first, and the slots of a step's rows sent with its inputs."""

import importlib.util
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanopaged.core.layers import LinearMethod, to_device
from nanopaged.core.model_runner import ModelRunner, RunnerExtension
from nanopaged.core.sequence import Sequence
from nanopaged.core.step import ScheduledStep, StepInputs
from nanopaged.lora.adapter import LoRAConfig, adaptable, empty_slot, stage
from nanopaged.lora.punica import lora_delta_torch, lora_delta_triton
from nanopaged.lora.request import LoRARequest


def adapter_key(request: LoRARequest) -> tuple[str, int, str]:
    """What names an adapter's weights: a name loaded again from another path is
    another."""
    return request.lora_name, request.lora_int_id, request.lora_path


class RowSlots:
    """The adapter slot of each row of the running step (-1: the base model), in a
    tensor that CUDA graphs read in place. `active`: whether any row has an adapter (on
    a GPU always: a graph captured without the delta could not add it)."""

    def __init__(self, capacity: int, device: torch.device):
        self.buffer = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.slots = self.buffer
        self.active = device.type == "cuda"

    def set(self, slots: np.ndarray) -> None:
        n = len(slots)
        # a longer (eager) step gets a buffer of its own: the graphs keep reading
        # `buffer`
        self.slots = self.buffer if n <= len(self.buffer) else self.buffer.new_empty(n)
        self.slots[n:].fill_(-1)  # a graph's padding rows
        self.slots[:n] = to_device(self.slots.device, slots, torch.int64)
        self.active = self.slots.is_cuda or bool((slots >= 0).any())


class LoRALinear(LinearMethod):
    """A projection's own method, then each row's delta from the stacked slots: `a` (L,
    P*R, in) and `b` (out, L, P*R) (see punica.py)."""

    def __init__(
        self, base: LinearMethod, a: torch.Tensor, b: torch.Tensor, rows: RowSlots
    ):
        self.base, self.a, self.b, self.rows = base, a, b, rows
        use_kernel = a.is_cuda and importlib.util.find_spec("triton") is not None
        self.delta = lora_delta_triton if use_kernel else lora_delta_torch

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, x)
        if self.rows.active:
            flat = x.reshape(-1, x.shape[-1])
            self.delta(
                y.view(-1, y.shape[-1]),
                flat,
                self.a,
                self.b,
                self.rows.slots[: flat.shape[0]],
            )
        return y


@dataclass
class LoRAInputs:
    """What a step tells every rank about adapters: each adapter its rows use, as
    (slot, request, generation), and each token's slot (-1: the base model)."""

    adapters: list[tuple[int, LoRARequest, int]]
    slots: np.ndarray


class LoRAExtension(RunnerExtension):
    """LoRA in each rank's runner (the runner's `extension`). Its projections are
    wrapped before the KV pool is sized (the slots take memory).

    On rank 0, `adapters` maps each sequence to its adapter, and `prepare_inputs` plans
    which slot holds each adapter a step uses: `slots` is that plan, as the steps
    launched so far leave the slots (a slot refilled least recently used first, never
    with one the step needs). The step's `LoRAInputs` carry the plan and each token's
    slot to every rank, where `before_forward` loads each adapter that its slot does not
    already hold (`loaded`: what the slots hold on this rank, now). So the plan is true
    when the step runs however late it runs (async scheduling plans step n+1 before n
    has loaded its adapters), and after a load that a failure cut short. An adapter is
    read, checked and staged by `check` on rank 0 when a request brings it (the
    `max_cpu_loras` most recent stay staged on the host); other ranks read their shards
    when told to load it."""

    def __init__(self, lora: LoRAConfig):
        self.lora_config = lora
        self.adapters: weakref.WeakKeyDictionary[Sequence, LoRARequest] = (
            weakref.WeakKeyDictionary()
        )
        # adapter key -> (its generation, its weights), read from its files
        self.staged: OrderedDict[tuple, tuple[int, dict]] = OrderedDict()
        # staged is used by the host (a request's check) and the device's thread
        self.staging = threading.Lock()
        self.generations: dict[tuple, int] = {}  # times each adapter was forgotten
        # the adapter each slot holds once the steps launched so far have run
        self.slots: list[tuple | None] = [None] * lora.max_loras
        self.last_used = [0] * lora.max_loras
        self.num_steps = 0
        # the adapter (key, generation) each slot holds on this rank now
        self.loaded: list[tuple | None] = [None] * lora.max_loras

    def prepare_model(self, runner: ModelRunner) -> None:
        """Wraps the model's projections: each adds its rows' adapter deltas."""
        config, lora = runner.config, self.lora_config
        self.model, self.dtype = runner.model, config.dtype
        capacity = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.rows = RowSlots(capacity, runner.device)
        self.layers: dict[str, LoRALinear] = {}
        for name, module in self.model.named_modules():
            if adaptable(module):
                parts = len(self.model.param_parts(name + ".weight"))
                a, b = empty_slot(
                    module, parts, lora.max_lora_rank, config.dtype, runner.device
                )
                a = a.unsqueeze(0).repeat(lora.max_loras, 1, 1)
                b = b.unsqueeze(1).repeat(1, lora.max_loras, 1)
                module.method = self.layers[name] = LoRALinear(
                    module.method, a, b, self.rows
                )

    def check(self, request: LoRARequest) -> None:
        """Reads and stages `request`'s adapter (a ValueError names what is wrong with
        it)."""
        self._staged(request, self.generations.get(adapter_key(request), 0))

    def forget(self, key: tuple) -> None:
        """Drops the staged and planned copies of the adapter `adapter_key` gave `key`
        (it is read again, a new generation, if asked for)."""
        with self.staging:
            self.staged.pop(key, None)
        self.generations[key] = self.generations.get(key, 0) + 1
        self.slots = [None if slot == key else slot for slot in self.slots]

    def _staged(self, request: LoRARequest, generation: int) -> dict:
        key = adapter_key(request)
        with self.staging:
            kept = self.staged.pop(key, None)
            if kept is None or kept[0] != generation:
                weights = stage(
                    request, self.model, self.lora_config.max_lora_rank, self.dtype
                )
                kept = generation, weights
            self.staged[key] = kept  # the most recent
            while len(self.staged) > self.lora_config.max_cpu_loras:
                self.staged.popitem(last=False)
            return kept[1]

    def prepare_inputs(self, step: ScheduledStep, inputs: StepInputs) -> LoRAInputs:
        wanted = [self.adapters.get(seq) for seq in step.seqs]
        needed = {adapter_key(r): r for r in wanted if r is not None}
        if len(needed) > len(self.slots):
            # the admission above must prevent it
            raise RuntimeError(
                f"a step with {len(needed)} adapters, over max_loras={len(self.slots)}"
            )
        slot_of = {key: i for i, key in enumerate(self.slots) if key in needed}
        # the free slots first, then the least recently used
        spare = sorted(
            (i for i in range(len(self.slots)) if i not in slot_of.values()),
            key=lambda i: (self.slots[i] is not None, self.last_used[i]),
        )
        for key in needed:
            if key not in slot_of:
                slot_of[key] = spare.pop(0)
                self.slots[slot_of[key]] = key
        self.num_steps += 1
        for slot in slot_of.values():
            self.last_used[slot] = self.num_steps
        used = [
            (slot_of[key], request, self.generations.get(key, 0))
            for key, request in needed.items()
        ]
        row_slots = [-1 if r is None else slot_of[adapter_key(r)] for r in wanted]
        counts = np.diff(inputs.cu_seqlens_q) if inputs.ragged else 1
        return LoRAInputs(used, np.repeat(np.array(row_slots, np.int64), counts))

    def before_forward(self, inputs: StepInputs) -> None:
        lora = inputs.extension
        # a step not prepared by a runner (the profiling forward): no adapter
        if lora is None:
            lora = LoRAInputs([], np.full(len(inputs.input_ids), -1, np.int64))
        for slot, request, generation in lora.adapters:
            if self.loaded[slot] != (adapter_key(request), generation):
                self._load(slot, request, generation)
        self.rows.set(lora.slots)

    def _load(self, slot: int, request: LoRARequest, generation: int) -> None:
        """Copies the adapter into `slot`; until it is all there, the slot holds no
        adapter."""
        self.loaded[slot] = None
        staged = self._staged(request, generation)
        for name, layer in self.layers.items():
            if name in staged:
                layer.a[slot].copy_(staged[name][0])
                layer.b[:, slot].copy_(staged[name][1])
            else:
                layer.a[slot].zero_()
                layer.b[:, slot].zero_()
        self.loaded[slot] = adapter_key(request), generation
