"""local/lws.py's pure parts: the webhook configurations it registers and the serving cert."""

from __future__ import annotations

import base64
import re
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from weightlift.local.lws import (
    LWS_VERSION,
    SET_NAME_LABEL,
    WEBHOOK_PREFIX,
    LwsError,
    lws_dir,
    webhook_configurations,
    write_serving_cert,
)

# The shape controller-gen writes into sigs.k8s.io/lws config/webhook/manifests.yaml.
MANIFESTS = """
---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: mutating-webhook-configuration
webhooks:
- admissionReviewVersions: [v1]
  clientConfig:
    service:
      name: webhook-service
      namespace: system
      path: /mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset
  failurePolicy: Fail
  name: mleaderworkerset.kb.io
  rules:
  - apiGroups: [leaderworkerset.x-k8s.io]
    apiVersions: [v1]
    operations: [CREATE, UPDATE]
    resources: [leaderworkersets]
  sideEffects: None
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}
  failurePolicy: Fail
  name: mpod.kb.io
  rules:
  - {apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}
  sideEffects: None
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: validating-webhook-configuration
webhooks:
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /validate--v1-pod}
  failurePolicy: Fail
  name: vpod.kb.io
  rules:
  - {apiGroups: [""], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [pods]}
  sideEffects: None
"""


def test_webhooks_point_at_the_loopback_url_and_pods_of_lws_only() -> None:
    docs = webhook_configurations(MANIFESTS, "https://127.0.0.1:9443", b"CA PEM")
    assert [d["metadata"]["name"] for d in docs] == [
        WEBHOOK_PREFIX + "mutating-webhook-configuration",
        WEBHOOK_PREFIX + "validating-webhook-configuration",
    ]
    hooks = {h["name"]: h for d in docs for h in d["webhooks"]}
    assert hooks["mpod.kb.io"]["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate--v1-pod",
        "caBundle": base64.b64encode(b"CA PEM").decode(),
    }
    assert "service" not in hooks["mleaderworkerset.kb.io"]["clientConfig"]
    lws_only = {"matchExpressions": [{"key": SET_NAME_LABEL, "operator": "Exists"}]}
    # Pod webhooks see only LWS pods (other pods of the stack never wait on this process);
    # the LeaderWorkerSet webhook sees every LeaderWorkerSet.
    assert hooks["mpod.kb.io"]["objectSelector"] == lws_only
    assert hooks["vpod.kb.io"]["objectSelector"] == lws_only
    assert "objectSelector" not in hooks["mleaderworkerset.kb.io"]
    assert all(h["failurePolicy"] == "Fail" for h in hooks.values())


def test_serving_cert_is_for_the_host_and_signed_by_the_bundle(tmp_path: Path) -> None:
    ca = write_serving_cert(tmp_path, "127.0.0.1")
    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    assert (tmp_path / "tls.key").stat().st_mode & 0o077 == 0
    ssl.create_default_context(cadata=ca.decode())  # a bundle TLS clients accept


def test_missing_build_names_make_lws(tmp_path: Path) -> None:
    with pytest.raises(LwsError, match="make lws"):
        lws_dir(tmp_path)


def test_build_script_and_launcher_pin_the_same_lws() -> None:
    script = (Path(__file__).resolve().parents[3] / "hack" / "build-lws.sh").read_text()
    pinned = re.search(r'^LWS_VERSION="([^"]+)"', script, re.M)
    assert pinned is not None and pinned.group(1) == LWS_VERSION
