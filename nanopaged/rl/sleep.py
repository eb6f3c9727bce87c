"""Sleep mode on one rank (vLLM's): the engine gives back the memory of its KV cache
and, at level 2, of its weights, so that a trainer can use it between two rounds of
rollouts.

- `sleep(1)` keeps the weights (on a GPU, copied to host memory first) and frees the KV
  cache; `sleep(2)` frees both, and new weights come back by an update.
- `wake_up(tags)` brings back what `tags` names, "weights" and "kv_cache" (None: both).

On a GPU a tensor's memory goes back to the device (its storage shrunk to nothing, then
the allocator's cache emptied) and comes back at another address: the decode graphs are
captured again. On a CPU the weights already lie in host memory, and a tensor's pages
are given back to the system in place (`madvise(MADV_DONTNEED)`): the process's resident
memory shrinks, the addresses stay (so do the CPU's step graphs), and a page given back
reads as zeros once touched again. Either way nothing computed before sleeping is kept:
the KV cache's contents are gone (the engine forgets its prefix cache), and so are the
weights after `sleep(2)`.
"""

import ctypes
import ctypes.util
import mmap
import sys

import torch
from torch import nn

# Linux's madvise advice that drops a private anonymous page (zeros when read again)
MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE


def give_back_pages(tensor: torch.Tensor) -> None:
    """Returns the whole pages under a CPU tensor's storage to the system, in place
    (Linux; elsewhere nothing happens): they read as zeros afterwards."""
    if not sys.platform.startswith("linux"):
        return
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE  # whole pages only
    if last > first:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise(first, last - first, MADV_DONTNEED)


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """One tensor per storage of the model's weights: its parameters and what its
    layers' methods packed them into (a CPU's panels); not its buffers (a rotary table,
    which engines share)."""
    found, seen = [], set()
    for module in model.modules():
        held = list(module._parameters.values())
        held += [getattr(module, name, None) for name in ("panels", "packed_weight")]
        for tensor in held:
            if tensor is None or tensor.layout != torch.strided:  # oneDNN's own
                continue
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                found.append(tensor)
    return found


class Sleeper:
    """The sleep of one rank's runner: `asleep` holds what sleeps ("weights",
    "kv_cache")."""

    def __init__(self, runner):
        self.runner = runner
        self.asleep: set[str] = set()
        # each weight storage put to sleep: a tensor on it, its bytes, its host copy
        self.saved: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []

    def sleep(self, level: int) -> None:
        on_gpu = self.runner.device.type == "cuda"
        if level == 2 or on_gpu:  # on a CPU, level 1's weights stay in host memory
            for tensor in weight_tensors(self.runner.model):
                host = _storage_bytes(tensor)
                host = host.to("cpu", copy=True) if on_gpu and level == 1 else None
                self.saved.append((tensor, tensor.untyped_storage().nbytes(), host))
                _free(tensor)
            self.asleep.add("weights")
        cache = self.runner.kv_cache
        self.kv_bytes = cache.untyped_storage().nbytes()
        _free(cache)
        self.asleep.add("kv_cache")
        if on_gpu:
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags and "weights" in self.asleep:
            for tensor, nbytes, host in self.saved:
                data = _restore(tensor, nbytes)
                if host is not None:
                    data.copy_(host)
            self.saved = []
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            _restore(self.runner.kv_cache, self.kv_bytes)
            self.asleep.discard("kv_cache")
        graphs = self.runner.graphs
        on_gpu = self.runner.device.type == "cuda"
        if on_gpu and graphs is not None and not self.asleep:  # new addresses
            self.runner.graphs = type(graphs)(
                self.runner.model, self.runner.config, self.runner.max_blocks_per_seq
            )


def _free(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        tensor.untyped_storage().resize_(0)
    else:
        give_back_pages(tensor)


def _restore(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The storage under `tensor` back to `nbytes` (a GPU's, zeroed; a CPU's pages read
    as zeros already); returns it as bytes."""
    if tensor.device.type == "cuda":
        tensor.untyped_storage().resize_(nbytes)
        return _storage_bytes(tensor).zero_()
    return _storage_bytes(tensor)


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor`, as bytes."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
