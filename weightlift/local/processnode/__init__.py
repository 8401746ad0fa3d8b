"""The process node: a tiny kubelet stand-in that runs pods as local processes.

There is no container runtime on a laptop/CI machine, so for local mode (`weightlift demo`, e2e
tests) this agent registers a Node that advertises GPUs it does not have, watches the pods the
real scheduler binds to it, and runs each container's command as a local process:

- pod IP: a distinct loopback address 127.0.x.y per pod (exported as POD_IP and
  WEIGHTLIFT_BIND_HOST so the worker binds there; Linux routes all of 127/8 to `lo`);
- env: the pod's env, `valueFrom.fieldRef` resolved (metadata.*, status.podIP, spec.nodeName...),
  configMap/secret keys read from the API, `$(VAR)` references expanded;
- volumes: hostPath -> the same path, persistentVolumeClaim -> its bound hostPath/local PV's
  directory, emptyDir -> a dir under the state dir, configMap/secret/
  projected -> files under the state dir; downwardAPI volumes as the kubelet writes them (each
  file a symlink through `..data` to a timestamped dir) and rewritten the same atomic way when
  the pod's labels or annotations change (`..data` swapped by a rename), never restarted; a
  mountPath that differs from the local dir is rewritten in env values (also inside JSON values
  such as WEIGHTLIFT_ASSIGNMENT) since there is no mount namespace (configMap volume files are
  written as they are: the worker checks their digest);
- probes: readiness/liveness (httpGet, tcpSocket, exec) as the pod declares them;
- status: phase, podIP(s), hostIP, containerStatuses (waiting/running/terminated, exit code and a
  log-tail message, ready, restartCount), Initialized/ContainersReady/Ready conditions, Ready
  only while every spec.readinessGates condition (set by a controller) is True, as the kubelet;
- restarts per restartPolicy with a capped backoff;
- deletion: SIGTERM to the process group, SIGKILL after the grace period, then the final delete
  with grace 0 (what the kubelet does);
- heartbeats: the node's Lease in kube-node-lease and its Ready condition stay fresh.

It is not a product feature beyond local mode, and says so on the Node (annotation and runtime
version). Processes die with the node (PR_SET_PDEATHSIG), so nothing outlives it.
"""

from weightlift.local.processnode.base import (
    DATA_LINK,
    LOCAL_NODE_LABEL,
    PROCESS_NODE_ANNOTATION,
    NodeConfig,
    write_atomic,
)
from weightlift.local.processnode.cli import node_command
from weightlift.local.processnode.node import ProcessNode
from weightlift.local.processnode.runner import PodRunner

__all__ = [
    "DATA_LINK",
    "LOCAL_NODE_LABEL",
    "PROCESS_NODE_ANNOTATION",
    "NodeConfig",
    "PodRunner",
    "ProcessNode",
    "node_command",
    "write_atomic",
]
