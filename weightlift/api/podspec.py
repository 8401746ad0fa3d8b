"""spec.template's pod-template parts: metadata and a PodSpec subset, in the Kubernetes API's own
schema (kubeschema.py), with the fields the operator owns refused at admission.

Shape: the flat fields (image, resources, env, nodeSelector, tolerations...) stay as they were;
`metadata {labels, annotations}` and `spec` (a PodSpec subset) take the rest, as KServe's
predictor does: a container named `worker` in `spec.containers` is the worker's overrides
(env, envFrom, volumeMounts, resources, securityContext); any other container is a sidecar.
Each refusal is a CEL rule (the API server) and the same check in Python (specs that never
passed admission), with one message naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from weightlift.api import limits
from weightlift.api.kubeschema import schema_of

WORKER_CONTAINER = "worker"
# The operator's volumes in a worker pod (operator/pods.py); a template volume may not reuse one.
WORKER_VOLUMES = (
    "dshm",
    "tmp",
    "plan",
    "peers",
    "model",
    "model-cache",
    "compile-store",
    "compile-store-shared",
)
# Where the operator mounts them: the worker's own mounts stay off these paths.
WORKER_MOUNT_ROOTS = (
    "/dev/shm",
    "/tmp",
    "/etc/weightlift",
    "/mnt/models",
    "/var/lib/weightlift",
    "/var/run/weightlift",
)
# Labels and annotations the operator and LeaderWorkerSet set and select on.
RESERVED_KEY_PREFIXES = ("weightlift.dev/", "leaderworkerset.sigs.k8s.io/")
RESERVED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/managed-by")
# What the worker container may take from the template; the rest (command, args, image, ports,
# probes, lifecycle...) is the operator's. Its image is spec.template.image.
WORKER_OVERRIDES = ("name", "env", "envFrom", "volumeMounts", "resources", "securityContext")
SIDECARS_MAX = 8
INIT_CONTAINERS_MAX = 8
VOLUMES_MAX = 32
PULL_SECRETS_MAX = 8
SPREAD_MAX = 8
METADATA_ITEMS = 64
ANNOTATION_VALUE_MAX = 8192

_CONTAINERS = "spec.template.spec.containers"
_WORKER = f"{_CONTAINERS}[name={WORKER_CONTAINER}]"


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _rule(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def worker_owned_fields() -> tuple[str, ...]:
    """Container fields the worker container may not set: every upstream field but the
    overrides."""
    props = schema_of("Container")["properties"]
    return tuple(sorted(p for p in props if p not in WORKER_OVERRIDES))


# ------------------------------------------------------------------ security: only tighten

# (field, the CEL test of a loosening value, the Python one, what is refused)
_LOOSENING: tuple[tuple[str, str, Any, str], ...] = (
    ("privileged", "== true", True, "privileged containers"),
    ("allowPrivilegeEscalation", "== true", True, "privilege escalation"),
    ("runAsNonRoot", "== false", False, "running as root"),
    ("runAsUser", "== 0", 0, "running as root"),
    ("procMount", "== 'Unmasked'", "Unmasked", "an unmasked /proc"),
)
_UNCONFINED = ("seccompProfile", "appArmorProfile")


def _security_rules(at: str, where: str, container: bool) -> list[dict[str, str]]:
    """Rules refusing what would loosen the worker pod's securityContext, at CEL path `at`
    (self.securityContext for a container, self for the pod's)."""
    rules: list[dict[str, str]] = []
    guard = "!has(self.securityContext) || " if container else ""
    rel = ".securityContext" if container else ""
    fields = _LOOSENING if container else _LOOSENING[2:4]
    for name, test, _, what in fields:
        rules.append(
            _rule(
                f"{guard}!has({at}.{name}) || !({at}.{name} {test})",
                f"{where}.{name}: {what} is refused; a template may only tighten the worker "
                "pod's security",
                f"{rel}.{name}",
            )
        )
    for name in _UNCONFINED:
        rules.append(
            _rule(
                f"{guard}!has({at}.{name}) || {at}.{name}.type != 'Unconfined'",
                f"{where}.{name}.type: Unconfined is refused; a template may only tighten the "
                "worker pod's security",
                f"{rel}.{name}.type",
            )
        )
    rules.append(
        _rule(
            f"{guard}!has({at}.windowsOptions) || !has({at}.windowsOptions.hostProcess) "
            f"|| !{at}.windowsOptions.hostProcess",
            f"{where}.windowsOptions.hostProcess: host processes are refused",
            f"{rel}.windowsOptions.hostProcess",
        )
    )
    if container:
        rules.append(
            _rule(
                f"{guard}!has({at}.capabilities) || !has({at}.capabilities.add) "
                f"|| size({at}.capabilities.add) == 0",
                f"{where}.capabilities.add: added capabilities are refused (the worker drops "
                "ALL; rdmaResource adds IPC_LOCK itself)",
                f"{rel}.capabilities.add",
            )
        )
    return rules


def _security_errors(sc: Mapping[str, Any] | None, where: str, container: bool) -> Iterator[str]:
    if not sc:
        return
    fields = _LOOSENING if container else _LOOSENING[2:4]
    for name, _, bad, what in fields:
        if name in sc and sc[name] == bad and type(sc[name]) is type(bad):
            yield (
                f"{where}.{name}: {what} is refused; a template may only tighten the worker "
                "pod's security"
            )
    for name in _UNCONFINED:
        if (sc.get(name) or {}).get("type") == "Unconfined":
            yield (
                f"{where}.{name}.type: Unconfined is refused; a template may only tighten the "
                "worker pod's security"
            )
    if (sc.get("windowsOptions") or {}).get("hostProcess") is True:
        yield f"{where}.windowsOptions.hostProcess: host processes are refused"
    if container and (sc.get("capabilities") or {}).get("add"):
        yield (
            f"{where}.capabilities.add: added capabilities are refused (the worker drops ALL; "
            "rdmaResource adds IPC_LOCK itself)"
        )


# ------------------------------------------------------------------------ containers


def _reserved_env_test(var: str) -> str:
    return " && ".join(f"!{var}.name.startsWith('{p}')" for p in limits.RESERVED_ENV_PREFIXES)


def _mount_test(var: str) -> str:
    roots = _cel_list(WORKER_MOUNT_ROOTS)
    return f"!({var}.mountPath in {roots}) && {roots}.all(r, !{var}.mountPath.startsWith(r + '/'))"


def _owned_message(name: str) -> str:
    return (
        f"{_WORKER}.{name}: the worker container's {name} is the operator's; the worker "
        f"container takes only {', '.join(WORKER_OVERRIDES[1:])} (its image is "
        "spec.template.image)"
    )


_ENV_MESSAGE = (
    f"{_WORKER}.env: names starting with {', '.join(limits.RESERVED_ENV_PREFIXES)} are reserved "
    "for the worker (its plan, bind address and the dynamic loader)"
)
_MOUNT_MESSAGE = (
    f"{_WORKER}.volumeMounts: mountPath may not be or lie under the operator's mounts "
    f"({', '.join(WORKER_MOUNT_ROOTS)})"
)
_READONLY_MESSAGE = (
    f"{_WORKER}.securityContext.readOnlyRootFilesystem: false is refused; the worker's root "
    "filesystem stays read-only"
)
_CLAIMS_MESSAGE = (
    f"{_WORKER}.resources.claims: DRA claims need the pod's resourceClaims, which a template "
    "does not set"
)
_SIDECAR_IMAGE_MESSAGE = f"{_CONTAINERS}: a sidecar (a container not named worker) needs an image"
_INIT_NAME_MESSAGE = "spec.template.spec.initContainers: the name worker is the worker container's"


def container_rules() -> list[dict[str, str]]:
    """Rules of one spec.template.spec.containers item."""
    worker = f"self.name != '{WORKER_CONTAINER}' || "
    rules = [
        _rule(f"{worker}!has(self.{name})", _owned_message(name), f".{name}")
        for name in worker_owned_fields()
    ]
    rules += [
        _rule(
            f"self.name == '{WORKER_CONTAINER}' || has(self.image)",
            _SIDECAR_IMAGE_MESSAGE,
            ".image",
        ),
        _rule(
            f"{worker}!has(self.env) || self.env.all(e, {_reserved_env_test('e')})",
            _ENV_MESSAGE,
            ".env",
        ),
        _rule(
            f"{worker}!has(self.volumeMounts) || self.volumeMounts.all(m, {_mount_test('m')})",
            _MOUNT_MESSAGE,
            ".volumeMounts",
        ),
        _rule(
            f"{worker}!has(self.securityContext) "
            "|| !has(self.securityContext.readOnlyRootFilesystem) "
            "|| self.securityContext.readOnlyRootFilesystem",
            _READONLY_MESSAGE,
            ".securityContext.readOnlyRootFilesystem",
        ),
        _rule(
            f"{worker}!has(self.resources) || !has(self.resources.claims)",
            _CLAIMS_MESSAGE,
            ".resources.claims",
        ),
    ]
    return rules + _security_rules("self.securityContext", f"{_CONTAINERS}[].securityContext", True)


def init_container_rules() -> list[dict[str, str]]:
    where = "spec.template.spec.initContainers[].securityContext"
    return [
        _rule(f"self.name != '{WORKER_CONTAINER}'", _INIT_NAME_MESSAGE, ".name"),
        *_security_rules("self.securityContext", where, True),
    ]


def _container_errors(c: Mapping[str, Any], init: bool) -> Iterator[str]:
    name = c.get("name")
    if init:
        if name == WORKER_CONTAINER:
            yield _INIT_NAME_MESSAGE
        yield from _security_errors(
            c.get("securityContext"), "spec.template.spec.initContainers[].securityContext", True
        )
        return
    if name == WORKER_CONTAINER:
        for owned in worker_owned_fields():
            if owned in c:
                yield _owned_message(owned)
        if any(
            str(e.get("name", "")).startswith(limits.RESERVED_ENV_PREFIXES)
            for e in c.get("env") or ()
        ):
            yield _ENV_MESSAGE
        for m in c.get("volumeMounts") or ():
            path = str(m.get("mountPath", ""))
            if any(path == r or path.startswith(r + "/") for r in WORKER_MOUNT_ROOTS):
                yield _MOUNT_MESSAGE
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is False:
            yield _READONLY_MESSAGE
        if "claims" in (c.get("resources") or {}):
            yield _CLAIMS_MESSAGE
    elif "image" not in c:
        yield _SIDECAR_IMAGE_MESSAGE
    yield from _security_errors(c.get("securityContext"), f"{_CONTAINERS}[].securityContext", True)


# ------------------------------------------------------------------ volumes and metadata

_VOLUME_NAME_MESSAGE = (
    f"spec.template.spec.volumes[].name: {', '.join(WORKER_VOLUMES)} are the worker's own volumes"
)
_HOSTPATH_MESSAGE = (
    "spec.template.spec.volumes[].hostPath: refused (a node directory bypasses the chart's "
    "model path policy); use a PVC, or spec.model.uri hostpath://"
)
VOLUME_RULES = [
    _rule(f"!(self.name in {_cel_list(WORKER_VOLUMES)})", _VOLUME_NAME_MESSAGE, ".name"),
    _rule("!has(self.hostPath)", _HOSTPATH_MESSAGE, ".hostPath"),
]
_NAME_CLASH_MESSAGE = (
    "spec.template.spec.initContainers: a name is used by spec.template.spec.containers too"
)
SPEC_RULES = [
    _rule(
        "!has(self.containers) || !has(self.initContainers) "
        "|| self.initContainers.all(i, !self.containers.exists(c, c.name == i.name))",
        _NAME_CLASH_MESSAGE,
        ".initContainers",
    )
]


def _reserved_key_test(kind: str) -> str:
    prefixes = " && ".join(f"!k.startsWith('{p}')" for p in RESERVED_KEY_PREFIXES)
    if kind == "labels":
        return f"{prefixes} && !(k in {_cel_list(RESERVED_LABELS)})"
    return prefixes


def reserved_key_message(kind: str) -> str:
    owned = [p + "*" for p in RESERVED_KEY_PREFIXES]
    if kind == "labels":
        owned += list(RESERVED_LABELS)
    return f"spec.template.metadata.{kind}: {', '.join(owned)} are the operator's"


def _is_reserved_key(key: str, kind: str) -> bool:
    return key.startswith(RESERVED_KEY_PREFIXES) or (kind == "labels" and key in RESERVED_LABELS)


def metadata_rules(kind: str) -> list[dict[str, str]]:
    return [_rule(f"self.all(k, {_reserved_key_test(kind)})", reserved_key_message(kind))]


def metadata_extra(kind: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": metadata_rules(kind)}


def template_errors(
    metadata: Mapping[str, Any] | None, spec: Mapping[str, Any] | None
) -> list[str]:
    """The CEL rules' refusals, in Python: what admission would say of this template."""
    errors: list[str] = []
    for kind in ("labels", "annotations"):
        if any(_is_reserved_key(k, kind) for k in (metadata or {}).get(kind) or {}):
            errors.append(reserved_key_message(kind))
    spec = spec or {}
    for v in spec.get("volumes") or ():
        if v.get("name") in WORKER_VOLUMES:
            errors.append(_VOLUME_NAME_MESSAGE)
        if "hostPath" in v:
            errors.append(_HOSTPATH_MESSAGE)
    for c in spec.get("containers") or ():
        errors += _container_errors(c, init=False)
    for c in spec.get("initContainers") or ():
        errors += _container_errors(c, init=True)
    names = {c.get("name") for c in spec.get("containers") or ()}
    if any(c.get("name") in names for c in spec.get("initContainers") or ()):
        errors.append(_NAME_CLASH_MESSAGE)
    errors += _security_errors(
        spec.get("securityContext"), "spec.template.spec.securityContext", False
    )
    return list(dict.fromkeys(errors))


# ------------------------------------------------------------------------ pydantic types

KUBERNETES_SCHEMA = "x-weightlift-kubernetes"  # crd.py inlines the named core/v1 type here


def kube(kind: str, *rules: dict[str, str], **extra: Any) -> WithJsonSchema:
    schema: dict[str, Any] = {KUBERNETES_SCHEMA: kind, **extra}
    if rules:
        schema["x-kubernetes-validations"] = list(rules)
    return WithJsonSchema(schema)


Json = dict[str, Any]
Affinity = Annotated[Json, kube("Affinity")]
SpreadConstraint = Annotated[Json, kube("TopologySpreadConstraint")]
PullSecret = Annotated[Json, kube("LocalObjectReference")]
Volume = Annotated[Json, kube("Volume", *VOLUME_RULES)]
PodSecurityContext = Annotated[
    Json,
    kube(
        "PodSecurityContext", *_security_rules("self", "spec.template.spec.securityContext", False)
    ),
]
Sidecar = Annotated[Json, kube("Container", *container_rules())]
InitContainer = Annotated[Json, kube("Container", *init_container_rules())]
DnsSubdomain = Annotated[
    str, Field(max_length=limits.DNS_SUBDOMAIN_MAX, pattern=limits.DNS_SUBDOMAIN)
]
