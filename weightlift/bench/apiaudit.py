"""Count one user's API requests from the kube-apiserver's audit log.

The benchmark runs the operator under its own ServiceAccount and an audit policy that records
only that user's requests (Metadata level: verb, resource, code, timestamps), so the count is
what the API server really served the operator, watches and failed calls included.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml


def policy(username: str) -> str:
    """Audit policy YAML: Metadata for `username`, nothing for anyone else."""
    doc = {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [{"level": "Metadata", "users": [username]}, {"level": "None"}],
    }
    return yaml.safe_dump(doc, sort_keys=False)


def apiserver_args(policy_file: Path, log_file: Path) -> list[str]:
    return [
        f"--audit-policy-file={policy_file}",
        f"--audit-log-path={log_file}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
        "--audit-log-maxsize=0",  # never rotate: the benchmark reads the whole file
    ]


@dataclass(frozen=True)
class Request:
    received: float  # unix seconds
    verb: str
    resource: str  # resource[/subresource], e.g. pods, modeldeployments/status
    code: int
    stage: str


def _unix(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _resource(ref: dict[str, Any] | None, uri: str) -> str:
    if not ref:
        return uri.split("?")[0]
    name = str(ref.get("resource", "?"))
    sub = ref.get("subresource")
    return f"{name}/{sub}" if sub else name


def read(log_file: Path) -> Iterator[Request]:
    """Every audited request (one per request: ResponseComplete or Panic; a watch's
    ResponseStarted is yielded with stage ResponseStarted so watch starts can be seen)."""
    if not log_file.exists():
        return
    with log_file.open() as lines:
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line being written
            yield Request(
                received=_unix(event["requestReceivedTimestamp"]),
                verb=event.get("verb", "?"),
                resource=_resource(event.get("objectRef"), event.get("requestURI", "")),
                code=int((event.get("responseStatus") or {}).get("code", 0)),
                stage=event.get("stage", ""),
            )


def completed(log_file: Path) -> list[Request]:
    return [r for r in read(log_file) if r.stage in ("ResponseComplete", "Panic")]


def watching(log_file: Path, resources: set[str]) -> bool:
    """True once the user has a watch open on each of `resources`."""
    started = {r.resource for r in read(log_file) if r.verb == "watch"}
    return resources <= started


def in_window(requests: list[Request], start: float, end: float) -> list[Request]:
    return [r for r in requests if start <= r.received < end]


def by_kind(requests: list[Request]) -> Counter[str]:
    """'verb resource' -> count, e.g. 'patch modeldeployments/status'."""
    return Counter(f"{r.verb} {r.resource}" for r in requests)
