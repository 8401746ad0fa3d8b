"""The cluster's compile-cache store on S3 (`s3://bucket/prefix`): the node store's entries, for
replicas on every node. The same keys, manifests, verifier and LRU bound (compile_store.py).

An entry is `<prefix>/<want>/<vllm hash>/{archive.tar,manifest.json}`; the manifest is written
last, so an entry is listed only once whole. Its LastModified is its last use: a hit copies the
manifest onto itself (new metadata), which S3 dates anew. Credentials come from a Secret through
the pod's env (their own names, apart from the model's); no message here carries one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from weightlift.api.worker import (
    COMPILE_STORE_ACCESS_KEY_ENV,
    COMPILE_STORE_S3_ENDPOINT_ENV,
    COMPILE_STORE_SECRET_KEY_ENV,
)
from weightlift.worker.engines.vllm.compile_cache import CacheRejected
from weightlift.worker.engines.vllm.compile_store import ARCHIVE, MANIFEST, CompileStore

_CHUNK = 1 << 20
_MAX_MANIFEST = 16 << 20


@contextlib.contextmanager
def _s3_errors(what: str) -> Iterator[None]:
    """S3's errors as OSError naming the call and S3's code, never a credential."""
    try:
        yield
    except ClientError as exc:
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
        raise OSError(f"S3 {what}: {err.get('Code', '')} (HTTP {status})") from None
    except BotoCoreError as exc:
        raise OSError(f"S3 {what}: {type(exc).__name__}") from None


def _missing(exc: ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


class S3CompileStore(CompileStore):
    label = "the cluster store"

    def __init__(self, uri: str, max_bytes: int, client: Any) -> None:
        super().__init__(max_bytes)
        rest = uri.removeprefix("s3://")
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix.strip("/")
        self.client = client

    def __str__(self) -> str:
        return f"the cluster store s3://{self.bucket}/{self.prefix}"

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _list(self, under: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        with _s3_errors("list"):
            pages = self.client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=self._key(under) + "/"):
                found.extend(page.get("Contents", []))
        return found

    def _relative(self, key: str) -> list[str]:
        return key[len(self.prefix) + 1 :].split("/") if self.prefix else key.split("/")

    def hashes(self, want: str) -> list[str]:
        manifests = [o for o in self._list(want) if o["Key"].endswith("/" + MANIFEST)]
        manifests.sort(key=lambda o: o["LastModified"], reverse=True)
        return [self._relative(o["Key"])[1] for o in manifests]

    def has(self, want: str, vllm_hash: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(want, vllm_hash, MANIFEST))
        except ClientError as exc:
            if _missing(exc):
                return False
            with _s3_errors("head"):
                raise
        return True

    def manifest_text(self, want: str, vllm_hash: str) -> str:
        with _s3_errors("get manifest"):
            obj = self.client.get_object(
                Bucket=self.bucket, Key=self._key(want, vllm_hash, MANIFEST)
            )
            if obj["ContentLength"] > _MAX_MANIFEST:
                raise CacheRejected(f"store manifest of {obj['ContentLength']} bytes")
            text: str = obj["Body"].read().decode()
        return text

    def archive(self, want: str, vllm_hash: str, staging: Path, bound: int) -> Path:
        dest = staging / ARCHIVE
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _s3_errors("get archive"):
            obj = self.client.get_object(
                Bucket=self.bucket, Key=self._key(want, vllm_hash, ARCHIVE)
            )
            if obj["ContentLength"] > bound:
                raise CacheRejected(f"{ARCHIVE} of {obj['ContentLength']} bytes, over {bound}")
            with dest.open("wb") as out:
                for chunk in obj["Body"].iter_chunks(_CHUNK):
                    out.write(chunk)
        return dest

    def write(self, want: str, vllm_hash: str, archive: Path, manifest: str) -> None:
        with _s3_errors("put"):
            with archive.open("rb") as body:
                self.client.put_object(
                    Bucket=self.bucket, Key=self._key(want, vllm_hash, ARCHIVE), Body=body
                )
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(want, vllm_hash, MANIFEST),
                Body=manifest.encode(),
            )

    def touch(self, want: str, vllm_hash: str) -> None:
        key = self._key(want, vllm_hash, MANIFEST)
        with _s3_errors("touch"):
            self.client.copy_object(
                Bucket=self.bucket,
                Key=key,
                CopySource={"Bucket": self.bucket, "Key": key},
                Metadata={"used": "1"},
                MetadataDirective="REPLACE",
            )

    def entries(self) -> list[tuple[float, int, str]]:
        sizes: dict[str, int] = {}
        used: dict[str, float] = {}
        for obj in self._list(""):
            parts = self._relative(obj["Key"])
            if len(parts) != 3:
                continue
            entry = "/".join(parts[:2])
            sizes[entry] = sizes.get(entry, 0) + int(obj["Size"])
            stamp = obj["LastModified"].timestamp()
            if parts[2] == MANIFEST or entry not in used:  # a half-written one: its archive's
                used[entry] = stamp
        return sorted((used[e], sizes[e], e) for e in sizes)

    def remove(self, entry: str) -> None:
        keys = [{"Key": o["Key"]} for o in self._list(entry)]
        with _s3_errors("delete"):
            for i in range(0, len(keys), 1000):
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True}
                )


def s3_store(uri: str, max_bytes: int, environ: Mapping[str, str] | None = None) -> CompileStore:
    """The cluster store at `uri`, with the credentials and endpoint the operator passed."""
    env = os.environ if environ is None else environ
    access = env.get(COMPILE_STORE_ACCESS_KEY_ENV) or None
    secret = env.get(COMPILE_STORE_SECRET_KEY_ENV) or None
    endpoint = env.get(COMPILE_STORE_S3_ENDPOINT_ENV) or None
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access,
        aws_secret_access_key=secret,
        region_name=env.get("AWS_REGION") or ("us-east-1" if endpoint else None),
        config=Config(
            retries={"max_attempts": 3, "mode": "standard"},
            s3={"addressing_style": "path"} if endpoint else {},
        ),
    )
    return S3CompileStore(uri, max_bytes, client)
