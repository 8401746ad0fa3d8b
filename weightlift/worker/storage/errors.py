"""The one error every storage reader raises, and the scrubber that keeps credentials out of it."""

from __future__ import annotations

import os

from weightlift.worker.weights.progress import LoadError

# Environment variables the credentials Secret may set (operator/pods.py names the same keys).
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN")


class StorageError(LoadError):
    """Reading the model from storage failed; the message names the object, never a credential.

    `permanent`: retrying the same spec cannot help (missing object, bad revision, wrong
    credentials, bad file); false for transport errors (endpoint unreachable, timeouts)."""

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(redact(message))
        self.permanent = permanent


def redact(text: str) -> str:
    """`text` with every credential value from the environment replaced by ***."""
    for name in CREDENTIAL_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text
