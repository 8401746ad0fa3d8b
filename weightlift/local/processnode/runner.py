"""One pod on the process node: its containers as local processes (command, env, volumes,
probes, restarts), its status written back to the API server, its deletion done as a kubelet
does it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx
from kubernetes.client.exceptions import ApiException

from weightlift.api.times import now_rfc3339
from weightlift.local.kube import JSON, KUBE_ERRORS, STRATEGIC, call, delete, describe, get_or_none
from weightlift.local.podidentity import (
    MountError,
    in_root,
    inside,
    kubernetes_service_env,
    prepare_mountpoints,
    real_mounts,
    with_mounts,
)
from weightlift.local.processnode.base import (
    LOG_TAIL_BYTES,
    MAX_BACKOFF_SECONDS,
    RUNTIME_VERSION,
    ConfigError,
    ContainerRun,
    PodHost,
    ProbeState,
    expand,
    map_strings,
    pod_process,
    refuse_nul,
    write_atomic,
)
from weightlift.local.procs import signal_group, stop_group
from weightlift.worker.p2p import faultgate

# PATH of a container of a mapped image (the OCI default; both Dockerfile targets use it).
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

log = logging.getLogger("weightlift.processnode")
# The kubelet's reason for a pod whose containers are ready but a readiness gate is not.
GATES_NOT_READY = "ReadinessGatesNotReady"


class PodRunner(threading.Thread):
    """Owns one pod (by uid): starts its containers, probes them, writes status, tears down."""

    def __init__(self, node: PodHost, pod: JSON, pod_ip: str) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}-{meta['name']}", daemon=True)
        self.node = node
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.pod_ip = pod_ip
        self._pod = pod
        self._lock = threading.Lock()
        self._gone = threading.Event()  # the API object is gone (force delete)
        self._wake = threading.Event()
        self.dir = (
            node.config.state_dir / "pods" / f"{self.namespace}_{self.pod_name}_{self.uid[:8]}"
        )
        self.containers: list[ContainerRun] = []
        self.start_time = now_rfc3339()
        self._last_status: JSON | None = None
        self._config_error: str | None = None
        self.finished = threading.Event()
        self.deleted = False  # finalized: the API object was deleted by us
        self.mounts: list[tuple[str, str]] = []
        # downwardAPI volumes: dir -> (items, the data last written), refreshed on pod updates
        self._downward: dict[Path, tuple[list[JSON], dict[str, str]]] = {}

    # -- inputs from the node's watch
    def update(self, pod: JSON) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def gone(self) -> None:
        self._gone.set()
        self._wake.set()

    @property
    def pod(self) -> JSON:
        with self._lock:
            return self._pod

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.containers if c.proc is not None and c.running]

    # -- main loop
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod %s/%s: runner crashed", self.namespace, self.pod_name)
            self._kill_all(grace=2.0)
        finally:
            self.finished.set()
            self.node.runner_done(self.uid, self, self._gone.is_set() or self.deleted)

    def _run(self) -> None:
        pod = self.pod
        if pod["metadata"].get("deletionTimestamp"):
            self._finalize(pod)
            return
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return  # terminal from an earlier node incarnation: nothing to run
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        self.containers = [
            ContainerRun(spec=c, log_path=self.dir / f"{c['name']}.log") for c in spec["containers"]
        ]
        for c in self.containers:
            c.waiting = {"reason": "ContainerCreating"}
        self._write_status()
        try:
            self.mounts = self._mount_volumes(pod)
            self._run_init_containers(pod)
        except ConfigError as exc:
            self._config_error = str(exc)
            for c in self.containers:
                c.waiting = {"reason": "CreateContainerConfigError", "message": str(exc)}
            self.node.event(pod, "Warning", "Failed", str(exc))
        while not self.node.stopping.is_set():
            if self._gone.is_set():
                self._kill_all(grace=self._grace(self.pod))
                return
            pod = self.pod
            if pod["metadata"].get("deletionTimestamp"):
                self._finalize(pod)
                return
            if self._config_error is None:
                self._refresh_downward(pod)
                self._tick(pod)
            self._write_status()
            self._wake.wait(0.25)
            self._wake.clear()
        # The node is stopping: kill our processes, leave the API object to the cluster.
        self._kill_all(grace=min(self._grace(pod), 10.0))

    # -- containers
    def _tick(self, pod: JSON) -> None:
        policy = pod["spec"].get("restartPolicy", "Always")
        now = time.monotonic()
        for c in self.containers:
            if c.proc is None and c.terminated is None:
                if now >= c.restart_at:
                    self._start(pod, c)
                continue
            if c.proc is not None and c.proc.poll() is not None:
                self._on_exit(pod, c)
            if c.proc is None and c.terminated is not None:
                exit_code = int(c.terminated.get("exitCode", 1))
                again = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
                if again and now >= c.restart_at:
                    c.last_terminated, c.terminated = c.terminated, None
                    c.restart_count += 1
                    self._start(pod, c)
                elif again:
                    c.waiting = {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off {c.backoff:.0f}s restarting failed container",
                    }
            if c.running:
                self._probe(pod, c, now)

    def _start(self, pod: JSON, c: ContainerRun) -> None:
        try:
            argv, env, cwd = self._command(pod, c.spec)
        except ConfigError as exc:
            c.waiting = {"reason": "CreateContainerConfigError", "message": str(exc)}
            c.restart_at = time.monotonic() + 5.0
            return
        # terminationMessagePath (default /dev/termination-log) lives in the pod dir; the worker
        # writes it where WEIGHTLIFT_TERMINATION_LOG says.
        term = self._termination_log(c)
        term.write_text("")
        env.setdefault("WEIGHTLIFT_TERMINATION_LOG", str(term))
        with c.log_path.open("ab") as out:
            out.write(f"--- {now_rfc3339()} start {argv}\n".encode())
            out.flush()
            try:
                c.proc = subprocess.Popen(argv, **self._process_options(c, out, cwd, env))
            except (OSError, MountError, subprocess.SubprocessError) as exc:
                c.proc = None
                c.terminated = {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": f"{argv[0]}: {exc}",
                    "startedAt": now_rfc3339(),
                    "finishedAt": now_rfc3339(),
                }
                c.restart_at = time.monotonic() + c.backoff
                c.backoff = min(c.backoff * 2, MAX_BACKOFF_SECONDS)
                return
        c.started_at = now_rfc3339()
        c.started_mono = time.monotonic()
        c.waiting = None
        c.readiness = ProbeState(
            next_at=c.started_mono + self._probe_delay(c.spec, "readinessProbe")
        )
        c.liveness = ProbeState(next_at=c.started_mono + self._probe_delay(c.spec, "livenessProbe"))
        log.info(
            "pod %s/%s: %s started pid %d on %s",
            self.namespace,
            self.pod_name,
            c.name,
            c.proc.pid,
            self.pod_ip,
        )
        self.node.event(pod, "Normal", "Started", f"Started container {c.name} (pid {c.proc.pid})")

    def _process_options(
        self, c: ContainerRun, out: IO[bytes], cwd: str, env: dict[str, str]
    ) -> dict[str, Any]:
        """Popen options of a container's process; mounts below /var/run/secrets (the
        ServiceAccount token) are bind-mounted there in a mount namespace of its own."""
        options = pod_process(out, cwd, env)
        binds = real_mounts(c.spec, self._translate)
        if self._image_root(c.spec) is not None:
            return self._in_image(c.spec, options, binds)
        if binds:
            prepare_mountpoints(binds)
            options["preexec_fn"] = with_mounts(options["preexec_fn"], binds)
        return options

    def _image_root(self, spec: JSON) -> Path | None:
        return self.node.config.image_roots.get(spec.get("image", ""))

    def _in_image(
        self, spec: JSON, options: dict[str, Any], binds: list[tuple[str, str]]
    ) -> dict[str, Any]:
        """Popen options that run the process chrooted in its image's root filesystem (a
        mapped image; `options` unchanged otherwise), `binds` mounted inside it."""
        root = self._image_root(spec)
        if root is None:
            return options
        binds = [(source, str(inside(root, target))) for source, target in binds]
        prepare_mountpoints(binds)
        workdir = options["cwd"]  # the container's path (_command_in_image)
        options["preexec_fn"] = in_root(options["preexec_fn"], str(root), binds, workdir)
        options["cwd"] = str(root)  # Popen changes directory before the chroot
        return options

    def _on_exit(self, pod: JSON, c: ContainerRun) -> None:
        assert c.proc is not None
        code = c.proc.returncode
        exit_code = 128 + (-code) if code < 0 else code
        message = self._termination_message(c) if exit_code != 0 or code < 0 else ""
        c.terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": f"process://{c.proc.pid}",
        }
        if code < 0:
            c.terminated["signal"] = -code
        if message:
            c.terminated["message"] = message
        c.proc = None
        c.readiness.ok = False
        # Backoff resets after a container ran for a while (like the kubelet's 10 min, scaled).
        if time.monotonic() - c.started_mono > 60:
            c.backoff = 1.0
        c.restart_at = time.monotonic() + c.backoff
        c.backoff = min(c.backoff * 2, MAX_BACKOFF_SECONDS)
        log.info("pod %s/%s: %s exited %d", self.namespace, self.pod_name, c.name, exit_code)

    def _termination_log(self, c: ContainerRun) -> Path:
        return self.dir / f"{c.name}.termination-log"

    def _termination_message(self, c: ContainerRun) -> str:
        """The container's termination message file, else (FallbackToLogsOnError) its log tail."""
        with contextlib.suppress(OSError):
            written = self._termination_log(c).read_text(errors="replace").strip()
            if written:
                return written[:4096]
        if c.spec.get("terminationMessagePolicy", "File") != "FallbackToLogsOnError":
            return ""
        try:
            with c.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - LOG_TAIL_BYTES))
                tail = f.read().decode(errors="replace")
        except OSError:
            return ""
        # Only this run's output: cut at the last start marker.
        marker = tail.rfind("--- ")
        if marker >= 0 and "start [" in tail[marker:].split("\n", 1)[0]:
            tail = tail[marker:].split("\n", 1)[1] if "\n" in tail[marker:] else ""
        lines = [ln for ln in tail.strip().splitlines() if ln.strip()]
        return "\n".join(lines[-20:])

    def _mount_volumes(self, pod: JSON) -> list[tuple[str, str]]:
        """`_prepare_volumes`, retried as the kubelet retries a mount (a ConfigMap or a token
        that is not there yet: the namespace's kube-root-ca.crt is published moments after
        the namespace), for up to a minute; then the last error stands."""
        deadline, delay, warned = time.monotonic() + 60.0, 0.5, False
        while True:
            try:
                return self._prepare_volumes(pod)
            except ConfigError as exc:
                stop = self.node.stopping.is_set() or self._gone.is_set()
                if (
                    stop
                    or time.monotonic() > deadline
                    or self.pod["metadata"].get("deletionTimestamp")
                ):
                    raise
                if not warned:
                    self.node.event(pod, "Warning", "FailedMount", str(exc))
                    warned = True
            self._wake.wait(delay)
            delay = min(delay * 2, 8.0)

    def _run_init_containers(self, pod: JSON) -> None:
        for spec in pod["spec"].get("initContainers", []):
            argv, env, cwd = self._command(pod, spec)
            with (self.dir / f"init-{spec['name']}.log").open("ab") as out:
                options = self._in_image(spec, pod_process(out, cwd, env), [])
                proc = subprocess.run(argv, timeout=600, check=False, **options)
            if proc.returncode != 0:
                raise ConfigError(f"init container {spec['name']} exited {proc.returncode}")

    # -- command, env and volumes
    def _resolve_exe(self, exe: str) -> str:
        if "/" in exe:
            return self._translate(exe)
        local = self.node.config.bin_dir / exe
        if local.exists():
            return str(local)
        found = shutil.which(exe)
        if found is None:
            raise ConfigError(f"executable {exe!r} not found in {self.node.config.bin_dir} or PATH")
        return found

    def _command(self, pod: JSON, spec: JSON) -> tuple[list[str], dict[str, str], str]:
        env = self._env(pod, spec)
        argv = [expand(a, env) for a in [*spec.get("command", []), *spec.get("args", [])]]
        refuse_nul(spec["name"], argv, env)
        if not argv:
            raise ConfigError(
                f"container {spec['name']} has no command: the process node cannot run an "
                "image's entrypoint"
            )
        root = self._image_root(spec)
        if root is not None:
            return self._command_in_image(root, spec, argv, env)
        argv = [self._resolve_exe(argv[0]), *argv[1:]]
        wd = spec.get("workingDir")
        cwd = self._translate(wd) if wd else str(self.dir)
        if not Path(cwd).is_dir():
            raise ConfigError(f"workingDir {wd} does not exist locally ({cwd})")
        return argv, env, cwd

    @staticmethod
    def _command_in_image(
        root: Path, spec: JSON, argv: list[str], env: dict[str, str]
    ) -> tuple[list[str], dict[str, str], str]:
        """argv, env and working directory as the image sees them: its PATH, none of this
        installation's paths (PYTHONPATH, TMPDIR)."""
        env["PATH"] = IMAGE_PATH
        for name in ("PYTHONPATH", "TMPDIR"):
            env.pop(name, None)
        exe = argv[0]
        if "/" not in exe:
            found = [f"{d}/{exe}" for d in IMAGE_PATH.split(":")]
            runnable = [p for p in found if os.access(inside(root, p), os.X_OK)]
            if not runnable:
                raise ConfigError(f"executable {exe!r} not found in image {spec['image']} ({root})")
            exe = runnable[0]
        wd = spec.get("workingDir") or "/"
        if not inside(root, wd).is_dir():
            raise ConfigError(f"workingDir {wd} does not exist in image {spec['image']}")
        return [exe, *argv[1:]], env, wd

    def _env(self, pod: JSON, spec: JSON) -> dict[str, str]:
        cfg = self.node.config
        env: dict[str, str] = {k: os.environ[k] for k in cfg.passthrough_env if k in os.environ}
        env["PATH"] = f"{cfg.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        env["HOSTNAME"] = self.pod_name
        env["PYTHONUNBUFFERED"] = "1"
        env.update(kubernetes_service_env(self.node.kube.server))
        env.update(cfg.extra_env)
        ns = self.namespace
        for src in spec.get("envFrom", []):
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                data = self._configmap(ns, src["configMapRef"]["name"], src["configMapRef"])
            elif "secretRef" in src:
                data = self._secret(ns, src["secretRef"]["name"], src["secretRef"])
            else:
                continue
            env.update({prefix + k: v for k, v in data.items()})
        for item in spec.get("env", []):
            name = item["name"]
            if "valueFrom" not in item:
                env[name] = self._translate_value(expand(item.get("value", ""), env))
                continue
            vf = item["valueFrom"]
            if "fieldRef" in vf:
                env[name] = self._field(pod, vf["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                is_map = "configMapKeyRef" in vf
                ref = vf["configMapKeyRef" if is_map else "secretKeyRef"]
                data = (self._configmap if is_map else self._secret)(ns, ref["name"], ref)
                if ref["key"] in data:
                    env[name] = data[ref["key"]]
                elif not ref.get("optional"):
                    kind = "configmap" if is_map else "secret"
                    raise ConfigError(f"{kind} {ref['name']} has no key {ref['key']}")
            elif "resourceFieldRef" in vf:
                env[name] = self._resource(spec, vf["resourceFieldRef"]["resource"])
        # The loopback address this pod owns; the worker binds its servers there.
        env.setdefault("POD_IP", self.pod_ip)
        env.setdefault("WEIGHTLIFT_BIND_HOST", self.pod_ip)
        env.setdefault("WEIGHTLIFT_POD_IP", self.pod_ip)
        env.setdefault(faultgate.PROCESS_NODE_ENV, self.node.config.name)
        # Where the chaos harness arms a hold on a pull (worker/p2p/faultgate.py): local only.
        env.setdefault(faultgate.GATE_DIR_ENV, str(self.node.fault_gate_dir))
        return env

    def _field(self, pod: JSON, path: str) -> str:
        meta = pod["metadata"]
        simple = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": self.node.config.name,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            "status.podIP": self.pod_ip,
            "status.podIPs": self.pod_ip,
            "status.hostIP": self.node.host_ip,
            "status.hostIPs": self.node.host_ip,
        }
        if path in simple:
            return str(simple[path])
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            return str(meta.get(m.group(1), {}).get(m.group(2), ""))
        raise ConfigError(f"unsupported fieldRef {path}")

    def _resource(self, spec: JSON, resource: str) -> str:
        res = spec.get("resources", {})
        kind, _, name = resource.partition(".")
        value = res.get(kind, {}).get(name)
        return str(value) if value is not None else "0"

    def _configmap(self, ns: str, name: str, ref: JSON) -> dict[str, str]:
        obj = get_or_none(self.node.kube.core.read_namespaced_config_map, name, ns)
        if obj is None:
            if ref.get("optional"):
                return {}
            raise ConfigError(f"configmap {ns}/{name} not found")
        data: dict[str, str] = obj.get("data", {})
        return data

    def _secret(self, ns: str, name: str, ref: JSON) -> dict[str, str]:
        import base64

        obj = get_or_none(self.node.kube.core.read_namespaced_secret, name, ns)
        if obj is None:
            if ref.get("optional"):
                return {}
            raise ConfigError(f"secret {ns}/{name} not found")
        return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}

    def _prepare_volumes(self, pod: JSON) -> list[tuple[str, str]]:
        """Map each volume to a local dir; return (mountPath, localPath) pairs, longest first."""
        local: dict[str, Path] = {}
        vol_root = self.dir / "volumes"
        for vol in pod["spec"].get("volumes", []):
            name = vol["name"]
            if "hostPath" in vol:
                hp = vol["hostPath"]
                path = Path(hp["path"])
                if hp.get("type") in ("DirectoryOrCreate",):
                    path.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    raise ConfigError(f"hostPath {path} (volume {name}) does not exist")
                local[name] = path
            elif "persistentVolumeClaim" in vol:
                local[name] = self._claim_dir(vol["persistentVolumeClaim"]["claimName"], name)
            elif "emptyDir" in vol:
                local[name] = vol_root / name
                local[name].mkdir(parents=True, exist_ok=True)
            elif "configMap" in vol or "secret" in vol:
                src = vol.get("configMap") or vol["secret"]
                ref = {"optional": src.get("optional", False)}
                data = (
                    self._configmap(self.namespace, src["name"], ref)
                    if "configMap" in vol
                    else self._secret(self.namespace, src["secretName"], ref)
                )
                local[name] = self._write_files(vol_root / name, data, src.get("items"))
            elif "projected" in vol:
                local[name] = self._projected(pod, vol_root / name, vol["projected"])
            elif "downwardAPI" in vol:
                items = vol["downwardAPI"].get("items", [])
                data = self._downward_data(pod, items)
                local[name] = write_atomic(vol_root / name, data)
                self._downward[local[name]] = (items, data)
            else:
                kind = next((k for k in vol if k != "name"), "?")
                raise ConfigError(f"volume {name}: {kind} volumes are not supported locally")
        mounts: list[tuple[str, str]] = []
        for c in [*pod["spec"]["containers"], *pod["spec"].get("initContainers", [])]:
            for vm in c.get("volumeMounts", []):
                if vm["name"] not in local:
                    raise ConfigError(f"volumeMount {vm['name']} names no volume")
                base = local[vm["name"]]
                target = base / vm["subPath"] if vm.get("subPath") else base
                pair = (vm["mountPath"].rstrip("/") or "/", str(target))
                # Identity pairs stay in the table: /tmp/x/model mounted at itself must win
                # over a /tmp emptyDir mount (longest mountPath first).
                if pair not in mounts:
                    mounts.append(pair)
        mounts.sort(key=lambda p: len(p[0]), reverse=True)
        return mounts

    def _claim_dir(self, claim: str, volume: str) -> Path:
        """The directory behind a PVC: its bound PV must be hostPath or local (no mounts here;
        the real PV controller did the binding, the real scheduler waited for it)."""
        ns, core = self.namespace, self.node.kube.core
        pvc = get_or_none(core.read_namespaced_persistent_volume_claim, claim, ns)
        if pvc is None:
            raise ConfigError(f"volume {volume}: persistentvolumeclaim {ns}/{claim} not found")
        pv_name = pvc.get("spec", {}).get("volumeName")
        if pvc.get("status", {}).get("phase") != "Bound" or not pv_name:
            raise ConfigError(f"volume {volume}: persistentvolumeclaim {ns}/{claim} is not bound")
        pv = get_or_none(core.read_persistent_volume, pv_name)
        if pv is None:
            raise ConfigError(f"volume {volume}: persistentvolume {pv_name} not found")
        source = pv["spec"].get("hostPath") or pv["spec"].get("local")
        if source is None:
            raise ConfigError(
                f"volume {volume}: persistentvolume {pv_name} is not hostPath or local; "
                "the process node can only use directories"
            )
        path = Path(source["path"])
        if not path.is_dir():
            raise ConfigError(
                f"volume {volume}: persistentvolume {pv_name} path {path} is not a directory"
            )
        return path

    def _write_files(self, root: Path, data: dict[str, str], items: list[JSON] | None) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        paths = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
        for key, rel in paths.items():
            if key in data:
                out = root / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(data[key])
        return root

    def _downward_data(self, pod: JSON, items: list[JSON]) -> dict[str, str]:
        return {
            i["path"]: self._field(pod, i["fieldRef"]["fieldPath"])
            for i in items
            if "fieldRef" in i
        }

    def _refresh_downward(self, pod: JSON) -> None:
        """What the kubelet does for downwardAPI volumes when the pod changes: rewrite the files
        whose labels or annotations changed, atomically (a reader sees old or new, never half)."""
        for root, (items, written) in list(self._downward.items()):
            data = self._downward_data(pod, items)
            if data != written:
                write_atomic(root, data)
                self._downward[root] = (items, data)

    def _projected(self, pod: JSON, root: Path, projected: JSON) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        for source in projected.get("sources", []):
            if "configMap" in source:
                cm = source["configMap"]
                data = self._configmap(self.namespace, cm["name"], cm)
                self._write_files(root, data, cm.get("items"))
            elif "secret" in source:
                sec = source["secret"]
                data = self._secret(self.namespace, sec["name"], sec)
                self._write_files(root, data, sec.get("items"))
            elif "downwardAPI" in source:
                data = {
                    i["path"]: self._field(pod, i["fieldRef"]["fieldPath"])
                    for i in source["downwardAPI"].get("items", [])
                    if "fieldRef" in i
                }
                self._write_files(root, data, None)
            elif "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                sa = pod["spec"].get("serviceAccountName", "default")
                body: JSON = {
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenRequest",
                    "spec": {
                        "expirationSeconds": sat.get("expirationSeconds", 3607),
                        "boundObjectRef": {
                            "kind": "Pod",
                            "apiVersion": "v1",
                            "name": self.pod_name,
                            "uid": self.uid,
                        },
                        **({"audiences": [sat["audience"]]} if sat.get("audience") else {}),
                    },
                }
                create = self.node.kube.core.create_namespaced_service_account_token
                try:
                    tr = call(create, sa, self.namespace, body)
                    (root / sat.get("path", "token")).write_text(tr["status"]["token"])
                except KUBE_ERRORS as exc:
                    raise ConfigError(f"service account {sa}: no token: {describe(exc)}") from exc
        return root

    def _translate(self, path: str) -> str:
        for mount_path, local in self.mounts:
            if path == mount_path or path.startswith(mount_path + "/"):
                return local + path[len(mount_path) :]
        return path

    def _translate_value(self, value: str) -> str:
        """Rewrite container paths in an env value; JSON values are walked string by string."""
        if all(mp == local for mp, local in self.mounts):
            return value
        stripped = value.lstrip()
        if stripped[:1] in ("{", "["):
            try:
                doc = json.loads(value)
            except ValueError:
                return self._translate(value)
            return json.dumps(map_strings(doc, self._translate), separators=(",", ":"))
        return self._translate(value)

    # -- probes
    @staticmethod
    def _probe_delay(spec: JSON, kind: str) -> float:
        probe = spec.get(kind) or {}
        return float(probe.get("initialDelaySeconds", 0))

    def _probe(self, pod: JSON, c: ContainerRun, now: float) -> None:
        rp = c.spec.get("readinessProbe")
        if rp is None:
            c.readiness.ok = True
        elif now >= c.readiness.next_at:
            c.readiness.next_at = now + float(rp.get("periodSeconds", 10))
            ok, why = self._run_probe(c, rp)
            st = c.readiness
            if ok:
                st.successes, st.failures = st.successes + 1, 0
                if st.successes >= int(rp.get("successThreshold", 1)):
                    st.ok = True
            else:
                st.successes, st.failures = 0, st.failures + 1
                if st.failures >= int(rp.get("failureThreshold", 3)):
                    if st.ok:
                        self.node.event(pod, "Warning", "Unhealthy", f"Readiness probe: {why}")
                    st.ok = False
        lp = c.spec.get("livenessProbe")
        if lp is not None and now >= c.liveness.next_at:
            c.liveness.next_at = now + float(lp.get("periodSeconds", 10))
            ok, why = self._run_probe(c, lp)
            if ok:
                c.liveness.failures = 0
            else:
                c.liveness.failures += 1
                if c.liveness.failures >= int(lp.get("failureThreshold", 3)):
                    self.node.event(pod, "Warning", "Unhealthy", f"Liveness probe: {why}")
                    self._kill(c, grace=float(pod["spec"].get("terminationGracePeriodSeconds", 30)))

    def _port(self, c: ContainerRun, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ConfigError(f"container {c.name} has no port named {port}")

    def _run_probe(self, c: ContainerRun, probe: JSON) -> tuple[bool, str]:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                hg = probe["httpGet"]
                scheme = hg.get("scheme", "HTTP").lower()
                host = hg.get("host") or self.pod_ip
                url = f"{scheme}://{host}:{self._port(c, hg['port'])}{hg.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in hg.get("httpHeaders", [])}
                r = httpx.get(url, headers=headers, timeout=timeout, verify=False)
                return (
                    200 <= r.status_code < 400,
                    f"HTTP probe failed with statuscode: {r.status_code}",
                )
            if "tcpSocket" in probe:
                ts = probe["tcpSocket"]
                host = ts.get("host") or self.pod_ip
                with socket.create_connection((host, self._port(c, ts["port"])), timeout=timeout):
                    return True, ""
            if "exec" in probe:
                argv, env, cwd = self._command(
                    self.pod, {**c.spec, "command": probe["exec"]["command"], "args": []}
                )
                res = subprocess.run(
                    argv, env=env, cwd=cwd, timeout=timeout, capture_output=True, check=False
                )
                return res.returncode == 0, res.stdout.decode(errors="replace")[-200:]
            if "grpc" in probe:
                return False, "grpc probes are not supported by the process node"
        except (httpx.HTTPError, OSError, subprocess.TimeoutExpired, ConfigError) as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return True, ""

    # -- teardown
    @staticmethod
    def _grace(pod: JSON) -> float:
        meta_grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if meta_grace is not None:
            return float(meta_grace)
        return float(pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _kill(self, c: ContainerRun, grace: float) -> None:
        if c.proc is None:
            return
        stop_group(c.proc, grace)
        self._on_exit(self.pod, c)

    def _kill_all(self, grace: float) -> None:
        running = [c for c in self.containers if c.proc is not None]
        for c in running:
            if c.proc is not None:
                signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in running:
            self._kill(c, grace=max(0.0, deadline - time.monotonic()))

    def _finalize(self, pod: JSON) -> None:
        """Graceful deletion: stop the processes, report it, delete the object with grace 0."""
        if any(c.proc is not None for c in self.containers):
            self.node.event(pod, "Normal", "Killing", "Stopping container(s)")
        self._kill_all(grace=self._grace(pod))
        with contextlib.suppress(*KUBE_ERRORS):
            self._write_status()
        options = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        try:
            delete(
                self.node.kube.core.delete_namespaced_pod,
                self.pod_name,
                self.namespace,
                body=options,
            )
        except ApiException as exc:
            if exc.status != 409:  # 409: a newer pod with this name; ours is already gone
                log.warning("pod %s: final delete failed: %s", self.pod_name, describe(exc))
        self.deleted = True
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir / "volumes")

    # -- status
    def _status(self) -> JSON:
        pod = self.pod
        policy = pod["spec"].get("restartPolicy", "Always")
        statuses: list[JSON] = []
        for c in self.containers:
            st: JSON = {
                "name": c.name,
                "image": c.spec.get("image", ""),
                "imageID": RUNTIME_VERSION,
                "restartCount": c.restart_count,
                "ready": bool(c.running and c.readiness.ok),
                "started": c.running,
            }
            if c.running and c.proc is not None:
                st["containerID"] = f"process://{c.proc.pid}"
                st["state"] = {"running": {"startedAt": c.started_at}}
            elif c.terminated is not None:
                st["state"] = {"terminated": c.terminated}
            else:
                st["state"] = {"waiting": c.waiting or {"reason": "ContainerCreating"}}
            if c.last_terminated is not None:
                st["lastState"] = {"terminated": c.last_terminated}
            statuses.append(st)
        done = [c for c in self.containers if c.terminated is not None and c.proc is None]
        phase = "Pending"
        if self.containers and len(done) == len(self.containers):
            codes = [int(c.terminated["exitCode"]) for c in done if c.terminated is not None]
            restarting = policy == "Always" or (policy == "OnFailure" and any(codes))
            if not restarting:
                phase = "Succeeded" if not any(codes) else "Failed"
            else:
                phase = "Running" if any(c.started_at for c in self.containers) else "Pending"
        elif any(c.running for c in self.containers) or any(c.started_at for c in self.containers):
            phase = "Running"
        ready = bool(self.containers) and all(s["ready"] for s in statuses)
        ts = now_rfc3339()

        def cond(ctype: str, ok: bool, reason: str = "") -> JSON:
            out: JSON = {"type": ctype, "status": "True" if ok else "False"}
            if reason and not ok:
                out["reason"] = reason
            return out

        # As the kubelet: Ready needs every readiness gate's condition True too (KEP-580), as a
        # controller set it on the pod (ours: the operator's inference probe).
        gated = _readiness_gates_true(pod)
        conditions = [
            cond("PodReadyToStartContainers", self._config_error is None),
            cond("Initialized", self._config_error is None, "ContainersNotInitialized"),
            cond("ContainersReady", ready, "ContainersNotReady"),
            cond("Ready", ready and gated, "ContainersNotReady" if not ready else GATES_NOT_READY),
        ]
        status: JSON = {
            "phase": phase,
            "hostIP": self.node.host_ip,
            "hostIPs": [{"ip": self.node.host_ip}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "conditions": conditions,
            "containerStatuses": statuses,
        }
        if self._config_error:
            status["message"] = self._config_error
            status["reason"] = "CreateContainerConfigError"
        # lastTransitionTime changes only when a condition's status changes.
        prev = {c["type"]: c for c in (self._last_status or {}).get("conditions", [])}
        for condition in conditions:
            old = prev.get(condition["type"])
            same = old is not None and old["status"] == condition["status"]
            condition["lastTransitionTime"] = old["lastTransitionTime"] if same and old else ts
        return status

    def _write_status(self) -> None:
        status = self._status()
        if status == self._last_status:
            return
        patch = {"metadata": {"uid": self.uid}, "status": status}
        patch_status = self.node.kube.core.patch_namespaced_pod_status
        try:
            call(patch_status, self.pod_name, self.namespace, patch, _content_type=STRATEGIC)
            self._last_status = status
        except KUBE_ERRORS as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                self.gone()
            else:
                log.warning("pod %s: status update failed: %s", self.pod_name, describe(exc))


def _readiness_gates_true(pod: JSON) -> bool:
    """Every condition the pod's spec.readinessGates name is True in its status (a missing one
    is False), as the kubelet computes Ready."""
    gates = [g.get("conditionType") for g in pod["spec"].get("readinessGates") or []]
    shown = {c.get("type"): c.get("status") for c in pod.get("status", {}).get("conditions") or []}
    return all(shown.get(gate) == "True" for gate in gates)
