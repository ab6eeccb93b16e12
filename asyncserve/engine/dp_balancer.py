"""Which data-parallel replica takes a request: the least outstanding tokens, except that
prompts opening with the same first KV block go to the replica that took the first of them
(its prefix cache holds that block) unless that replica is much more loaded."""

from __future__ import annotations

from collections import OrderedDict


class ReplicaBalancer:
    """Outstanding tokens per replica: a request costs its prompt plus its most output
    tokens from the moment it is sent until its last output comes back."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        affinity_slack_tokens: int = 4096,
        max_prefixes: int = 65536,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.block_size = block_size
        # The preferred replica may carry up to twice the least load plus this many tokens.
        self.affinity_slack_tokens = affinity_slack_tokens
        self.max_prefixes = max_prefixes
        self.load = [0] * num_replicas
        self.num_chosen = [0] * num_replicas  # requests sent to each replica so far
        self.alive = [True] * num_replicas
        self._owner: OrderedDict[int, int] = OrderedDict()  # first-block hash -> replica
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
        self._next = (best + 1) % size
        return best

    def choose(self, prompt_token_ids: list[int], cost: int) -> int:
        """The replica for a request of `cost` tokens; its load grows by `cost`."""
        least = self._least_loaded()
        chosen = least
        if len(prompt_token_ids) >= self.block_size:
            key = hash(tuple(prompt_token_ids[: self.block_size]))
            owner = self._owner.get(key)
            if owner is None or not self.alive[owner]:
                self._owner[key] = least
                if len(self._owner) > self.max_prefixes:
                    self._owner.popitem(last=False)
            else:
                self._owner.move_to_end(key)
                limit = 2 * self.load[least] + self.affinity_slack_tokens
                if self.load[owner] + cost <= limit:
                    chosen = owner
        self.load[chosen] += cost
        self.num_chosen[chosen] += 1
        return chosen

    def release(self, index: int, cost: int) -> None:
        """A request on `index` has finished (or failed)."""
        self.load[index] = max(0, self.load[index] - cost)

    def mark_dead(self, index: int) -> None:
        self.alive[index] = False
        self.load[index] = 0
