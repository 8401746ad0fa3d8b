"""The chart's release lifecycle, with the real helm binary, on a real control plane.

`helm install` runs the operator as the chart's pod on the process node under the chart's
ServiceAccount (token and CA at /var/run/secrets/kubernetes.io/serviceaccount, no kubeconfig);
examples/minimal.yaml gets Ready; `helm upgrade` with a new log level and path prefixes rolls the
operator pod while the deployment stays Ready; a Role without one verb makes the operator say
which request was forbidden; `helm uninstall` removes the operator and its RBAC and keeps the
CRD and the ModelDeployments (README); a reinstall adopts them. The API server's audit log shows
who made each request. One stack for the module; the tests run in order.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.e2e.conftest import _require_binaries
from tests.support.e2e import READY_TIMEOUT
from tests.support.opmetrics import wait_passes
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.local.history import History
from weightlift.local.kube import call, get_or_none
from weightlift.local.observe import Observer
from weightlift.local.podidentity import SERVICE_ACCOUNT_DIR
from weightlift.local.release import CHART, HelmRelease, ReleaseError
from weightlift.local.stack import LocalStack, make_demo_model

JSON = dict[str, Any]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "minimal.yaml"
OPERATOR_USER = "system:serviceaccount:weightlift:weightlift-operator"
# The operator's two clients: kopf's own (aiohttp) and the kubernetes client's writes.
OPERATOR_AGENTS = ("kopf/", "OpenAPI-Generator/")
NAME = "tiny"
CRD = "modeldeployments.weightlift.dev"
# The release's cluster-scoped objects: <release namespace>-<release>-operator[-...].
CLUSTER_PREFIX = "weightlift-weightlift-operator"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-release")


@pytest.fixture(scope="module")
def stack(root: Path) -> Iterator[LocalStack]:
    _require_binaries()
    policy = root / "audit-policy.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "audit.k8s.io/v1",
                "kind": "Policy",
                "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata"}],
            }
        )
    )
    s = LocalStack(
        root / "stack",
        node_name="helm-node",
        install="helm",
        model_path_prefixes=(str(root / "models"),),
        worker_env={"CUDA_VISIBLE_DEVICES": ""},
        apiserver_args=(
            f"--audit-policy-file={policy}",
            f"--audit-log-path={root / 'audit.log'}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            "--audit-log-maxsize=0",
        ),
    )
    (root / "models").mkdir()
    with s:
        yield s


@pytest.fixture(scope="module")
def model_dir(root: Path) -> Path:
    out = root / "models" / NAME
    make_demo_model(out, 4.0, hook=False)
    return out


def operator_process(stack: LocalStack) -> tuple[JSON, int]:
    assert stack.release is not None
    pod = stack.release.operator_pod()
    assert pod is not None, "no operator pod"
    runner = stack.process_node.pods()[f"{stack.release.namespace}/{pod['metadata']['name']}"]
    (pid,) = runner.pids()
    return pod, pid


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def jwt_claims(token: str) -> JSON:
    payload = token.split(".")[1]
    claims: JSON = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return claims


def ready_observer(stack: LocalStack, replicas: int) -> Observer:
    """Until the operator has seen the current spec and exactly `replicas` pods are Ready."""

    def converged(o: Observer) -> bool:
        generation = int(((o.md or {}).get("metadata") or {}).get("generation", 0))
        return (
            int(o.status().get("observedGeneration", 0)) >= generation
            and o.phase() == "Ready"
            and int(o.status().get("readyReplicas", 0)) == replicas
            and len(o.pods) == replicas
        )

    obs = Observer(stack, NAME)
    obs.wait(converged, READY_TIMEOUT, f"{NAME}: {replicas} replicas Ready")
    return obs


def worker_uids(stack: LocalStack) -> set[str]:
    return {p["metadata"]["uid"] for p in stack.pods(NAME)}


def cluster_scoped_reads(stack: LocalStack, prefix: str) -> dict[str, Callable[[], Any]]:
    """Reads of a release's cluster-scoped objects (prefix: <namespace>-<release>-operator),
    each answering the object or raising 404."""
    rbac = client.RbacAuthorizationV1Api(stack.kube.api)
    admission = client.AdmissionregistrationV1Api(stack.kube.api)
    return {
        f"clusterrole {prefix}": partial(rbac.read_cluster_role, prefix),
        f"clusterrole {prefix}-cluster": partial(rbac.read_cluster_role, f"{prefix}-cluster"),
        f"clusterrolebinding {prefix}-cluster": partial(
            rbac.read_cluster_role_binding, f"{prefix}-cluster"
        ),
        f"validatingadmissionpolicy {prefix}-model-paths": partial(
            admission.read_validating_admission_policy, f"{prefix}-model-paths"
        ),
        f"validatingadmissionpolicybinding {prefix}-model-paths": partial(
            admission.read_validating_admission_policy_binding, f"{prefix}-model-paths"
        ),
    }


def crd_exists(stack: LocalStack) -> bool:
    read = client.ApiextensionsV1Api(stack.kube.api).read_custom_resource_definition
    return get_or_none(read, CRD) is not None


def test_install_runs_the_operator_as_the_charts_pod(stack: LocalStack) -> None:
    pod, pid = operator_process(stack)
    assert pod["spec"]["serviceAccountName"] == "weightlift-operator"
    env = environ(pid)
    assert "KUBECONFIG" not in env
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    # The process's own view of the filesystem (its mount namespace): what a kubelet mounts.
    # Resolved first: /var/run is a symlink to /run, which /proc/PID/root would resolve on
    # the host's side.
    mounted = Path(f"/proc/{pid}/root{Path(SERVICE_ACCOUNT_DIR).resolve()}")
    claims = jwt_claims((mounted / "token").read_text())
    assert claims["sub"] == OPERATOR_USER
    assert claims["kubernetes.io"]["pod"]["name"] == pod["metadata"]["name"]
    assert "BEGIN CERTIFICATE" in (mounted / "ca.crt").read_text()
    assert (mounted / "namespace").read_text() == "weightlift"
    assert not Path(SERVICE_ACCOUNT_DIR, "token").exists(), "the host's view must not change"
    assert crd_exists(stack), "the chart installs the CRD"


def test_example_gets_ready(stack: LocalStack, model_dir: Path) -> None:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    assert manifest["metadata"]["name"] == NAME
    manifest["spec"]["model"]["uri"] = f"hostpath://{model_dir}"
    stack.apply(manifest)
    obs = ready_observer(stack, 2)
    endpoint = next(r["endpoint"] for r in obs.summary()["replicas"])
    meta = httpx.get(f"{endpoint}/v2/models/{NAME}", timeout=10).json()
    assert meta["name"] == NAME


def test_upgrade_rolls_the_operator_and_the_deployment_stays_ready(
    stack: LocalStack, root: Path
) -> None:
    assert stack.release is not None
    before_pod, _ = operator_process(stack)
    before_workers = worker_uids(stack)
    other = root / "models-b"
    other.mkdir()
    values = {
        **stack.release.values,
        "logLevel": "debug",
        "modelPathPrefixes": [str(root / "models"), str(other)],
    }
    # Every version of the deployment from before the upgrade on: a phase other than Ready at
    # any moment is one of them (phase is written at once), not only one a poll lands on.
    with History.deployment(stack.kubeconfig, stack.namespace, NAME) as history:
        new_pod = stack.release.upgrade(values)
        ready_observer(stack, 2)
        # Until when: the new leader's own pass counter proves it reconciled the deployment (the
        # only one here) 3 times, each writing at once a phase it planned (statuswrites.py);
        # then every version up to the one a GET answers after that.
        wait_passes(stack, 3, "the upgraded operator's passes")
        md = stack.get_md(NAME)
        assert md is not None
        versions = history.through(md, tick=stack.check_operator)
    assert new_pod["metadata"]["name"] != before_pod["metadata"]["name"]
    _, pid = operator_process(stack)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert "--log-level=debug" in argv
    assert f"--model-path-prefix={other}" in argv
    phases = [(v.rv, v.status.get("phase")) for v in versions]
    assert {phase for _, phase in phases} == {"Ready"}, f"(rv, phase) during the upgrade: {phases}"
    assert worker_uids(stack) == before_workers, "the upgrade must not touch worker pods"
    # The admission policy follows the new prefixes too.
    probe = {
        "apiVersion": "weightlift.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "admitted", "namespace": "default"},
        "spec": {"model": {"uri": f"hostpath://{other}/m"}, "replicas": 0},
    }
    # The API server reloads an updated ValidatingAdmissionPolicy from its informer, a moment
    # after helm's write: the new prefix is admitted once it has (bounded, never a speed check).
    deadline = time.monotonic() + 60
    while True:
        create = stack.kube.custom.create_namespaced_custom_object
        try:
            call(create, GROUP, VERSION, "default", PLURAL, probe, dry_run="All")
            break
        except ApiException as exc:
            if exc.status != 403 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_missing_verb_is_reported_naming_verb_and_resource(stack: LocalStack, root: Path) -> None:
    assert stack.release is not None
    chart = root / "chart-no-pod-create"
    shutil.copytree(CHART, chart)
    rbac = chart / "templates" / "rbac.yaml"
    full = '["get", "list", "watch", "create", "delete", "patch"]'
    assert full in rbac.read_text()
    rbac.write_text(rbac.read_text().replace(full, '["get", "list", "watch", "delete", "patch"]'))
    values = dict(stack.release.values)
    stack.release.upgrade(values, chart=chart)
    stack.patch_md(NAME, {"spec": {"replicas": 3}})
    want = 'cannot create resource "pods"'
    obs = Observer(stack, NAME)
    obs.wait(lambda o: want in str(o.status().get("message")), 120, "the forbidden create")
    assert OPERATOR_USER in str(obs.status()["message"])
    events = stack.events(NAME)
    assert any(e["reason"] == "FailedCreate" and want in e["message"] for e in events)
    assert want in stack.operator_log().read_text()
    # The chart as it is grants it again: the third replica comes.
    stack.release.upgrade(values, chart=CHART)
    ready_observer(stack, 3)


def test_uninstall_removes_operator_and_rbac_and_keeps_crd_and_deployments(
    stack: LocalStack,
) -> None:
    assert stack.release is not None
    stack.patch_md(NAME, {"spec": {"replicas": 2}})
    ready_observer(stack, 2)
    workers = worker_uids(stack)
    stack.release.uninstall()
    deadline = time.monotonic() + 60
    while stack.release.operator_pods() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not stack.release.operator_pods()
    core, apps = stack.kube.core, client.AppsV1Api(stack.kube.api)
    rbac = client.RbacAuthorizationV1Api(stack.kube.api)
    reads: dict[str, Callable[..., Any]] = {
        "deployment weightlift/weightlift-operator": partial(
            apps.read_namespaced_deployment, "weightlift-operator", "weightlift"
        ),
        "serviceaccount weightlift/weightlift-operator": partial(
            core.read_namespaced_service_account, "weightlift-operator", "weightlift"
        ),
        **cluster_scoped_reads(stack, CLUSTER_PREFIX),
        "rolebinding default/weightlift-operator": partial(
            rbac.read_namespaced_role_binding, "weightlift-operator", "default"
        ),
        "role default/weightlift-worker": partial(
            rbac.read_namespaced_role, "weightlift-worker", "default"
        ),
        "serviceaccount default/weightlift-worker": partial(
            core.read_namespaced_service_account, "weightlift-worker", "default"
        ),
    }
    for what, read in reads.items():
        assert get_or_none(read) is None, f"{what} outlived helm uninstall"
    assert crd_exists(stack), "the CRD template is kept (helm.sh/resource-policy: keep)"
    assert stack.get_md(NAME) is not None
    assert worker_uids(stack) == workers, "worker pods keep serving without the operator"
    for pod in stack.pods(NAME):
        ready = httpx.get(f"http://{pod['status']['podIP']}:8000/v2/health/ready", timeout=10)
        assert ready.status_code == 200, pod["metadata"]["name"]


def test_reinstall_adopts_the_existing_deployment(stack: LocalStack) -> None:
    assert stack.release is not None
    workers = worker_uids(stack)
    stack.release.install()
    stack.patch_md(NAME, {"spec": {"replicas": 1}})
    obs = Observer(stack, NAME)
    obs.wait(
        lambda o: len(o.pods) == 1 and int(o.status().get("readyReplicas", 0)) == 1,
        READY_TIMEOUT,
        "scaled to 1 by the reinstalled operator",
    )
    assert worker_uids(stack) < workers, "the kept replica is one of the pods it adopted"


def test_a_second_install_is_refused_by_helm_and_breaks_nothing(stack: LocalStack) -> None:
    """The same release again (helm's own error); another release that would watch the first
    one's namespace (the chart's: two operators must not reconcile one ModelDeployment); the
    first release keeps working."""
    release = stack.release
    assert release is not None
    running, _ = operator_process(stack)
    with pytest.raises(ReleaseError, match="cannot reuse a name that is still in use"):
        release.install()
    other = HelmRelease(stack.kubeconfig, name="other", namespace="other", values=release.values)
    overlap = r"namespace default is already watched by release weightlift/weightlift"
    with pytest.raises(ReleaseError, match=overlap):
        other.install()
    clusterwide = HelmRelease(
        stack.kubeconfig,
        name="other",
        namespace="other",
        values={**release.values, "watchNamespaces": [], "crds": {"install": False}},
    )
    with pytest.raises(ReleaseError, match=r"release weightlift/weightlift watches default"):
        clusterwide.install()
    assert release.status()["info"]["status"] == "deployed"
    assert operator_process(stack)[0]["metadata"]["uid"] == running["metadata"]["uid"]
    ready_observer(stack, 1)


def test_every_operator_request_ran_as_the_charts_service_account(
    stack: LocalStack, root: Path
) -> None:
    by_user: dict[str, int] = {}
    verbs: set[tuple[str, str]] = set()
    for line in (root / "audit.log").read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not event.get("userAgent", "").startswith(OPERATOR_AGENTS):
            continue
        user = event["user"].get("username")
        if user is None:
            # Authentication refused it (the audit event names no user): after `helm uninstall`
            # the terminating operator pod still calls with its deleted account's token.
            assert event["responseStatus"]["code"] == 401, event
            continue
        by_user[user] = by_user.get(user, 0) + 1
        ref = event.get("objectRef") or {}
        verbs.add((event["verb"], ref.get("resource", "")))
    assert set(by_user) == {OPERATOR_USER}, by_user
    # Both clients were seen at work: kopf watching, the kubernetes client writing.
    assert {("watch", "modeldeployments"), ("create", "pods"), ("patch", "modeldeployments")} <= (
        verbs
    ), verbs


# -- the chart as it upgrades, and as one of two releases (after the audit: the second
# -- release's operator is another user)

UPGRADE_FIELD = "upgradeNote"
PROBE_NS = "crd-probe"  # watched by no operator: only the API server handles the probe object


def chart_with_a_new_crd_field(root: Path) -> Path:
    """A copy of the chart, version 0.1.1, whose CRD has one more optional spec field."""
    chart = root / "chart-crd-field"
    shutil.copytree(CHART, chart)
    crd_file = chart / "files" / "crds" / "modeldeployment.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert UPGRADE_FIELD not in spec["properties"]
    spec["properties"][UPGRADE_FIELD] = {"type": "string", "maxLength": 64}
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"] = "0.1.1"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return chart


def probe_note(stack: LocalStack, note: str) -> str | None:
    """Write the probe ModelDeployment with spec.upgradeNote = note (created, or merge-patched)
    and read it back: what the API server stored of the field (None: pruned)."""
    probe = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelDeployment",
        "metadata": {"name": "crd-probe", "namespace": PROBE_NS},
        "spec": {"model": {"uri": "s3://bucket/m"}, "replicas": 0, UPGRADE_FIELD: note},
    }
    stored = stack.apply(probe)
    value = stored["spec"].get(UPGRADE_FIELD)
    return None if value is None else str(value)


def crd_object(stack: LocalStack) -> JSON:
    read = client.ApiextensionsV1Api(stack.kube.api).read_custom_resource_definition
    crd = get_or_none(read, CRD)
    assert crd is not None
    return crd


def test_upgrade_applies_a_crd_that_gained_a_field_and_rollback_takes_it_back(
    stack: LocalStack, root: Path
) -> None:
    release = stack.release
    assert release is not None
    call(stack.kube.core.create_namespace, {"metadata": {"name": PROBE_NS}})
    assert probe_note(stack, "before") is None, "the installed CRD has no such field: pruned"
    release.upgrade(dict(release.values), chart=chart_with_a_new_crd_field(root))
    crd = crd_object(stack)
    assert crd["metadata"]["labels"]["helm.sh/chart"] == "weightlift-0.1.1"
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert UPGRADE_FIELD in schema["properties"], "helm upgrade updated the CRD"
    # The API server serves a changed CRD's schema a moment after the write (its CRD handler
    # follows an informer), so the first writes may still be pruned (bounded, not a speed check).
    deadline = time.monotonic() + 60
    while probe_note(stack, "kept") != "kept":
        assert time.monotonic() < deadline, "the new field was never stored"
        time.sleep(0.5)
    history = json.loads(
        release.helm("history", release.name, "-n", release.namespace, "-o", "json")
    )
    assert (history[-1]["status"], history[-1]["chart"]) == ("deployed", "weightlift-0.1.1")
    # Back to the revision before: the CRD loses the field again, and the API server drops the
    # stored value when it reads the object (docs/upgrade.md, rollback).
    release.rollback()
    assert (
        UPGRADE_FIELD
        not in (
            crd_object(stack)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
                "spec"
            ]["properties"]
        )
    )
    read = stack.kube.custom.get_namespaced_custom_object
    deadline = time.monotonic() + 60
    while UPGRADE_FIELD in call(read, GROUP, VERSION, PROBE_NS, PLURAL, "crd-probe")["spec"]:
        assert time.monotonic() < deadline, "the rolled-back CRD still serves the field"
        time.sleep(0.5)
    assert release.status()["info"]["status"] == "deployed"
    assert crd_object(stack)["metadata"]["labels"]["helm.sh/chart"] == "weightlift-0.1.0"


def test_a_release_whose_crd_came_from_crds_dir_takes_it_over(
    stack: LocalStack, root: Path
) -> None:
    """Chart 0.1.0 had the CRD in crds/: helm created it once, recorded it in no release, and
    gave it no ownership metadata. Upgrading such a release to this chart is refused, naming
    the CRD, until `--take-ownership` (docs/upgrade.md, from 0.1.0)."""
    release = stack.release
    assert release is not None
    old = root / "chart-crds-dir"
    shutil.copytree(CHART, old)
    (old / "crds").mkdir()
    (old / "files" / "crds" / "modeldeployment.yaml").rename(old / "crds" / "modeldeployment.yaml")
    (old / "templates" / "crd.yaml").unlink()
    release.upgrade(dict(release.values), chart=old)
    assert crd_exists(stack), "the CRD left the release's manifest but is kept"
    unowned = {
        "metadata": {
            "annotations": {
                "meta.helm.sh/release-name": None,
                "meta.helm.sh/release-namespace": None,
                "helm.sh/resource-policy": None,
            },
            "labels": {"app.kubernetes.io/managed-by": None},
        }
    }
    patch = client.ApiextensionsV1Api(stack.kube.api).patch_custom_resource_definition
    call(patch, CRD, unowned, _content_type="application/merge-patch+json")
    with pytest.raises(ReleaseError, match=rf"{CRD}.* exists and cannot be imported"):
        release.upgrade(dict(release.values))
    release.upgrade(dict(release.values), flags=("--take-ownership",))
    annotations = crd_object(stack)["metadata"]["annotations"]
    assert annotations["meta.helm.sh/release-name"] == "weightlift"
    assert annotations["helm.sh/resource-policy"] == "keep"
    assert release.status()["info"]["status"] == "deployed"


def test_a_second_release_in_another_namespace_coexists(stack: LocalStack, root: Path) -> None:
    """Release B: the same name, another namespace, its own watched namespace, CRD management
    off. Both are deployed with apart cluster-scoped objects; B's operator reconciles only B's
    namespace; uninstalling B leaves A's objects and the CRD."""
    a = stack.release
    assert a is not None
    a_pod, _ = operator_process(stack)
    call(stack.kube.core.create_namespace, {"metadata": {"name": "team-b"}})
    b = HelmRelease(
        stack.kubeconfig,
        name="weightlift",
        namespace="weightlift-b",
        values={
            **a.values,
            "watchNamespaces": ["team-b"],
            "crds": {"install": False},
            "replicas": 1,
        },
    )
    b.install()
    try:
        assert a.status()["info"]["status"] == b.status()["info"]["status"] == "deployed"
        for prefix, namespace in (
            (CLUSTER_PREFIX, "weightlift"),
            ("weightlift-b-weightlift-operator", "weightlift-b"),
        ):
            for what, read_object in cluster_scoped_reads(stack, prefix).items():
                annotations = call(read_object)["metadata"]["annotations"]
                assert annotations["meta.helm.sh/release-namespace"] == namespace, what
        crd_owner = crd_object(stack)["metadata"]["annotations"]["meta.helm.sh/release-namespace"]
        assert crd_owner == "weightlift", "the CRD stays release A's"
        worker = call(
            stack.kube.core.read_namespaced_service_account, "weightlift-worker", "team-b"
        )
        assert worker["metadata"]["annotations"]["meta.helm.sh/release-namespace"] == "weightlift-b"
        # B's operator reconciles a ModelDeployment of its namespace (A's does not watch it).
        md = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelDeployment",
            "metadata": {"name": "b-model", "namespace": "team-b"},
            "spec": {"model": {"uri": "s3://bucket/m"}, "replicas": 0},
        }
        stack.apply(md)
        get = partial(call, stack.kube.custom.get_namespaced_custom_object, GROUP, VERSION)
        deadline = time.monotonic() + READY_TIMEOUT
        while not (get("team-b", PLURAL, "b-model").get("status") or {}).get("observedGeneration"):
            assert time.monotonic() < deadline, "release B's operator never reconciled team-b"
            time.sleep(0.5)
    finally:
        b.uninstall()
    for what, read_object in cluster_scoped_reads(stack, CLUSTER_PREFIX).items():
        assert get_or_none(read_object) is not None, f"uninstalling B removed A's {what}"
    for what, read_object in cluster_scoped_reads(
        stack, "weightlift-b-weightlift-operator"
    ).items():
        assert get_or_none(read_object) is None, f"{what} outlived B's uninstall"
    assert crd_exists(stack)
    assert a.status()["info"]["status"] == "deployed"
    assert operator_process(stack)[0]["metadata"]["uid"] == a_pod["metadata"]["uid"]
    # Who wrote team-b's ModelDeployment: B's operator only (the audit log names the user).
    writers = set()
    for line in (root / "audit.log").read_text().splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        ref = event.get("objectRef") or {}
        code = int((event.get("responseStatus") or {}).get("code") or 0)
        if (ref.get("namespace"), ref.get("resource"), event.get("verb")) == (
            "team-b",
            PLURAL,
            "patch",
        ) and code < 400:
            writers.add(event["user"].get("username"))
    assert writers == {"system:serviceaccount:weightlift-b:weightlift-operator"}, writers
