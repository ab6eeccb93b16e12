"""Which data-parallel replica takes a request: the least outstanding tokens, except that a
prompt sharing a prefix of whole KV blocks with an earlier one goes to the replica that took
that one (its prefix cache holds those blocks) while the extra load there stays within what
the cache hit saves.

Prefixes are keyed by chained hashes of the prompt's first blocks (as the prefix cache keys
its blocks), so a common preamble of one block earns little affinity and a long shared
conversation history a lot. The chain starts from the request's adapter, and a request with
an adapter and no owned prefix goes to the replica that last ran that adapter (its weights
are in that replica's slot cache) while it carries at most lora_affinity_tokens more.
A block that holds image placeholders hashes with those images' hashes (`extra_keys`, as the
prefix cache keys it), so only a prompt with the same images there shares it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

# (start, end) token positions of a block -> the hashes of the images it holds.
ExtraKeys = Callable[[int, int], tuple[int, ...]]


class ReplicaBalancer:
    """Outstanding tokens per replica: a request costs its prompt plus its most output
    tokens from the moment it is sent until its last output comes back."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        affinity_per_token: float = 2.0,
        max_blocks: int = 64,
        max_prefixes: int = 1 << 18,
        lora_affinity_tokens: int = 512,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.block_size = block_size
        # The owner of a shared prefix of P tokens keeps the request while it carries at
        # most affinity_per_token x P tokens more than the least loaded replica.
        self.affinity_per_token = affinity_per_token
        self.max_blocks = max_blocks  # longest prefix (in blocks) looked up
        self.max_prefixes = max_prefixes
        self.load = [0] * num_replicas
        self.num_chosen = [0] * num_replicas  # requests sent to each replica so far
        self.alive = [True] * num_replicas
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica
        self.lora_affinity_tokens = lora_affinity_tokens
        self._lora_owner: dict[int, int] = {}  # adapter id -> replica that last ran it
        self._next = 0  # ties go round the replicas, not always to the first

    def _least_loaded(self) -> int:
        size = len(self.load)
        best = -1
        for step in range(size):
            index = (self._next + step) % size
            if self.alive[index] and (best < 0 or self.load[index] < self.load[best]):
                best = index
        if best < 0:
            raise RuntimeError("no data-parallel replica is alive")
        return best

    def _prefix_hashes(
        self, prompt_token_ids: list[int], lora_int_id: int = 0, extra_keys: ExtraKeys | None = None
    ) -> list[int]:
        """One chained hash per whole block of the prompt's first max_blocks blocks; the
        chain starts from the adapter (the prefix cache shares no KV across adapters)."""
        size = self.block_size
        blocks = min(len(prompt_token_ids) // size, self.max_blocks)
        hashes = []
        h = hash(("lora", lora_int_id)) if lora_int_id else 0
        for i in range(blocks):
            start, end = i * size, (i + 1) * size
            tokens = tuple(prompt_token_ids[start:end])
            keys = extra_keys(start, end) if extra_keys is not None else ()
            h = hash((h, tokens, keys)) if keys else hash((h, tokens))
            hashes.append(h)
        return hashes

    def choose(
        self,
        prompt_token_ids: list[int],
        cost: int,
        lora_int_id: int = 0,
        extra_keys: ExtraKeys | None = None,
    ) -> int:
        """The replica for a request of `cost` tokens (with adapter `lora_int_id`, 0 for
        none; `extra_keys`: the image hashes of a block, for prompts with images); its load
        grows by `cost`."""
        least = self._least_loaded()
        chosen = least
        hashes = self._prefix_hashes(prompt_token_ids, lora_int_id, extra_keys)
        for blocks in range(len(hashes), 0, -1):  # the longest owned prefix decides
            owner = self._owner.get(hashes[blocks - 1])
            if owner is None or not self.alive[owner]:
                continue
            shared = blocks * self.block_size
            if self.load[owner] + cost - self.load[least] <= self.affinity_per_token * shared:
                chosen = owner
            break
        else:
            # No shared prefix: the replica that last ran the adapter holds its weights in
            # its slot cache; it keeps the adapter while within lora_affinity_tokens.
            owner = self._lora_owner.get(lora_int_id, -1) if lora_int_id else -1
            if (
                owner >= 0
                and self.alive[owner]
                and self.load[owner] + cost - self.load[least] <= self.lora_affinity_tokens
            ):
                chosen = owner
        if lora_int_id:
            self._lora_owner[lora_int_id] = chosen
        if chosen == least:
            self._next = (least + 1) % len(self.load)
        for h in hashes:
            owner = self._owner.get(h)
            if owner is None or not self.alive[owner]:
                self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_prefixes:
            self._owner.popitem(last=False)
        self.load[chosen] += cost
        self.num_chosen[chosen] += 1
        return chosen

    def release(self, index: int, cost: int) -> None:
        """A request on `index` has finished (or failed)."""
        self.load[index] = max(0, self.load[index] - cost)

    def mark_dead(self, index: int) -> None:
        self.alive[index] = False
        self.load[index] = 0
