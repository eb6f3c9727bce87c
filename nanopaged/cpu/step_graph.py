"""Step graphs: the CPU's decode forward replayed as the C calls it made.

On a GPU, a CUDA graph replays a decode step's few hundred kernel launches as one
(`core/cuda_graphs.py`). A CPU has no such thing, and the same cost is there in another
form: a decode step of the CPU backend makes about sixty C calls, each through an
`nn.Module`, a Python wrapper and ctypes (7-20 us each). With one sequence, that Python
is a quarter of the step (docs/cpu.md).

A `StepGraph` is captured for one batch size by running the model's forward once over
static input buffers, and recording, in order, every C call the kernels make
(`kernels.run`: the function and its arguments) and every PyTorch operator that writes
memory (a `TorchDispatchMode`: the embedding's lookup, a bias added in place). A replay
makes the same calls again on the same buffers, so each reads what the one before it
wrote, as in the capture. The tensors the forward made on the way are not kept: their
bytes move into one arena that all graphs share, each at an offset where no tensor in
use at the same time lies (a tensor is in use from the first call that touches it to the
last), so a graph costs about one layer's activations, not the whole forward's.

A replay is right only if the forward does the same each step, which is also what a
CUDA graph needs: the core's decode forward reads no tensor's values in Python. The
capture checks what it can. An operator whose result's shape depends on the values
(`bincount`, `nonzero`), a value read back (`.item()`), random numbers, an operator
from outside PyTorch's `aten` (a collective) or one on an inference tensor (PyTorch
hides some of those from a dispatch mode) make that batch size run eagerly, and so does
a graph whose first replay does not give the capture's result bit for bit. A whole
model runs eagerly if it has a linear method the CPU backend does not define (LoRA's, a
quantization's: their Python may differ from step to step), or under tensor
parallelism.
"""

import bisect
import ctypes
import functools
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanopaged.core.attention import AttentionMetadata
from nanopaged.core.config import Config
from nanopaged.core.layers import tp_size
from nanopaged.cpu import kernels

aten = torch.ops.aten
# operators that only allocate: nothing to replay (the memory is the arena's)
ALLOCATIONS = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
# what a replay cannot repeat: a result shaped by values, a value read, a random draw
UNREPLAYABLE = {
    torch.Tag.dynamic_output_shape,
    torch.Tag.data_dependent_output,
    torch.Tag.nondeterministic_seeded,
}
ALIGN = 64  # bytes: each tensor's offset in the arena, for any dtype and vector load


class Ungraphable(Exception):
    """The forward did something a replay would not do again."""


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def tensors(tree) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results (lists, tuples, dicts)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in tensors(x)]
    return []


def mapped(f, tree):
    """`tree` with f(x) for each x that is not a list, a tuple or a dict."""
    if isinstance(tree, dict):
        return {key: mapped(f, x) for key, x in tree.items()}
    if isinstance(tree, (list, tuple)) and not isinstance(tree, Placed):
        return type(tree)(mapped(f, x) for x in tree)
    return f(tree)


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class Capture(TorchDispatchMode):
    """Records a forward: `steps` in order, each a C call `(kernel, args)` (appended by
    `kernels.run`) or an operator `(func, args, kwargs, made)`, `made` its results that
    are new tensors, by their index among its results. `made` maps each new tensor's
    storage to it, kept alive until the capture ends so that no address serves twice."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # else torch wraps `__torch_dispatch__` to keep its compiler out, importing
        # torch._dynamo (seconds) the first time; nothing here is compiled
        return False

    def __init__(self):
        super().__init__()
        self.steps: list[tuple] = []
        self.made: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten" or UNREPLAYABLE & set(func.tags):
            raise Ungraphable(str(func))
        if any(t.is_inference() for t in tensors((args, kwargs))):
            raise Ungraphable(f"{func} of an inference tensor: some would be hidden")
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        inputs = {storage_of(t) for t in tensors((args, kwargs))}
        made = []
        for index, t in enumerate(tensors(out)):
            if t.numel() and storage_of(t) not in inputs:
                self.made[storage_of(t)] = t
                made.append((index, t))
        if func not in ALLOCATIONS:
            self.steps.append((func, args, kwargs, made))
        return out


class Placed(NamedTuple):
    """A tensor the forward made, by its storage (its address at the capture), its
    first element's bytes from the storage's start, and its layout."""

    storage: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class StepGraph:
    """One batch size's forward as steps, C calls or operators, in which every tensor
    the forward made is named by its storage, and every storage by its place in an
    arena (`offsets`, in bytes): `bind` turns them into calls on any arena of at least
    `arena_bytes`, kept in `calls` with the arena's address and the thread count."""

    def __init__(self, capture: Capture, hidden: torch.Tensor):
        self.hidden = hidden  # the forward's result stays where it is: the caller's
        made = dict(capture.made)
        made.pop(storage_of(hidden), None)
        self.starts = sorted(made)
        self.sizes = {ptr: t.untyped_storage().nbytes() for ptr, t in made.items()}
        self.spans = self.lifetimes(capture.steps)
        self.offsets, self.arena_bytes = self.place(self.spans)
        self.steps = [self.placed(step) for step in capture.steps]
        self.calls: list = []  # `steps` bound to an arena's address and a thread count
        self.bound: tuple[int, int] | None = None

    def owner(self, address: int | None) -> int | None:
        """The storage of a made tensor that `address` lies in, if any."""
        i = bisect.bisect_right(self.starts, address or 0) - 1
        if i >= 0 and address < self.starts[i] + self.sizes[self.starts[i]]:
            return self.starts[i]
        return None

    def touched(self, step: tuple) -> set[int]:
        """The made storages a step reads or writes."""
        if len(step) == 2:  # a C call: its pointer arguments
            kernel, args = step
            pointers = [
                a for a, t in zip(args, kernel.argtypes) if t is ctypes.c_void_p
            ]
        else:
            pointers = [storage_of(t) for t in tensors(step[1:])]
        return {self.owner(p) for p in pointers} - {None}

    def lifetimes(self, steps: list[tuple]) -> dict[int, tuple[int, int]]:
        """Each made storage's first and last step."""
        spans = {}
        for i, step in enumerate(steps):
            for ptr in self.touched(step):
                spans[ptr] = (spans.get(ptr, (i, i))[0], i)
        return spans

    def place(self, spans: dict[int, tuple[int, int]]) -> tuple[dict[int, int], int]:
        """An offset for each storage, the largest first, at the lowest place that no
        storage in use at the same time occupies; and the bytes they all need."""
        offsets, end = {}, 0
        for ptr in sorted(spans, key=lambda p: -self.sizes[p]):
            first, last = spans[ptr]
            overlapping = sorted(
                (offsets[p], offsets[p] + self.sizes[p])
                for p in offsets
                if spans[p][0] <= last and first <= spans[p][1]
            )
            offset = 0
            for start, stop in overlapping:
                if offset + self.sizes[ptr] <= start:
                    break
                offset = max(offset, aligned(stop))
            offsets[ptr] = offset
            end = max(end, offset + aligned(self.sizes[ptr]))
        return offsets, end

    def placed(self, step: tuple) -> tuple:
        """A step whose made tensors are `Placed` (the capture's memory can go)."""
        if len(step) == 2:
            return step

        def place(x):
            if not isinstance(x, torch.Tensor) or self.owner(storage_of(x)) is None:
                return x
            offset = x.data_ptr() - storage_of(x)
            return Placed(storage_of(x), offset, x.dtype, x.shape, x.stride())

        func, args, kwargs, made = step
        return func, *mapped(place, (args, kwargs, made))

    def bind(self, arena: torch.Tensor, threads: int) -> list:
        """The steps as calls on `arena` (bytes), the C kernels on `threads`."""
        base, storage = arena.data_ptr(), arena.untyped_storage()

        def address(a: int | None) -> int | None:
            ptr = self.owner(a)
            return a if ptr is None else base + self.offsets[ptr] + a - ptr

        def tensor(x):
            if not isinstance(x, Placed):
                return x
            offset = (self.offsets[x.storage] + x.offset) // x.dtype.itemsize
            view = torch.empty(0, dtype=x.dtype)
            return view.set_(storage, offset, x.shape, x.stride)

        calls = []
        for step in self.steps:
            if len(step) == 2:
                kernel, args = step
                types = kernel.argtypes
                args = [
                    address(a) if t is ctypes.c_void_p else a
                    for a, t in zip(args, types)
                ]
                calls.append(functools.partial(kernel, *args[:-1], threads))
            else:
                func, args, kwargs, made = mapped(tensor, step)
                calls.append(functools.partial(run_operator, func, args, kwargs, made))
        return calls


def run_operator(func, args, kwargs, made: list[tuple[int, torch.Tensor]]) -> None:
    """func(*args, **kwargs), its new results copied where the capture's lay (`made`:
    each one's index among the results, and its place)."""
    results = tensors(func(*args, **kwargs))
    for index, place in made:
        place.copy_(results[index])


class StepGraphs:
    """The CPU backend's decode graphs (the runner's `graphs`, as `DecodeGraphs` on a
    GPU): a `StepGraph` per batch size of `sizes`, captured the first time a batch
    needs it, over static buffers of `max_num_seqs` rows, all bound to one arena. A
    batch replays the next larger size's graph, its padding rows writing no slot and
    attending to nothing; sizes are 8 apart above 8, so a run meets a few of them (each
    capture costs a few steps) and pads a few rows (each costs a row's arithmetic).
    `max_batch` is 0 (no graphs) for a model whose linear methods are not all
    `methods`, or under tensor parallelism."""

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        max_blocks_per_seq: int,
        methods: tuple[type, ...],
    ):
        self.model = model
        plain = all(
            type(getattr(m, "method", None)) in (*methods, type(None))
            for m in model.modules()
        )
        size = config.max_num_seqs
        self.sizes = [s for s in (1, 2, 4, *range(8, size, 8)) if s < size] + [size]
        self.max_batch = size if plain and tp_size() == 1 else 0
        self.input_ids = torch.zeros(size, dtype=torch.int64)
        self.positions = torch.zeros(size, dtype=torch.int64)
        self.meta = AttentionMetadata(
            ragged=False,
            slot_mapping=torch.full((size,), -1, dtype=torch.int64),
            context_lens=torch.zeros(size, dtype=torch.int32),
            block_tables=torch.zeros((size, max_blocks_per_seq), dtype=torch.int32),
            max_seqlen_k=config.max_model_len,
        )
        self.graphs: dict[int, StepGraph | None] = {}  # None: that size runs eagerly
        self.arena = torch.empty(0, dtype=torch.uint8)

    def inputs(self, size: int) -> tuple:
        """The model's arguments for a batch of `size`: the buffers' first rows."""
        meta = self.meta
        rows = (meta.slot_mapping, meta.context_lens, meta.block_tables)
        meta = AttentionMetadata(False, *(r[:size] for r in rows), meta.max_seqlen_k)
        return self.input_ids[:size], self.positions[:size], meta

    def capture(self, size: int, n: int) -> StepGraph | None:
        """The graph of a batch of `size`, or None where the forward does what a replay
        cannot. It is captured outside inference mode, in which PyTorch hides some
        operators (`.to`, `.contiguous`) from a dispatch mode, and kept only if its
        first replay gives the capture's result bit for bit in the `n` rows that are
        not padding. Both compute the step in the buffers, as a replay does."""
        capture = Capture()
        recording = kernels.CAPTURE.set(capture.steps)
        try:
            with torch.inference_mode(False), torch.no_grad(), capture:
                hidden = self.model(*self.inputs(size))
        except Ungraphable:
            return None
        finally:
            kernels.CAPTURE.reset(recording)
        graph, expected = StepGraph(capture, hidden), hidden[:n].clone()
        self.run(graph)
        return graph if torch.equal(graph.hidden[:n], expected) else None

    def run(self, graph: StepGraph) -> None:
        """Replays `graph`, bound to the arena (grown if it needs more) and to the
        threads the kernels run on now."""
        if graph.arena_bytes > len(self.arena):
            self.arena = torch.empty(graph.arena_bytes, dtype=torch.uint8)
        bound = (self.arena.data_ptr(), kernels.threads())
        if graph.bound != bound:
            graph.calls, graph.bound = graph.bind(self.arena, bound[1]), bound
        for call in graph.calls:
            call()

    def replay(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a decode batch of at most `max_batch` sequences."""
        n = len(input_ids)
        size = next(size for size in self.sizes if size >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.meta.slot_mapping[:n] = meta.slot_mapping
        self.meta.slot_mapping[n:size] = -1
        self.meta.context_lens[:n] = meta.context_lens
        self.meta.context_lens[n:size] = 0
        self.meta.block_tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        if size not in self.graphs:
            self.graphs[size] = self.capture(size, n)
        graph = self.graphs[size]
        if graph is None:
            return self.model(input_ids, positions, meta)
        self.run(graph)
        return graph.hidden[:n]
