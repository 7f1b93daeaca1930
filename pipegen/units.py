"""Units of work and compact sets of them.

A unit is (index, sample): the dataset row's `index` and the sample number 0..n-1. Internally a unit is
one integer key, `index * n + sample`, so sets of units compress into sorted ranges.

Owns: the key encoding, the range set used by the checkpoint, and the derived per-unit seed and uid.
Must never: touch files or know about processes.
"""

from __future__ import annotations

import bisect
import hashlib
import uuid
from dataclasses import dataclass
from typing import Iterable, Iterator


@dataclass(frozen=True, order=True)
class Unit:
    index: int
    sample: int


def unit_seed(base_seed: int, index: int, sample: int) -> int:
    """A distinct, reproducible sampling seed per unit (fits SGLang's int sampling_seed)."""
    digest = hashlib.blake2b(f"{base_seed}:{index}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def prompt_uid(run_key: str, index: int) -> str:
    """verl gives the n samples of one prompt one shared uid; pipegen derives it so reruns match."""
    return str(uuid.uuid5(uuid.NAMESPACE_OID, f"{run_key}:{index}"))


class RangeSet:
    """A set of non-negative ints stored as sorted, disjoint, non-adjacent half-open ranges.

    Hand-written because no well-kept library offers a small, JSON-friendly interval set; adds are
    O(log r + r) in the number of ranges r, which stays tiny when work completes roughly in order.
    """

    def __init__(self, ranges: Iterable[Iterable[int]] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self.add_range(int(start), int(end))

    def __contains__(self, key: int) -> bool:
        i = bisect.bisect_right(self._starts, key) - 1
        return i >= 0 and key < self._ends[i]

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def __iter__(self) -> Iterator[int]:
        for s, e in zip(self._starts, self._ends):
            yield from range(s, e)

    def add(self, key: int) -> None:
        self.add_range(key, key + 1)

    def add_range(self, start: int, end: int) -> None:
        if end <= start:
            return
        lo = bisect.bisect_left(self._ends, start)  # first range that ends at/after start (touching merges)
        hi = bisect.bisect_right(self._starts, end)  # ranges starting at/before end touch or overlap
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def ranges(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self._starts, self._ends)]

    @property
    def num_ranges(self) -> int:
        return len(self._starts)
