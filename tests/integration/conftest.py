"""Integration tier: a real control plane (etcd, kube-apiserver, controller-manager, scheduler,
kwok GPU nodes) brought up once per session and always torn down.

Skips only when the binaries are absent AND ``WEIGHTLIFT_REQUIRE_CLUSTER`` is unset; with the
variable set (CI, ``make test``) a missing binary is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

from tests.support.cluster import (
    CHART_NAMESPACE,
    OPERATOR_NAMESPACE,
    ChartRbac,
    Kubectl,
    OperatorProcess,
    render_chart,
    wait_for,
)
from weightlift.local.cluster import (
    ClusterInfo,
    ControlPlane,
    GpuNodeSpec,
    missing_binaries,
    tool_path,
)

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)


def _require_binaries() -> None:
    missing = missing_binaries()
    if not missing:
        return
    msg = (
        f"control plane binaries missing: {', '.join(missing)}; build them with "
        "`make controlplane` (hack/build-controlplane.sh, hack/install_tools.py)"
    )
    if os.environ.get("WEIGHTLIFT_REQUIRE_CLUSTER"):
        pytest.fail(msg + " [WEIGHTLIFT_REQUIRE_CLUSTER is set]", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def state_root(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Our own temp dir, not pytest's numbered basetemp: concurrent pytest sessions on one
    machine prune each other's pytest-N dirs, which must not take etcd's data dir along.
    Kept (and printed) when a test failed, for the component logs."""
    root = Path(tempfile.mkdtemp(prefix="weightlift-it-"))
    yield root
    if request.session.testsfailed:
        print(f"\nintegration state and logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster(state_root: Path) -> Iterator[ClusterInfo]:
    """The session's control plane; KUBECONFIG points at it while tests run."""
    _require_binaries()
    state = state_root / "cluster"
    cp = ControlPlane(state, nodes=GpuNodeSpec(count=4, gpus_per_node=8), bind_to_parent=True)
    old = os.environ.get("KUBECONFIG")
    try:
        info = cp.up()
        os.environ["KUBECONFIG"] = str(info.kubeconfig)
        yield info
    finally:
        cp.down()
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


@pytest.fixture(scope="session")
def api_client(cluster: ClusterInfo) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        yield api
    finally:
        api.close()


@pytest.fixture(scope="session")
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@pytest.fixture(scope="session")
def custom(api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


@pytest.fixture(scope="session")
def kubectl(cluster: ClusterInfo) -> Kubectl:
    return Kubectl(tool_path("kubectl"), cluster.kubeconfig)


@pytest.fixture(scope="session")
def crd(cluster: ClusterInfo, kubectl: Kubectl) -> str:
    """Apply the CRD exactly as `weightlift crd` generates it; wait until Established."""
    out = subprocess.run(
        [sys.executable, "-m", "weightlift", "crd"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    kubectl("apply", "-f", "-", input=out)
    name = "modeldeployments.weightlift.dev"

    def established() -> bool:
        got = json.loads(kubectl("get", "crd", name, "-o", "json").stdout)
        conds = (got.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

    wait_for(established, 60, f"CRD {name} Established")
    # discovery can lag the Established condition by a moment
    wait_for(
        lambda: kubectl("get", "modeldeployments", "-A", check=False).returncode == 0,
        30,
        "modeldeployments resource discoverable",
    )
    return name


@pytest.fixture
def namespace(cluster: ClusterInfo, core: client.CoreV1Api) -> Iterator[str]:
    """A fresh namespace with its default ServiceAccount; deleted afterwards."""
    name = f"wl-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    def sa_exists() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
            return True
        except client.ApiException:
            return False

    wait_for(sa_exists, 60, f"default ServiceAccount in {name}")
    try:
        yield name
    finally:
        core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture
def make_pod(core: client.CoreV1Api) -> Callable[..., client.V1Pod]:
    """Create a plain pod (not operator-made) requesting GPUs, for scheduler tests."""

    def make(
        namespace: str,
        name: str,
        gpus: int,
        node_selector: dict[str, str] | None = None,
    ) -> client.V1Pod:
        res = {"nvidia.com/gpu": str(gpus)} if gpus else {}
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, labels={"test": "sched"}),
            spec=client.V1PodSpec(
                containers=[
                    client.V1Container(
                        name="main",
                        image="example.invalid/worker:test",
                        resources=client.V1ResourceRequirements(requests=res, limits=res),
                    )
                ],
                node_selector=node_selector,
                termination_grace_period_seconds=0,
            ),
        )
        created: client.V1Pod = core.create_namespaced_pod(namespace, pod)
        return created

    return make


# ------------------------------------------------------------------ chart RBAC and the operator


@pytest.fixture(scope="session")
def chart_rbac(cluster: ClusterInfo, kubectl: Kubectl, crd: str) -> ChartRbac:
    """The chart's ServiceAccounts and RBAC (not its Deployment: we run the operator here)."""
    docs = render_chart("--set", f"workerNamespaces={{{OPERATOR_NAMESPACE}}}")
    for ns in (CHART_NAMESPACE, OPERATOR_NAMESPACE):
        kubectl("create", "namespace", ns)
    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    wanted = [d for d in docs if d["kind"] in rbac_kinds]
    assert wanted, "the chart renders no RBAC"
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(wanted))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    return ChartRbac(namespace=CHART_NAMESPACE, operator_sa=sa, docs=docs)


@pytest.fixture(scope="session")
def operator_kubeconfig(
    cluster: ClusterInfo,
    kubectl: Kubectl,
    chart_rbac: ChartRbac,
    state_root: Path,
) -> Path:
    """A kubeconfig with a real token of the chart's operator ServiceAccount."""
    token = kubectl(
        "create", "token", chart_rbac.operator_sa, "-n", chart_rbac.namespace, "--duration=6h"
    ).stdout.strip()
    doc = yaml.safe_load(cluster.kubeconfig.read_text())
    doc["users"] = [{"name": "operator", "user": {"token": token}}]
    doc["contexts"][0]["context"]["user"] = "operator"
    path = state_root / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="session")
def operator(
    operator_kubeconfig: Path, chart_rbac: ChartRbac, state_root: Path
) -> Iterator[OperatorProcess]:
    """The operator, running as the chart's ServiceAccount, watching OPERATOR_NAMESPACE."""
    op = OperatorProcess(operator_kubeconfig, OPERATOR_NAMESPACE, state_root / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"operator log: {op.log_path}")
