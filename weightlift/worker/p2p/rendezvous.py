"""Which source a target tries first: rendezvous (highest-random-weight) hashing.

Every target ranks the candidates by hash(target pod, candidate pod): different targets start at
different sources, so fan-out spreads, and when a source disappears only the targets that had it
first move, each to its own next choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from weightlift.api.worker import PeerCandidate


def rendezvous_order(target: str, candidates: Sequence[PeerCandidate]) -> list[PeerCandidate]:
    def weight(c: PeerCandidate) -> int:
        return xxhash.xxh3_64_intdigest(f"{target}\0{c.pod}\0{c.address}".encode())

    seen: set[tuple[str, str]] = set()
    unique = []
    for c in candidates:
        if (c.pod, c.address) not in seen:
            seen.add((c.pod, c.address))
            unique.append(c)
    return sorted(unique, key=weight, reverse=True)
