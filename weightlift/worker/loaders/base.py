"""The one interface every loading strategy implements (Preload, Direct, PeerToPeer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from weightlift.worker.weights.progress import LoadProgress

if TYPE_CHECKING:
    import torch

    from weightlift.api.worker import WorkerPlan


class Loader(Protocol):
    """A strategy that puts one rank's weights on its device."""

    name: str

    def load(
        self, plan: WorkerPlan, rank: int, device: torch.device, progress: LoadProgress
    ) -> dict[str, torch.Tensor]:
        """Return every tensor of rank `rank`'s shard on `device`, or raise LoadError."""
        ...
