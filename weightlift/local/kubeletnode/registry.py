"""The node's two registries, both CNCF Distribution (hack/build-registry.sh) on one storage:
the stack's own (anonymous, read-write: images are pushed to it) and a private view of it
(read-only, htpasswd auth), which a pod pulls from only with an imagePullSecret, through the
kubelet and containerd, as from a team's internal registry. Pure rendering; node.py runs them.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightlift.local.kubeletnode import config
from weightlift.local.kubeletnode.network import NodeNetwork

JSON = dict[str, Any]
AUTH_USER = "weightlift"
AUTH_PASSWORD = "weightlift-local-pull"
# bcrypt (the only scheme distribution's htpasswd reads) of AUTH_PASSWORD, cost 10. A local
# test registry's credential; the e2e's authenticated pull proves the two agree.
AUTH_HASH = "$2b$10$jlp8WUSQcxjyxBNv1tZ0puGOLIRNuEJ7Oq6V8tPhvCmHj0jUHjT.S"
REALM = "weightlift-local"


@dataclass(frozen=True)
class PrivateRegistry:
    """The authenticated registry as a pod sees it: its address, credentials, image names."""

    address: str
    username: str = AUTH_USER
    password: str = AUTH_PASSWORD

    def ref(self, image: str) -> str:
        """`image` (as config.registry_ref names it in the stack's registry) in this one."""
        return f"{self.address}/{config.image_path(image)}"

    def docker_config_json(self) -> str:
        """A kubernetes.io/dockerconfigjson Secret's .dockerconfigjson for this registry."""
        auth = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        entry = {"username": self.username, "password": self.password, "auth": auth}
        return json.dumps({"auths": {self.address: entry}})

    def pull_secret(self, name: str, namespace: str) -> JSON:
        data = base64.b64encode(self.docker_config_json().encode()).decode()
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": data},
        }


def private_registry(net: NodeNetwork) -> PrivateRegistry:
    return PrivateRegistry(config.auth_registry_address(net))


def registry_config(data: Path, address: str, htpasswd: Path | None = None) -> JSON:
    """distribution's config.yml: the shared storage at `data` on `address`; with `htpasswd`,
    read-only behind basic auth (what it serves was pushed to the anonymous one)."""
    storage: JSON = {
        "filesystem": {"rootdirectory": str(data)},
        # Uploads are the pushing registry's; neither purges (its purger would wait days).
        "maintenance": {"uploadpurging": {"enabled": False}},
    }
    doc: JSON = {
        "version": 0.1,
        "storage": storage,
        "http": {"addr": address},
        "log": {"level": "warn"},
    }
    if htpasswd is not None:
        storage["maintenance"]["readonly"] = {"enabled": True}
        doc["auth"] = {"htpasswd": {"realm": REALM, "path": str(htpasswd)}}
    return doc


def htpasswd_line() -> str:
    return f"{AUTH_USER}:{AUTH_HASH}\n"
