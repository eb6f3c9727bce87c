"""Requests with adapters, above the core: each request's adapter checked when it is
added, its sequences marked with it, and at most `max_loras` adapters among the
sequences the core engine holds, so that every step's adapters fit the device slots. A
request whose adapter would be one too many waits here, in order, until an adapter in
the engine has no sequence left."""

from collections.abc import Callable

import xxhash

from nanopaged.core.llm_engine import LLMEngineCore
from nanopaged.lora.request import LoRARequest
from nanopaged.lora.runner import LoRAExtension, adapter_key
from nanopaged.outputs import Request


def cache_salt(request: LoRARequest, generation: int = 0) -> int:
    """The start of the hash chain of the blocks an adapter computes (see BlockManager);
    an adapter removed and added again starts a new generation (its files may have
    changed)."""
    return xxhash.xxh64(
        repr(("lora", *adapter_key(request), generation)).encode()
    ).intdigest()


def folded(salt: int, own: int | None) -> int:
    """The salt of a sequence with an adapter's `salt` and its prompt's own
    `cache_salt` (`own`, None: none)."""
    if own is None:
        return salt
    return xxhash.xxh64(repr((salt, own)).encode()).intdigest()


class LoRAAdmission:
    """The LoRA part of an engine's requests (see the module's docstring)."""

    def __init__(self, extension: LoRAExtension, max_loras: int):
        self.extension = extension
        self.max_loras = max_loras
        self.held: list[Request] = []

    def add(self, lora_request: LoRARequest) -> None:
        """Reads and checks the adapter now (a ValueError names what is wrong with
        it)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest or None, got "
                f"{type(lora_request).__name__}"
            )
        self.extension.check(lora_request)

    def remove(self, lora_id: int) -> bool:
        """Forgets the adapters of id `lora_id`: their copies and their cached blocks (a
        later request reads the adapter again). Whether there was one."""
        keys = [
            key
            for key in {*self.extension.staged, *self.extension.slots}
            if key is not None and key[1] == lora_id
        ]
        for key in keys:
            self.extension.forget(key)
        return bool(keys)

    def ids(self) -> set[int]:
        """The ids of the adapters read and kept (on the host or in a slot)."""
        return {
            key[1]
            for key in {*self.extension.staged, *self.extension.slots}
            if key is not None
        }

    def prepare(self, request: Request, lora_request: LoRARequest) -> None:
        """Checks the adapter (a ValueError names what is wrong) and marks the
        sequences."""
        self.add(lora_request)
        request.lora_request = lora_request
        key = adapter_key(lora_request)
        salt = cache_salt(lora_request, self.extension.generations.get(key, 0))
        for seq in request.seqs:
            seq.cache_salt = folded(salt, seq.cache_salt)
            self.extension.adapters[seq] = lora_request

    def admits(self, request: Request, engine: LLMEngineCore) -> bool:
        """Whether the engine may take `request` now (without exceeding `max_loras`)."""
        adapter = request.lora_request
        if adapter is None:
            return True
        present = self._adapters_in(engine)
        return adapter_key(adapter) in present or len(present) < self.max_loras

    def release(self, engine: LLMEngineCore, add: Callable[[Request], None]) -> None:
        """Hands the held requests the engine may take now to `add`, in order."""
        for request in list(self.held):
            if self.admits(request, engine):
                self.held.remove(request)
                add(request)

    def _adapters_in(self, engine: LLMEngineCore) -> set:
        adapters = self.extension.adapters
        return {
            adapter_key(adapters[seq]) for seq in engine.unfinished() if seq in adapters
        }
