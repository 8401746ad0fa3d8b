"""The chart installed for real: `helm install helm/weightlift` into the local control plane.

The operator then runs as the chart's Deployment's pods on the process node (each a `weightlift
operator` process started with the pod's command, args and env), under the chart's
ServiceAccount: its token and the cluster CA at /var/run/secrets/kubernetes.io/serviceaccount
(podidentity.py), no kubeconfig. Of its replicas (two by default) the one holding the chart's
Lease reconciles: that is "the operator pod" here. Helm itself runs with the admin kubeconfig,
as an admin's would.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from weightlift.local.cluster import tool_path
from weightlift.local.kube import JSON, Kube, call, get_or_none

CHART = Path(__file__).resolve().parents[2] / "helm" / "weightlift"
OPERATOR_CONTAINER = "operator"


class ReleaseError(RuntimeError):
    """helm failed, or the operator pod did not come up; the message says which and why."""


@dataclass
class HelmRelease:
    """One release of the chart. `values` are the chart's values (see values.yaml)."""

    kubeconfig: Path
    name: str = "weightlift"
    namespace: str = "weightlift"
    values: dict[str, Any] = field(default_factory=dict)
    chart: Path = CHART
    timeout: float = 120.0
    # The admin's client (reads only: the release's pods and Deployment), under its own name in
    # the API server's audit log, apart from the operator's clients.
    kube: Kube = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.kube = Kube(self.kubeconfig, "helm-release")

    def close(self) -> None:
        self.kube.close()

    @property
    def fullname(self) -> str:
        """The chart's `weightlift.fullname`: the operator's Deployment and ServiceAccount."""
        return f"{self.name}-operator"[:63].rstrip("-")

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/name=weightlift,app.kubernetes.io/instance={self.name}"

    def helm(self, *args: str, values: dict[str, Any] | None = None) -> str:
        """Run helm with the admin kubeconfig; `values` go in as a values file (stdin)."""
        argv = [str(tool_path("helm")), *args, "--kubeconfig", str(self.kubeconfig)]
        stdin = None
        if values is not None:
            argv += ["--values", "-"]
            stdin = yaml.safe_dump(values)
        res = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=self.timeout + 30
        )
        if res.returncode != 0:
            raise ReleaseError(f"helm {args[0]} {self.name} failed: {res.stderr.strip()}")
        return res.stdout

    def install(self, wait_for: str | None = None) -> JSON:
        """`helm install` (the release's namespace created), then wait until the operator pods
        run; returns the leader's. `wait_for`: a pod name the new pods must differ from."""
        self.helm(
            "install",
            self.name,
            str(self.chart),
            "--namespace",
            self.namespace,
            "--create-namespace",
            values=self.values,
        )
        return self.wait_operator(replacing=(wait_for,) if wait_for else ())

    def upgrade(
        self, values: dict[str, Any], chart: Path | None = None, flags: tuple[str, ...] = ()
    ) -> JSON:
        """`helm upgrade` with these values (the chart's defaults beneath them) and this chart
        (default: the release's); waits for the operator pods the new revision rolls out (none
        of the old ones left), or, when the pod template did not change (RBAC only), for the pods
        that run; returns the leader's. `flags`: more of helm's (e.g. --take-ownership)."""
        before = {p["metadata"]["name"] for p in self.operator_pods()}
        generation = self.deployment_generation()
        self.values = values
        chart_dir = str(chart or self.chart)
        self.helm(
            "upgrade", self.name, chart_dir, "--namespace", self.namespace, *flags, values=values
        )
        return self._wait_rolled(before, generation)

    def rollback(self, revision: int | None = None) -> JSON:
        """`helm rollback` to `revision` (default: the one before); waits as `upgrade` does.
        `values` stay what they were: the caller knows what the revision held."""
        before = {p["metadata"]["name"] for p in self.operator_pods()}
        generation = self.deployment_generation()
        to = [str(revision)] if revision is not None else []
        self.helm("rollback", self.name, *to, "--namespace", self.namespace)
        return self._wait_rolled(before, generation)

    def _wait_rolled(self, before: set[str], generation: int) -> JSON:
        if not before or self.deployment_generation() == generation:
            return self.wait_operator()
        return self.wait_operator(replacing=before)

    def deployment_generation(self) -> int:
        read = client.AppsV1Api(self.kube.api).read_namespaced_deployment
        deployment = get_or_none(read, self.fullname, self.namespace)
        return int((deployment or {}).get("metadata", {}).get("generation") or 0)

    def uninstall(self) -> None:
        self.helm("uninstall", self.name, "--namespace", self.namespace, "--wait")

    def status(self) -> JSON:
        out: JSON = json.loads(
            self.helm("status", self.name, "--namespace", self.namespace, "-o", "json")
        )
        return out

    # -- the operator pod
    def operator_pods(self) -> list[JSON]:
        listing = call(
            self.kube.core.list_namespaced_pod, self.namespace, label_selector=self.selector
        )
        pods: list[JSON] = listing["items"]
        return pods

    def live_operator_pods(self) -> list[JSON]:
        """The release's operator pods not being deleted."""
        return [p for p in self.operator_pods() if not p["metadata"].get("deletionTimestamp")]

    def operator_pod(self) -> JSON | None:
        """The live operator pod that holds the Lease (the one reconciling); without leader
        election, or while nobody holds it, the first live one; None when there is none."""
        live = self.live_operator_pods()
        holder = self.lease_holder()
        return next((p for p in live if p["metadata"]["name"] == holder), live[0] if live else None)

    @property
    def leader_election(self) -> bool:
        return bool((self.values.get("leaderElection") or {}).get("enabled", True))

    @property
    def lease_name(self) -> str:
        return str((self.values.get("leaderElection") or {}).get("leaseName") or self.fullname)

    def lease_holder(self) -> str | None:
        """The chart's Lease's holderIdentity (a pod name), if leader election is on."""
        if not self.leader_election:
            return None
        read = client.CoordinationV1Api(self.kube.api).read_namespaced_lease
        lease = get_or_none(read, self.lease_name, self.namespace)
        return ((lease or {}).get("spec") or {}).get("holderIdentity") or None

    def wait_operator(self, replacing: Collection[str] = ()) -> JSON:
        """Until the Deployment's replicas all exist, none of them `replacing`, their containers
        run and are ready, and (with leader election) one of them holds the Lease; returns that
        one. ReleaseError with the pods' state when not within the timeout."""
        deadline = time.monotonic() + self.timeout
        pods: list[JSON] = []
        while time.monotonic() < deadline:
            pods = self.operator_pods()
            names = {p["metadata"]["name"] for p in pods}
            if (
                len(pods) == max(1, self.desired_replicas())
                and not names & set(replacing)
                and all(_running_and_ready(p) for p in pods)
                and (not self.leader_election or self.lease_holder() in names)
            ):
                pod = self.operator_pod()
                assert pod is not None
                return pod
            time.sleep(0.2)
        state = json.dumps(
            {p["metadata"]["name"]: p.get("status", {}).get("containerStatuses") for p in pods},
            indent=1,
        )
        raise ReleaseError(
            f"operator pods of release {self.name} not running after {self.timeout:.0f}s "
            f"(Lease holder {self.lease_holder()}): {state}"
        )

    def desired_replicas(self) -> int:
        read = client.AppsV1Api(self.kube.api).read_namespaced_deployment
        deployment = get_or_none(read, self.fullname, self.namespace) or {}
        return int((deployment.get("spec") or {}).get("replicas") or 0)


def _running_and_ready(pod: JSON) -> bool:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == OPERATOR_CONTAINER:
            return bool(status.get("ready")) and "running" in (status.get("state") or {})
    return False
