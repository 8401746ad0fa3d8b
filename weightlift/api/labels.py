"""Labels and name limits shared by the operator (writes them) and the local stack (reads them)."""

from __future__ import annotations

DEPLOYMENT_LABEL = "weightlift.dev/deployment"
IDENTITY_LABEL = "weightlift.dev/identity"
ROLE_LABEL = "weightlift.dev/role"
REPLICA_LABEL = "weightlift.dev/replica"
PEERS_ANNOTATION = "weightlift.dev/peers"
# On a warm spare while it waits (value "true"); the operator removes it when it hands the spare
# peers or storage. The scale subresource's selector leaves pods with it out.
SPARE_LABEL = "weightlift.dev/spare"
# On a worker pod once it is a serving replica: handed its weights (a Source, or a Target handed
# peers or storage), not a warm spare. The ModelDeployment's Service selects it (with the
# deployment label); the readiness gate below keeps it out of the ready endpoints until probed.
SERVING_LABEL = "weightlift.dev/serving"
# The readiness gate of every worker pod (spec.readinessGates, KEP-580): the operator sets the pod
# condition of this type True once the replica's inference probe passed, False when it stops
# passing, so the pod's Ready (and a Service's ready endpoints) means "probed", not "loaded".
INFERENCE_PROBE_GATE = "weightlift.dev/inference-probe"
# Set with the label's removal: when the spare was woken (RFC 3339). Its time to Ready counts
# from then, not from the pod's creation (a spare may wait for hours, by design).
WOKEN_ANNOTATION = "weightlift.dev/woken-at"
# On worker pods and plan ConfigMaps: the first characters of the plan's sha256.
PLAN_LABEL = "weightlift.dev/plan"
# On worker pods: the pod template revision they were made from (operator/identity.py
# pod_template_revision), as a Deployment's pods carry pod-template-hash. A pod of another
# revision is rolled over; one without the label (made by an older version) is adopted.
TEMPLATE_LABEL = "weightlift.dev/pod-template"
# The CRD's selectableFields (field selectors, Kubernetes 1.32+). A reconcile finds the
# ModelDeployments that publish Ready sources of one model identity with a field-selected LIST
# (published_sources_selector): status.sources, readySources (their count) and modelIdentity go
# in one status write, so a selected read never misses a source, and publishing costs no request
# of its own (the weightlift.dev/sources-of label it replaces was one more patch per deployment).
SELECTABLE_FIELDS = (".status.modelIdentity", ".status.readySources")


def published_sources_selector(identity: str) -> str:
    """Field selector of the ModelDeployments publishing sources of `identity`."""
    return f"status.modelIdentity={identity},status.readySources!=0"


# On the operator's leader-election Lease: when its holder finished its first reconcile pass
# (MicroTime); cleared when the Lease changes hands. Tells how long a takeover took.
FIRST_RECONCILE_ANNOTATION = "weightlift.dev/first-reconcile-time"

# Multi-pod replicas (spec.parallelism.podsPerReplica > 1) run as one LeaderWorkerSet per
# revision (sigs.k8s.io/lws); its pods carry these labels (set by LWS), and ours carry the
# ModelDeployment's uid, since their owner is LWS's StatefulSet, not the ModelDeployment.
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_API_VERSION = "v1"
LWS_PLURAL = "leaderworkersets"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
DEPLOYMENT_UID_LABEL = "weightlift.dev/deployment-uid"

MANAGED_BY = {"app.kubernetes.io/managed-by": "weightlift"}
WORKER_LABELS = {"app.kubernetes.io/name": "weightlift-worker", **MANAGED_BY}

# Pod names (<name>-<identity6>-<replica>) and label values must stay within 63 characters.
MAX_NAME_LENGTH = 50
