"""The LeaderWorkerSet controller (sigs.k8s.io/lws) in the local stack: its CRDs installed into the
control plane, the controller run as a process with the admin kubeconfig, and its webhooks
registered against the local API server. Built from Go modules by hack/build-lws.sh (`make lws`).

Webhooks: registered, not disabled. The controller can run without them (ENABLE_WEBHOOKS=false),
but LWS puts real work there: the pod webhook gives a leader its group-index label and every pod
its worker index and LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX env, and the
LeaderWorkerSet webhook defaults and validates the object. So the webhook server serves on
loopback with a certificate from a CA made here, and the webhook configurations point at it by
URL (the API server runs on this host) instead of a Service. The pod webhooks get the
objectSelector upstream's kustomize patches add (only pods of a LeaderWorkerSet), so no other
pod of the stack depends on this process.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from weightlift.api.labels import (
    LWS_GROUP as LWS_GROUP,
)
from weightlift.api.labels import (
    LWS_GROUP_INDEX_LABEL,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
)
from weightlift.local.certs import new_ca, pem, signed
from weightlift.local.cluster import cache_dir
from weightlift.local.kube import Kube, call
from weightlift.local.kube import install_crds as kube_install_crds
from weightlift.local.net import free_ports
from weightlift.local.procs import UpDown, child_options, stop_group

# Pinned; hack/build-lws.sh carries the same value.
LWS_VERSION = "v0.9.0"
# Labels of the pods LWS makes (sigs.k8s.io/lws/api/leaderworkerset/v1): the contract's.
SET_NAME_LABEL = LWS_NAME_LABEL
WORKER_INDEX_LABEL = LWS_WORKER_INDEX_LABEL
GROUP_INDEX_LABEL = LWS_GROUP_INDEX_LABEL
# Webhook configurations are cluster-scoped: ours are named apart from a real install's.
WEBHOOK_PREFIX = "weightlift-lws-"

JSON = dict[str, Any]


class LwsError(RuntimeError):
    """The LWS controller is not built or did not come up."""


def lws_dir(cache: Path | None = None) -> Path:
    base = cache if cache is not None else cache_dir()
    out = base / f"lws-{LWS_VERSION}"
    if not (out / ".complete").is_file() or not os.access(out / "bin" / "lws-controller", os.X_OK):
        raise LwsError(
            f"LWS controller not found in {out}: build it with `make lws` "
            f"(hack/build-lws.sh {base})"
        )
    return out


def write_serving_cert(cert_dir: Path, host: str) -> bytes:
    """A CA and a serving certificate for `host` (an IP) signed by it, as controller-runtime's
    webhook server reads them (tls.crt, tls.key in its certDir). Returns the CA's PEM, the
    webhook configurations' caBundle."""
    from cryptography import x509

    cert_dir.mkdir(parents=True, exist_ok=True)
    ca_key, ca = new_ca("weightlift-lws-webhook-ca", days=30)
    san = x509.IPAddress(ipaddress.ip_address(host))
    key, leaf = signed(ca_key, ca, "lws-webhook", server_names=[san], days=30)
    (cert_dir / "tls.crt").write_bytes(pem(leaf))
    (cert_dir / "tls.key").write_bytes(pem(key))
    (cert_dir / "tls.key").chmod(0o600)
    return pem(ca)


def webhook_configurations(manifests: str, base_url: str, ca_bundle: bytes) -> list[JSON]:
    """controller-gen's webhook configurations, pointed at `base_url` + each webhook's path
    (not a Service), trusting `ca_bundle`, the pod webhooks limited to LWS pods."""
    out: list[JSON] = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        doc["metadata"] = {"name": WEBHOOK_PREFIX + doc["metadata"]["name"]}
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": base_url + path,
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = {
                    "matchExpressions": [{"key": SET_NAME_LABEL, "operator": "Exists"}]
                }
        out.append(doc)
    return out


def install_crds(kube: Kube, crd_dir: Path, timeout: float = 60.0) -> list[str]:
    """Create (or replace) every CRD in `crd_dir`; wait until each is Established."""
    crds = [yaml.safe_load(p.read_text()) for p in sorted(crd_dir.glob("*.yaml"))]
    return kube_install_crds(kube, crds, timeout)


@dataclass
class LwsController(UpDown):
    """`with LwsController(kubeconfig, state_dir):` CRDs installed, controller up, webhooks
    registered; leaving unregisters the webhooks first (pods of LWS would otherwise be refused by
    a webhook nobody serves), then stops the process. The CRDs stay, like a CRD of a chart."""

    kubeconfig: Path
    state_dir: Path
    host: str = "127.0.0.1"
    cache: Path | None = None

    webhook_port: int = field(init=False, default=0)
    health_port: int = field(init=False, default=0)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _kube: Kube | None = field(init=False, default=None)
    _webhooks: list[JSON] = field(init=False, default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.state_dir / "lws-controller.log"

    def up(self, timeout: float = 120.0) -> None:
        home = lws_dir(self.cache)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._kube = kube = Kube(self.kubeconfig, "lws")
        install_crds(kube, home / "crds")
        self.webhook_port, self.health_port = free_ports(2, self.host)
        ca = write_serving_cert(self.state_dir / "certs", self.host)
        config = self.state_dir / "lws-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "config.lws.x-k8s.io/v1alpha1",
                    "kind": "Configuration",
                    "leaderElection": {"leaderElect": False},  # one controller, no Lease
                    "internalCertManagement": {"enable": False},  # our cert, not a Secret's
                    "webhook": {
                        "host": self.host,
                        "port": self.webhook_port,
                        "certDir": str(self.state_dir / "certs"),
                    },
                    "metrics": {"bindAddress": "0"},  # off: no port to collide on
                    "health": {"healthProbeBindAddress": f"{self.host}:{self.health_port}"},
                }
            )
        )
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.state_dir),
            "KUBECONFIG": str(self.kubeconfig),
        }
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(home / "bin" / "lws-controller"),
                    f"--config={config}",
                    "--zap-log-level=info",
                ],
                **child_options(log, env=env, die_with=signal.SIGTERM),
            )
        self._wait_serving(ca, timeout)
        self._register(home, ca)

    def _wait_serving(self, ca: bytes, timeout: float) -> None:
        """Until /readyz answers and the pod webhook's path is registered (the controller adds its
        webhook handlers once its certificates are in place)."""
        ctx = ssl.create_default_context(cadata=ca.decode())
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise LwsError(f"lws-controller exited {self.proc.returncode}; see {self.log_path}")
            try:
                urllib.request.urlopen(f"http://{self.host}:{self.health_port}/readyz", timeout=2)
                req = urllib.request.Request(
                    f"https://{self.host}:{self.webhook_port}/mutate--v1-pod",
                    data=b"{}",
                    headers={"Content-Type": "application/json"},
                )
                urllib.request.urlopen(req, context=ctx, timeout=2)
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 404:  # served: an empty AdmissionReview is a bad request
                    return
                last = f"HTTP {exc.code}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise LwsError(f"lws-controller not serving after {timeout:.0f}s ({last}); {self.log_path}")

    def _register(self, home: Path, ca: bytes) -> None:
        assert self._kube is not None
        adm = client.AdmissionregistrationV1Api(self._kube.api)
        base = f"https://{self.host}:{self.webhook_port}"
        manifests = (home / "webhook" / "manifests.yaml").read_text()
        for doc in webhook_configurations(manifests, base, ca):
            create, delete = self._calls(adm, doc["kind"])
            try:
                delete(doc["metadata"]["name"])  # a crashed run's, pointing at a dead port
            except ApiException as exc:
                if exc.status != 404:
                    raise
            call(create, doc)
            self._webhooks.append(doc)

    @staticmethod
    def _calls(adm: client.AdmissionregistrationV1Api, kind: str) -> tuple[Any, Any]:
        if kind == "MutatingWebhookConfiguration":
            return (
                adm.create_mutating_webhook_configuration,
                adm.delete_mutating_webhook_configuration,
            )
        return (
            adm.create_validating_webhook_configuration,
            adm.delete_validating_webhook_configuration,
        )

    def down(self) -> None:
        if self._kube is not None:
            adm = client.AdmissionregistrationV1Api(self._kube.api)
            for doc in self._webhooks:
                try:
                    self._calls(adm, doc["kind"])[1](doc["metadata"]["name"])
                except ApiException as exc:
                    if exc.status != 404:
                        raise
            self._webhooks.clear()
        if self.proc is not None:
            stop_group(self.proc, grace=10)
            self.proc = None
        if self._kube is not None:
            self._kube.close()
            self._kube = None
