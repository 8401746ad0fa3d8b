"""Who may use a worker's P2P endpoints (manifest, NIXL agent metadata, sessions, health): peers
holding the token of the model identity, from the Secret the operator names in the pod's env
(operator/shared_objects.py says why one per identity). Targets send it as a bearer header; sources
compare in constant time and answer 401 without it, 403 with a wrong one.

A worker started without a token (a bench or test run outside Kubernetes) serves P2P to anyone
on its network and says so once in its log; the operator always sets one. The token and the other
secrets a worker may hold never reach its status or its log: `redact` and `RedactingFilter`.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping

from aiohttp import web

from weightlift.api.worker import PEER_TOKEN_ENV

log = logging.getLogger(__name__)

# Environment values that are secrets: never shown in the status or the log.
SECRET_ENV = (
    PEER_TOKEN_ENV,
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
)
REDACTED = "<redacted>"
# Shorter values are not searched for: replacing "1" everywhere would garble every message.
MIN_SECRET_LENGTH = 8


def peer_token(environ: Mapping[str, str] | None = None) -> str | None:
    token = (os.environ if environ is None else environ).get(PEER_TOKEN_ENV) or None
    return token.strip() if token else None


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def refusal(request: web.Request, token: str | None) -> web.Response | None:
    """None when `request` may use the P2P endpoints, else the 401/403 answer."""
    if token is None:
        return None
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if not header or scheme.lower() != "bearer":
        return web.json_response(
            {"error": "unauthorized", "message": "P2P endpoints need the peer bearer token"},
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="weightlift-p2p"'},
        )
    if not hmac.compare_digest(presented.strip().encode(), token.encode()):
        return web.json_response(
            {"error": "forbidden", "message": "wrong peer token for this model identity"},
            status=403,
        )
    return None


def warn_if_open(token: str | None) -> None:
    if token is None:
        log.warning("%s is not set: P2P endpoints answer any client", PEER_TOKEN_ENV)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    return [v for k in SECRET_ENV if len(v := env.get(k, "")) >= MIN_SECRET_LENGTH]


def redact(text: str, secrets: list[str]) -> str:
    for value in secrets:
        text = text.replace(value, REDACTED)
    return text


class RedactingFilter(logging.Filter):
    """Replaces secret env values in every record a handler emits (a library's exception text
    may quote a header or a URL with credentials)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.secrets = secret_values(environ)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            message = record.getMessage()
            cleaned = redact(message, self.secrets)
            if cleaned != message:
                record.msg, record.args = cleaned, None
        return True
