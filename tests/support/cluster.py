"""Small helpers shared by the integration tests (no mocks: kubectl is the real binary)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from weightlift.local.cluster import tool_path

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


CHART_NAMESPACE = "weightlift-system"
RELEASE = "wl"
OPERATOR_NAMESPACE = "wl-operator-test"  # where the operator tests' ModelDeployments live


@dataclass(frozen=True)
class ChartRbac:
    namespace: str
    operator_sa: str
    docs: list[dict[str, Any]]

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.operator_sa}"


def render_chart(*extra: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [
            str(tool_path("helm")), "template", RELEASE, str(REPO / "helm" / "weightlift"),
            "--namespace", CHART_NAMESPACE, *extra,
        ],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


class OperatorProcess:
    """`weightlift operator --namespace NS` as a subprocess (its own session, bounded)."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        # The integration tests' models are file:///models/<name> (never read: kwok nodes).
        argv = [
            sys.executable,
            "-m",
            "weightlift",
            "operator",
            "-n",
            self.namespace,
            "--model-path-prefix",
            "/models",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
