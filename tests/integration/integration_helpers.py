"""Small helpers shared by the integration tests (no mocks: kubectl is the real binary)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll until ``predicate()`` is truthy; return its value or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


class Kubectl:
    """Runs the real kubectl against one kubeconfig."""

    def __init__(self, binary: Path, kubeconfig: Path) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.binary), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}"
            )
        return proc
