"""Model URIs: the schemes the API accepts and the one parser every room uses."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

URI_SCHEMES = ("pvc", "hostpath", "file", "s3", "hf")
URI_PATTERN = rf"^({'|'.join(URI_SCHEMES)})://[^\s]+$"


@dataclass(frozen=True)
class ModelUri:
    """scheme://location, split once. For pvc:// `claim` is the claim and `path` the directory
    inside it; for hostpath:// and file:// `path` is absolute; for s3:// and hf:// `claim` is the
    bucket or repo and `path` the rest. Surrounding slashes are ignored."""

    scheme: str
    claim: str
    path: str

    @classmethod
    def parse(cls, uri: str) -> ModelUri:
        scheme, sep, rest = uri.partition("://")
        if not sep:
            raise ValueError(f"{uri!r} is not scheme://location")
        if scheme in ("hostpath", "file"):
            return cls(scheme, "", "/" + rest.lstrip("/"))
        claim, _, path = rest.strip("/").partition("/")
        return cls(scheme, claim, path)


# Schemes the worker downloads (worker/storage); the others are mounted as volumes.
REMOTE_SCHEMES = ("s3", "hf")


def hf_repo(uri: ModelUri, revision: str) -> tuple[str, str]:
    """(repo id, revision) of hf://org/repo[@revision]; the URI's @revision wins over `revision`."""
    rest = f"{uri.claim}/{uri.path}" if uri.path else uri.claim
    repo_id, _, pinned = rest.partition("@")
    return repo_id.strip("/"), pinned or revision


def is_local_path(scheme: str) -> bool:
    """hostpath:// (a node directory) and file:// (the worker's own filesystem) name paths the
    cluster admin must allow: see path_allowed."""
    return scheme in ("hostpath", "file")


def path_allowed(path: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    """Whether `path`, normalised, is one of `prefixes` or below one. No prefixes: nothing is."""
    if ".." in path.split("/"):
        return False
    here = posixpath.normpath("/" + path.lstrip("/"))
    for prefix in prefixes:
        root = posixpath.normpath(prefix)
        if root != "/" and (here == root or here.startswith(root + "/")):
            return True
    return False
