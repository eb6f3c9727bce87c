"""The server's front for several data-parallel replicas: which replica a request goes
to."""

from collections import OrderedDict

from nanopaged.core.block_manager import hash_block
from nanopaged.engine.data_parallel import DataParallelLLM
from nanopaged.inputs import salted
from nanopaged.lora.admission import cache_salt, folded

MAX_REMEMBERED_BLOCKS = 100_000  # per replica


def prefix_hashes(
    token_ids: list[int], block_size: int, salt: int | None = None
) -> list[int]:
    """The hash of each full block of `token_ids`, each chained to the one before it
    (the first to `salt`, a sequence's `cache_salt`): what the prefix cache calls these
    blocks once they are computed."""
    hashes, parent = [], salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


class Router:
    """The server's front for several replicas, each stepped by an engine loop of its
    own (as `EngineLoop` it submits, aborts and counts the waiting requests). A request
    goes to the replica that was sent the longest prefix of its prompt before, in whole
    KV blocks (whose prefix cache then likely holds that prefix's K/V), unless that
    replica has more than `balance` requests in flight beyond the least busy one's; else
    to the least busy one. `policy="least"` always takes the least busy. `routed[i]`
    counts the requests replica i got, by reason."""

    def __init__(
        self,
        llm: DataParallelLLM,
        loops: list,
        max_waiting: int,
        policy: str = "prefix",
        balance: int = 4,
    ):
        self.llm, self.loops, self.policy, self.balance = llm, loops, policy, balance
        self.max_waiting, self.num_waiting = max_waiting, 0
        self.block_size = llm.config.kvcache_block_size
        # per replica: the hashes of the block prefixes it was sent, least recently sent
        # first
        self.prefixes = [OrderedDict() for _ in loops]
        self.routed = [{"prefix": 0, "least_busy": 0} for _ in loops]

    def submit(self, request_id: str, prompt: dict, params, outbox, lora_request=None):
        salt = salted(prompt)  # as the engine chains this prompt's blocks
        if lora_request is not None:
            salt = folded(cache_salt(lora_request), salt)
        hashes = prefix_hashes(prompt["prompt_token_ids"], self.block_size, salt)
        index, reason = self.choose(hashes)
        prefixes = self.prefixes[index]
        for h in hashes:
            prefixes[h] = None
            prefixes.move_to_end(h)
        while len(prefixes) > MAX_REMEMBERED_BLOCKS:
            prefixes.popitem(last=False)
        self.routed[index][reason] += 1
        return self.loops[index].submit(
            request_id, prompt, params, outbox, lora_request
        )

    def choose(self, hashes: list[int]) -> tuple[int, str]:
        """Among the replicas whose engine loop runs (a dead replica's stops)."""
        loads = [len(loop.outboxes) for loop in self.loops]
        alive = [i for i, loop in enumerate(self.loops) if loop.is_alive()] or [0]
        least = min(alive, key=loads.__getitem__)
        if self.policy == "prefix":
            matched = [
                next(
                    (n for n, h in enumerate(hashes) if h not in prefixes), len(hashes)
                )
                for prefixes in self.prefixes
            ]
            best = max(alive, key=lambda i: (matched[i], -loads[i]))
            if matched[best] and loads[best] <= loads[least] + self.balance:
                return best, "prefix"
        return least, "least_busy"

    def abort(self, request_id: str) -> None:
        for loop in self.loops:  # a request id unknown to a replica is ignored there
            loop.abort(request_id)

    def fail_all(self, reason: str) -> None:
        for loop in self.loops:
            loop.fail_all(reason)

    def stop(self) -> None:
        for loop in self.loops:
            loop.stop()

    def is_alive(self) -> bool:
        return all(loop.is_alive() for loop in self.loops)
