"""Templates that set an operator-owned field, each with the field the refusal must name: the
same table for pydantic (tests/unit/api/test_podspec.py) and the real API server's CEL rules
(tests/integration/test_podtemplate_live.py)."""

from __future__ import annotations

from typing import Any

W = "spec.template.spec.containers[name=worker]"


def worker(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "worker", **fields}]}}


def sidecar(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "helper", "image": "busybox:1.36", **fields}]}}


# (id, template, what the message names)
OWNED: list[tuple[str, dict[str, Any], str]] = [
    ("label", {"metadata": {"labels": {"weightlift.dev/role": "Source"}}}, "metadata.labels"),
    (
        "label-managed-by",
        {"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}},
        "metadata.labels",
    ),
    (
        "annotation",
        {"metadata": {"annotations": {"weightlift.dev/peers": "{}"}}},
        "metadata.annotations",
    ),
    ("command", worker(command=["sh"]), f"{W}.command"),
    ("args", worker(args=["--x"]), f"{W}.args"),
    ("image", worker(image="evil:1"), f"{W}.image"),
    ("ports", worker(ports=[{"containerPort": 9}]), f"{W}.ports"),
    ("readiness", worker(readinessProbe={"exec": {"command": ["true"]}}), f"{W}.readinessProbe"),
    ("liveness", worker(livenessProbe={"exec": {"command": ["true"]}}), f"{W}.livenessProbe"),
    ("reserved-env", worker(env=[{"name": "WEIGHTLIFT_PLAN", "value": "x"}]), f"{W}.env"),
    ("ld-env", worker(env=[{"name": "LD_PRELOAD", "value": "x"}]), f"{W}.env"),
    (
        "plan-mount",
        worker(volumeMounts=[{"name": "x", "mountPath": "/etc/weightlift/plan"}]),
        f"{W}.volumeMounts",
    ),
    (
        "shm-mount",
        worker(volumeMounts=[{"name": "x", "mountPath": "/dev/shm"}]),
        f"{W}.volumeMounts",
    ),
    (
        "writable-root",
        worker(securityContext={"readOnlyRootFilesystem": False}),
        f"{W}.securityContext.readOnlyRootFilesystem",
    ),
    ("gpu", worker(resources={"limits": {"nvidia.com/gpu": "8"}}), f"{W}.resources"),
    (
        "privileged",
        sidecar(securityContext={"privileged": True}),
        "spec.template.spec.containers[].securityContext.privileged",
    ),
    (
        "escalation",
        worker(securityContext={"allowPrivilegeEscalation": True}),
        "spec.template.spec.containers[].securityContext.allowPrivilegeEscalation",
    ),
    (
        "capabilities",
        worker(securityContext={"capabilities": {"add": ["SYS_ADMIN"]}}),
        "spec.template.spec.containers[].securityContext.capabilities.add",
    ),
    (
        "root-pod",
        {"spec": {"securityContext": {"runAsUser": 0}}},
        "spec.template.spec.securityContext.runAsUser",
    ),
    (
        "unconfined",
        {"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
        "spec.template.spec.securityContext.seccompProfile.type",
    ),
    (
        "volume-name",
        {"spec": {"volumes": [{"name": "plan", "emptyDir": {}}]}},
        "spec.template.spec.volumes[].name",
    ),
    (
        "volume-hostpath",
        {"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/etc"}}]}},
        "spec.template.spec.volumes[].hostPath",
    ),
    (
        "sidecar-no-image",
        {"spec": {"containers": [{"name": "helper"}]}},
        "spec.template.spec.containers",
    ),
    (
        "init-named-worker",
        {"spec": {"initContainers": [{"name": "worker", "image": "busybox:1.36"}]}},
        "spec.template.spec.initContainers",
    ),
]

FULL: dict[str, Any] = {
    "rdmaResources": ["rdma/rail1"],
    "metadata": {
        "labels": {"kueue.x-k8s.io/queue-name": "gpu"},
        "annotations": {"k8s.v1.cni.cncf.io/networks": "sriov-rail0"},
    },
    "spec": {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a"]}]}
                    ]
                }
            },
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 10,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app": "x"}},
                        },
                    }
                ]
            },
        },
        "priorityClassName": "inference-high",
        "schedulerName": "default-scheduler",
        "runtimeClassName": "nvidia",
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "imagePullSecrets": [{"name": "registry-creds"}],
        "volumes": [
            {"name": "licenses", "secret": {"secretName": "licenses"}},
            {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}},
        ],
        "initContainers": [
            {
                "name": "warmup",
                "image": "busybox:1.36",
                "command": ["true"],
                "restartPolicy": "Always",
            }
        ],
        "containers": [
            {
                "name": "worker",
                "env": [
                    {
                        "name": "HF_TOKEN",
                        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
                    }
                ],
                "envFrom": [{"configMapRef": {"name": "tuning"}}],
                "volumeMounts": [{"name": "licenses", "mountPath": "/licenses"}],
                "resources": {"limits": {"example.com/fpga": 1, "memory": "64Gi"}},
                "securityContext": {"runAsUser": 2000},
            },
            {
                "name": "log-shipper",
                "image": "fluent/fluent-bit:3.1",
                "ports": [{"containerPort": 2020}],
                "readinessProbe": {"httpGet": {"path": "/", "port": "http"}},
            },
        ],
        "securityContext": {
            "fsGroup": 3000,
            "sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": "1024 65000"}],
        },
    },
}

# The cluster objects FULL names (its priorityClassName and runtimeClassName): the API server's
# Priority and RuntimeClass admission look them up, so a cluster test applies them first.
FULL_CLASSES: list[dict[str, Any]] = [
    {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": "inference-high"},
        "value": 1000,
    },
    {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": "nvidia"},
        "handler": "nvidia",
    },
]
