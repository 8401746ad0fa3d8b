"""A real node: containerd, the kubelet, kube-proxy and a GPU device plugin on this machine,
in a network namespace of their own (network.py), pulling images from the stack's registry.

    net = network.allocate(state_dir, reclaim)      # before the control plane: its address
    cp = ControlPlane(..., bind_address=net.host_ip)
    node = KubeletNode(cp.up(), net, "node-0", state_dir, images=[...])
    node.start()   # registry + push, containerd, kubelet, device plugin, kube-proxy; Ready
    node.stop()    # every pod, process, mount, cgroup, sysctl and the namespace: gone

Like kind's node bootstrap, one small step per piece; like k3s's agent, one program brings
the kubelet and containerd up and takes them down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import yaml

from weightlift.api.times import parse_rfc3339
from weightlift.local.cluster import ClusterInfo, cache_dir, issue_client_cert
from weightlift.local.kube import JSON, KUBE_ERRORS, Kube, call, delete
from weightlift.local.kubeletnode import config, registry, teardown
from weightlift.local.kubeletnode.network import NodeNetwork
from weightlift.local.kubeletnode.paths import PAUSE_IMAGE, NodeError, binary, missing
from weightlift.local.procs import child_options, stop_group

log = logging.getLogger("weightlift.kubeletnode")
LOCAL_NODE_LABEL = "weightlift.dev/local-node"
GPU_RESOURCE = "nvidia.com/gpu"


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class KubeletNode:
    """One real node; see the module docstring. `bind_to_parent`: every process gets SIGTERM
    when the process that started it dies (off for `cluster up`, whose node outlives it)."""

    def __init__(
        self,
        info: ClusterInfo,
        net: NodeNetwork,
        name: str,
        state_dir: Path,
        *,
        gpus: int = 8,
        extra_resources: dict[str, int] | None = None,
        images: Sequence[str] = (),
        labels: dict[str, str] | None = None,
        cache: Path | None = None,
        bind_to_parent: bool = True,
        timeout: float = 120.0,
    ) -> None:
        self.info = info
        self.net = net
        self.name = name
        self.state_dir = Path(state_dir).resolve()
        self.layout = config.layout(self.state_dir, net)
        self.gpus = gpus
        # Extended resources the device plugin advertises beside GPU_RESOURCE (MIG slices...).
        self.extra_resources = dict(extra_resources or {})
        self.resources = {GPU_RESOURCE: gpus, **self.extra_resources}
        self.images = tuple(images)
        self.labels = {LOCAL_NODE_LABEL: "true", **(labels or {})}
        self.cache = cache if cache is not None else cache_dir()
        self.bind_to_parent = bind_to_parent
        self.timeout = timeout
        self.cgroup_root = f"/weightlift-node-{net.slot}"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.kube: Kube | None = None

    # -- up
    def start(self) -> None:
        absent = missing(self.cache)
        if absent:
            raise NodeError(f"real node pieces missing: {', '.join(absent)}; run `make node`")
        lay = self.layout
        for d in (lay.etc, lay.logs, lay.cni_conf, lay.cni_ipam, lay.kubelet_root, lay.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        self._save({"slot": self.net.slot, "name": self.name, "cgroupRoot": self.cgroup_root})
        # What the kubelet makes outside its --root-dir (tear-down removes what was not there).
        made = [
            str(p)
            for d in (
                lay.device_plugins,
                teardown.CNI_CACHE / "results",
                teardown.CONTAINER_LOG_LINKS,
            )
            for p in teardown.missing_parents(d)
        ]
        (self.state_dir / "made-dirs.json").write_text(json.dumps(made))
        (self.state_dir / "sysctls.json").write_text(json.dumps(teardown.read_sysctls()))
        self.kube = Kube(self.info.kubeconfig, "kubelet-node")
        self._write_files()
        self._start_registry()
        self._push_images()
        self._start_containerd()
        teardown.make_cgroup_root(self.cgroup_root)
        self._start_kubelet()
        self._wait(self._node_ready, f"node {self.name} Ready", "kubelet")
        self._start_device_plugin()
        advertised = ", ".join(f"{n} x {k}" for k, n in self.resources.items())
        self._wait(self._gpus_advertised, f"{advertised} allocatable", "device-plugin")
        self._start_kube_proxy()
        self._wait(
            self._service_routed, "the kubernetes Service in kube-proxy's rules", "kube-proxy"
        )

    def _start_containerd(self) -> None:
        lay = self.layout
        lay.containerd_socket.unlink(missing_ok=True)  # a killed containerd's: not an answer
        self._start(
            "containerd",
            [binary("containerd"), "--config", str(lay.etc / "containerd.toml")],
            netns=True,
        )
        self._wait(lambda: lay.containerd_socket.exists(), "containerd's socket", "containerd")

    def _start_device_plugin(self) -> None:
        extras = [f"{k}={n}" for k, n in self.extra_resources.items()]
        self._start(
            "device-plugin",
            [
                binary("weightlift-gpu-plugin"),
                f"--dir={self.layout.device_plugins}",
                # GPU_RESOURCE counted by --count: the flags an older build of it reads, too.
                f"--count={self.gpus}",
                "--resource=" + ",".join([GPU_RESOURCE, *extras]),
                # Mounted and named in each container given GPUs: the faultgate's dir.
                f"--fault-gate-dir={self.fault_gate_dir}",
            ],
        )

    def _start_kube_proxy(self) -> None:
        self._start(
            "kube-proxy",
            [binary("kube-proxy"), f"--config={self.layout.etc / 'kube-proxy.yaml'}", "--v=1"],
            netns=True,
        )

    def _write_files(self) -> None:
        lay, net, certs = self.layout, self.net, self.info.ca_file.parent
        (lay.etc / "containerd.toml").write_text(config.containerd_toml(lay, net))
        for host, body in config.registry_hosts(net).items():
            (lay.registry_hosts / host).mkdir(parents=True, exist_ok=True)
            (lay.registry_hosts / host / "hosts.toml").write_text(body)
        (lay.cni_conf / "10-weightlift.conflist").write_text(
            config.dump_json(config.cni_conflist(lay, net))
        )
        user = f"system:node:{self.name}"
        crt, key = issue_client_cert(certs, "kubelet", user, ("system:nodes",), lay.etc)
        (lay.etc / "kubelet.kubeconfig").write_text(
            config.kubeconfig(self.info.server, self.info.ca_file, crt, key, user)
        )
        crt, key = issue_client_cert(certs, "kube-proxy", "system:kube-proxy", (), lay.etc)
        (lay.etc / "kube-proxy.kubeconfig").write_text(
            config.kubeconfig(self.info.server, self.info.ca_file, crt, key, "system:kube-proxy")
        )
        (lay.etc / "kubelet.yaml").write_text(
            config.kubelet_config(lay, net, self.info.ca_file, self.cgroup_root)
        )
        (lay.etc / "kube-proxy.yaml").write_text(
            config.kube_proxy_config(lay.etc / "kube-proxy.kubeconfig", net, self.name)
        )

    def _start_registry(self) -> None:
        data = self.cache / "registry-data"
        # Uploads an interrupted push left (its own purger waits days): one node per machine,
        # so none is in flight now.
        for uploads in data.glob("docker/registry/v2/repositories/**/_uploads"):
            shutil.rmtree(uploads, ignore_errors=True)
        htpasswd = self.layout.etc / "registry.htpasswd"
        htpasswd.write_text(registry.htpasswd_line())
        private = self.private_registry.address
        for name, address, auth, anonymous in (
            ("registry", config.registry_address(self.net), None, 200),
            ("registry-auth", private, htpasswd, 401),  # refuses who brings no credentials
        ):
            path = self.layout.etc / f"{name}.yml"
            path.write_text(yaml.safe_dump(registry.registry_config(data, address, auth)))
            self._start(name, [binary("registry"), "serve", str(path)])
            url = f"http://{address}/v2/"

            def answers(url: str = url, code: int = anonymous) -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(url, timeout=2).status_code == code
                return False

            self._wait(answers, f"registry at {url}", name)

    def _push_images(self) -> None:
        self.push_images([PAUSE_IMAGE, *self.images])

    def push_images(self, images: Sequence[str]) -> None:
        """buildah push each image to the registry (layers the registry has are skipped) as
        config.registry_ref names it."""
        for local in images:
            remote = self.registry_ref(local)
            started = time.monotonic()
            done = subprocess.run(
                [
                    binary("buildah"),
                    "push",
                    "--quiet",
                    "--tls-verify=false",
                    # zstd: gzip of the worker's 6.3 GB took over 8 min on 2 busy cores;
                    # containerd 1.6 unpacks zstd layers.
                    "--compression-format=zstd",
                    local,
                    f"docker://{remote}",
                ],
                capture_output=True,
                text=True,
                timeout=1800,
                check=False,
            )
            if done.returncode != 0:
                raise NodeError(f"buildah push {local} -> {remote}: {done.stderr.strip()}")
            log.info("pushed %s -> %s in %.1fs", local, remote, time.monotonic() - started)
            self._record("pushSeconds", {local: round(time.monotonic() - started, 2)})

    def registry_ref(self, image: str) -> str:
        return config.registry_ref(self.net, image)

    @property
    def private_registry(self) -> registry.PrivateRegistry:
        """The same images behind basic auth: pods pull from it with an imagePullSecret."""
        return registry.private_registry(self.net)

    def _start_kubelet(self) -> None:
        lay = self.layout
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        self._start(
            "kubelet",
            [
                binary("kubelet"),
                f"--config={lay.etc / 'kubelet.yaml'}",
                f"--kubeconfig={lay.etc / 'kubelet.kubeconfig'}",
                f"--root-dir={lay.kubelet_root}",
                f"--cert-dir={lay.kubelet_root / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.net.node_ip}",
                f"--node-labels={labels}",
                "--v=1",
            ],
            netns=True,
        )

    # -- readiness checks
    def _node(self) -> JSON | None:
        assert self.kube is not None
        with contextlib.suppress(*KUBE_ERRORS):
            node: JSON = call(self.kube.core.read_node, self.name)
            return node
        return None

    def _node_ready(self) -> bool:
        node = self._node() or {}
        conds = (node.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def _gpus_advertised(self) -> bool:
        alloc = ((self._node() or {}).get("status") or {}).get("allocatable") or {}
        return all(str(alloc.get(k)) == str(n) for k, n in self.resources.items())

    def _service_routed(self) -> bool:
        done = subprocess.run(
            [*self.net.nsenter(), "iptables", "-t", "nat", "-S", "KUBE-SERVICES"],
            capture_output=True,
            text=True,
            check=False,
        )
        return "default/kubernetes:https" in done.stdout

    # -- processes
    def _start(self, name: str, argv: list[str], netns: bool = False) -> None:
        full = [*self.net.nsenter(), *argv] if netns else argv
        with (self.layout.logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                full,
                **child_options(
                    out,
                    cwd=self.state_dir,
                    env={**os.environ, "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"},
                    die_with=signal.SIGTERM if self.bind_to_parent else None,
                ),
            )
        self._procs[name] = proc
        self._record("pids", {name: proc.pid})

    def _wait(self, ready: object, what: str, component: str) -> None:
        assert callable(ready)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    path = self.layout.logs / f"{name}.log"
                    raise NodeError(
                        f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                        f"{_log_tail(path)}"
                    )
            if ready():
                return
            time.sleep(0.2)
        path = self.layout.logs / f"{component}.log"
        raise NodeError(f"no {what} after {self.timeout:.0f}s; {path}:\n{_log_tail(path)}")

    def _save(self, doc: JSON) -> None:
        (self.state_dir / "node.json").write_text(json.dumps(doc, indent=2) + "\n")

    def _record(self, key: str, values: JSON) -> None:
        path = self.state_dir / "node.json"
        doc = json.loads(path.read_text()) if path.exists() else {}
        doc.setdefault(key, {}).update(values)
        self._save(doc)

    # -- introspection (tests, benches)
    @property
    def pause_image(self) -> str:
        """The sandbox image, as pods may name it too (it is in the node's registry)."""
        return config.pause_ref(self.net)

    @property
    def fault_gate_dir(self) -> Path:
        """Where tests hold this node's workers at a step (worker/p2p/faultgate.py): the device
        plugin makes it writable to the pods' uid and mounts it into every container it gives
        GPUs to, with the env that has the worker honour it."""
        return self.state_dir / "faultgate"

    def pid(self, component: str) -> int:
        """The pid of one of the node's processes (containerd, kubelet, kube-proxy, ...)."""
        return self._procs[component].pid

    def crictl(self, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            [
                binary("crictl"),
                f"--runtime-endpoint=unix://{self.layout.containerd_socket}",
                f"--image-endpoint=unix://{self.layout.containerd_socket}",
                "--timeout=30s",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise NodeError(f"crictl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def containers(self) -> list[JSON]:
        """The runtime's running containers (crictl ps), each with its pod's labels."""
        if not self.layout.containerd_socket.exists():
            return []
        items: list[JSON] = json.loads(self.crictl("ps", "-o", "json"))["containers"]
        return items

    def container_pids(self, container_id: str) -> list[int]:
        """Host pids in the container's memory cgroup (its own processes and children)."""
        pids: list[int] = []
        for top in teardown.cgroup_dirs(self.cgroup_root):
            if top.parent.name != "memory":
                continue
            for d in top.rglob(container_id):
                with contextlib.suppress(OSError, ValueError):
                    pids += [int(x) for x in (d / "cgroup.procs").read_text().split()]
        return sorted(pids)

    def pids(self) -> dict[str, list[int]]:
        """namespace/name -> host pids of each running pod's containers (not its sandbox)."""
        out: dict[str, list[int]] = {}
        for c in self.containers():
            labels = c.get("labels") or {}
            pod = labels.get("io.kubernetes.pod.name")
            key = f"{labels.get('io.kubernetes.pod.namespace')}/{pod}"
            out.setdefault(key, []).extend(self.container_pids(c["id"]))
        return out

    def pod_logs(self, namespace: str, pod: str) -> list[Path]:
        return sorted(self.layout.pod_logs.glob(f"{namespace}_{pod}_*/*/*.log"))

    # -- faults (bench/chaos_node.py): the node's daemons restarted, the machine power-cycled
    def restart_kubelet(self, down_seconds: float = 0.0) -> None:
        """Stop the kubelet (SIGTERM, as `systemctl restart kubelet` does) and start it again;
        the pods' containers run on under containerd. Returns once the new kubelet reported the
        node's status and the device plugin registered with it again."""
        self._stop_daemon("kubelet")
        time.sleep(down_seconds)
        since = time.time()
        self._start_kubelet()
        self._wait_back(since, "kubelet")

    def restart_containerd(self, down_seconds: float = 0.0) -> None:
        """Stop containerd (SIGTERM to it alone: its shims, and so the containers, live on)
        and start it again; returns once the kubelet sees the runtime and reports the node."""
        self._stop_daemon("containerd")
        time.sleep(down_seconds)
        since = time.time()
        self._start_containerd()
        self._wait_back(since, "containerd", plugin=False)

    def reboot(self, down_seconds: float = 3.0) -> None:
        """A power cycle: every process of the node SIGKILLed at once (its daemons, the
        containers' shims and processes), every mount gone, containerd's state (a tmpfs /run
        on a machine) emptied, the cgroups fresh. What is on disk stays (images and container
        records in containerd's root, the kubelet's root, the pods' logs), the Node object and
        the registry too. After `down_seconds` the daemons start as the machine's init would."""
        for name in ("kube-proxy", "device-plugin", "kubelet", "containerd"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                stop_group(proc, grace=0.0, first=signal.SIGKILL)
        lay = self.layout
        cgroups = teardown.cgroup_dirs(self.cgroup_root)
        shims = [str(lay.containerd_socket)]
        teardown.kill_all(
            teardown.processes_in(self.net.netns_path, cgroups, shims), first=signal.SIGKILL
        )
        teardown.unmount_all(lay.mount_roots())
        shutil.rmtree(lay.containerd_state, ignore_errors=True)
        teardown.remove_cgroups(self.cgroup_root)
        time.sleep(down_seconds)
        since = time.time()
        self._start_containerd()
        teardown.make_cgroup_root(self.cgroup_root)
        self._start_kubelet()
        self._start_device_plugin()
        self._start_kube_proxy()
        self._wait_back(since, "kubelet")

    def _stop_daemon(self, name: str) -> None:
        proc = self._procs.pop(name)
        proc.terminate()  # the daemon alone, not its group
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _wait_back(self, since: float, component: str, plugin: bool = True) -> None:
        """The kubelet has posted the node's status (Ready) since `since`, and, with `plugin`
        (the kubelet restarted: it removes plugin sockets when it starts), the device plugin
        has served a new socket and registered with it again."""
        sock = self.layout.device_plugins / "weightlift-gpu.sock"

        def back() -> bool:
            try:
                registered = not plugin or sock.stat().st_mtime >= since
            except OSError:
                return False
            return registered and self._reported_ready_since(since) and self._gpus_advertised()

        self._wait(back, f"node {self.name} Ready again after {component}'s restart", component)

    def _reported_ready_since(self, since: float) -> bool:
        conds = ((self._node() or {}).get("status") or {}).get("conditions") or []
        ready: JSON = next((c for c in conds if c["type"] == "Ready"), {})
        beat = ready.get("lastHeartbeatTime")
        return (
            ready.get("status") == "True"
            and beat is not None
            and parse_rfc3339(beat).timestamp() >= int(since)
        )

    # -- down
    def stop(self, timeout: float = 30.0) -> None:
        """Everything start() did, undone; the Node object deleted. Safe after a failed start."""
        for name in ("kube-proxy", "device-plugin", "kubelet"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                stop_group(proc, grace=10.0)
        if self.layout.containerd_socket.exists() and "containerd" in self._procs:
            with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
                self.crictl("rmp", "--all", "--force", timeout=timeout)
        for name in ("containerd", "registry", "registry-auth"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                stop_group(proc, grace=10.0)
        if self.kube is not None:  # while the API server is reachable on the node's link
            with contextlib.suppress(*KUBE_ERRORS):
                delete(self.kube.core.delete_node, self.name)
            self.kube.close()
            self.kube = None
        clear(self.net, self.state_dir, self.cgroup_root)

    def leftovers(self) -> list[str]:
        return leftovers(self.net, self.state_dir, self.cgroup_root)


def clear(net: NodeNetwork, state_dir: Path, cgroup_root: str) -> None:
    """What any node of this slot and state dir left: processes, mounts, cgroups, sysctls,
    host files, then the network namespace. Also a crashed run's (network.allocate)."""
    cgroups = teardown.cgroup_dirs(cgroup_root)
    teardown.kill_all(teardown.processes_in(net.netns_path, cgroups, _markers(net, state_dir)))
    lay = config.layout(state_dir, net)
    teardown.unmount_all(lay.mount_roots())
    shutil.rmtree(net.run_dir, ignore_errors=True)
    # The node's image store: the worker image unpacked is ~9 GB (content + snapshot); a kept
    # state dir (pytest keeps three runs') must not keep it, or the next run's node meets
    # DiskPressure. The registry keeps the pushed images.
    shutil.rmtree(lay.containerd_root, ignore_errors=True)
    teardown.remove_cgroups(cgroup_root)
    teardown.restore_sysctls(state_dir / "sysctls.json")
    for path in teardown.host_files(state_dir, config.cni_network(net)):
        with contextlib.suppress(OSError):
            path.unlink()
    teardown.clear_device_plugins(config.DEVICE_PLUGINS, state_dir / "made-dirs.json")
    net.down()


def leftovers(net: NodeNetwork, state_dir: Path, cgroup_root: str) -> list[str]:
    """What of a node is still on the machine (a clean tear-down leaves nothing)."""
    cgroups = teardown.cgroup_dirs(cgroup_root)
    pids = teardown.processes_in(net.netns_path, cgroups, _markers(net, state_dir))
    out = [f"process {p}" for p in sorted(pids)]
    out += [
        f"mount {m}" for m in teardown.mounts_under(config.layout(state_dir, net).mount_roots())
    ]
    out += [f"dir {net.run_dir}"] if net.run_dir.exists() else []
    store = config.layout(state_dir, net).containerd_root
    out += [f"dir {store}"] if store.exists() else []
    out += [f"cgroup {d}" for d in cgroups if d.exists()]
    out += [f"file {p}" for p in teardown.host_files(state_dir, config.cni_network(net))]
    out += [f"dir {p}" for p in teardown.made_dirs(state_dir / "made-dirs.json") if p.exists()]
    return out + net.leftovers()


def _markers(net: NodeNetwork, state_dir: Path) -> list[str]:
    """What only this node's processes have in their command lines: the shims name
    containerd's socket; the registry and the device plugin name the node's dirs."""
    lay = config.layout(state_dir, net)
    return [str(lay.containerd_socket), str(lay.etc) + "/", f"--dir={lay.device_plugins}"]


def reclaim(net: NodeNetwork, state_dir: Path | None) -> None:
    """network.allocate's hook: clear a dead owner's node of this slot."""
    if state_dir is not None:
        clear(net, state_dir, f"/weightlift-node-{net.slot}")
