"""s3://bucket/prefix: ranged GETs in parallel, each written straight into its file's pages.

The download itself is `ranged.fetch_files` (shared with hf://): each GET here is pinned to the
listing's ETag with `If-Match`, so an object replaced mid-download fails instead of mixing two
versions.

Credentials are boto3's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN
from the Secret the pod's env references, or a web identity / instance role); with none at all
the requests go unsigned (public buckets). No message built here contains a credential, and
`redact` scrubs any that a library message might echo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError

from weightlift.worker.storage import ranged
from weightlift.worker.storage.errors import StorageError, redact

_ERRORS = {
    "NoSuchBucket": "bucket does not exist",
    "NoSuchKey": "object does not exist",
    "AccessDenied": "access denied (check the credentials Secret and the bucket policy)",
    "InvalidAccessKeyId": "the access key in the credentials Secret is not known to the store",
    "SignatureDoesNotMatch": "the secret key in the credentials Secret is wrong",
    "InvalidToken": "the session token in the credentials Secret is invalid",
    "ExpiredToken": "the session token in the credentials Secret has expired",
    "PreconditionFailed": "the object changed during the download (ETag mismatch)",
    "412": "the object changed during the download (ETag mismatch)",
    "403": "access denied (check the credentials Secret and the bucket policy)",
    "404": "does not exist",
}


@dataclass(frozen=True)
class S3Object:
    key: str
    size: int
    etag: str
    name: str  # the path relative to the listed prefix (model.pt2, hooks/libinit.so)


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionError | HTTPClientError)


def _explain(exc: ClientError | BotoCoreError) -> str:
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return (
            _ERRORS.get(code)
            or _ERRORS.get(status)
            or redact(f"{code or status}: {err.get('Message', '')}")
        )
    return redact(type(exc).__name__ + ": " + str(exc))


class S3Store:
    """One bucket/prefix on one S3-compatible endpoint."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        threads: int = 16,
        chunk_bytes: int = 16 << 20,
    ) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.threads, self.chunk_bytes = threads, chunk_bytes
        session = boto3.session.Session()
        signed = session.get_credentials() is not None
        cfg = Config(
            max_pool_connections=max(threads, 10),
            retries={"max_attempts": 3, "mode": "standard"},
            # path style works on every S3-compatible store; AWS still accepts it.
            s3={"addressing_style": "path"} if endpoint else {},
            **({} if signed else {"signature_version": UNSIGNED}),
        )
        self.client: Any = session.client(
            "s3", endpoint_url=endpoint or None, region_name=region or None, config=cfg
        )

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key or self.prefix}"

    def list_objects(self) -> list[S3Object]:
        """Every object under the prefix, as a model directory tree."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        found: list[S3Object] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for o in page.get("Contents", []):
                    key = str(o["Key"])
                    name = key[len(prefix) :]
                    if name and not key.endswith("/") and ".." not in name.split("/"):
                        found.append(S3Object(key, int(o["Size"]), str(o["ETag"]), name))
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(
                f"{self.uri()}: listing failed: {_explain(exc)}", permanent=not _transient(exc)
            ) from None
        return found

    def fetch(
        self, objects: list[S3Object], dest: Path, on_bytes: Callable[[int], None]
    ) -> list[Path]:
        """Download `objects` into `dest/<name>`; ranges in parallel; returns the paths."""
        return ranged.fetch_files(
            objects,
            dest,
            self.read_range,
            on_bytes,
            threads=self.threads,
            chunk_bytes=self.chunk_bytes,
            thread_name="wl-s3",
        )

    def read_range(
        self, o: S3Object, start: int, n: int, sink: Callable[[memoryview, int], None]
    ) -> None:
        """GET bytes [start, start + n) of `o`; `sink(chunk, offset)` takes each piece."""
        got = 0
        try:
            resp = self.client.get_object(
                Bucket=self.bucket,
                Key=o.key,
                Range=f"bytes={start}-{start + n - 1}",
                IfMatch=o.etag,
            )
            raw = resp["Body"]._raw_stream  # botocore's StreamingBody wraps urllib3's response
            try:
                got = ranged.drain(ranged.socket_readinto(raw), start, n, sink)
            finally:
                ranged.finish(raw)
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(
                f"{self.uri(o.key)}: {_explain(exc)}", permanent=not _transient(exc)
            ) from None
        except ranged.BodyLost as exc:
            raise StorageError(
                f"{self.uri(o.key)}: truncated transfer of {n} bytes at offset {start} "
                f"({redact(str(exc))})",
                permanent=False,
            ) from None
        if got != n:
            raise StorageError(
                f"{self.uri(o.key)}: truncated transfer: got {got} of {n} bytes at offset {start}",
                permanent=False,
            )
