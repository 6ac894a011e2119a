"""The bounded sample of rows a capture keeps per layer (or per runtime node): a third the smallest
q (where a wrong eps shows: padding, the first layers, q/k norms), a third the largest, the rest a
uniform reservoir of everything seen. Memory is K rows whatever the number of tokens. Rows may be
torch tensors or numpy arrays: `copy(row)` keeps each as its own copy (a kept view would hold the
call's whole activation). Used by `parity capture` (transformers) and inside the llama.cpp child,
which imports no torch."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field


def split(rows_per_layer: int) -> tuple[int, int, int]:
    """(smallest, largest, uniform) counts of a sample of rows_per_layer rows."""
    k = rows_per_layer // 3
    return k, k, rows_per_layer - 2 * k


def describe(rows_per_layer: int) -> str:
    small, large, uniform = split(rows_per_layer)
    return f"{small} smallest q, {large} largest q, {uniform} uniform"


@dataclass
class RowSample:
    k_small: int
    k_large: int
    k_uniform: int
    rng: random.Random
    copy: Callable = field(default=lambda row: row.copy())
    small: list = field(default_factory=list)  # max-heap by q: (-q, n, row)
    large: list = field(default_factory=list)  # min-heap by q: (q, n, row)
    uniform: list = field(default_factory=list)
    seen: int = 0

    @classmethod
    def of(cls, rows_per_layer: int, rng: random.Random, copy: Callable | None = None) -> RowSample:
        return cls(*split(rows_per_layer), rng, **({"copy": copy} if copy else {}))

    def add(self, rows, q) -> None:
        """Rows of one call and their q (any sequence of floats)."""
        for k, qv in enumerate(q.tolist() if hasattr(q, "tolist") else q):
            self.seen += 1
            n = self.seen
            row = self.copy(rows[k])
            if self.k_small:
                if len(self.small) < self.k_small:
                    heapq.heappush(self.small, (-qv, n, row))
                elif -self.small[0][0] > qv:
                    heapq.heapreplace(self.small, (-qv, n, row))
            if self.k_large:
                if len(self.large) < self.k_large:
                    heapq.heappush(self.large, (qv, n, row))
                elif self.large[0][0] < qv:
                    heapq.heapreplace(self.large, (qv, n, row))
            if self.k_uniform:  # reservoir sampling (algorithm R)
                if len(self.uniform) < self.k_uniform:
                    self.uniform.append((qv, n, row))
                else:
                    j = self.rng.randrange(n)
                    if j < self.k_uniform:
                        self.uniform[j] = (qv, n, row)

    def kept(self) -> list:
        """The kept rows, each once (a row can be both small and in the reservoir), by q."""
        found = {}
        for entry in [(-a, n, r) for a, n, r in self.small] + self.large + self.uniform:
            found[entry[1]] = entry
        return [e[2] for e in sorted(found.values(), key=lambda e: e[0])]
