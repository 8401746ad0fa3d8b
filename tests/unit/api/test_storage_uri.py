"""hf:// URIs: the repo id and the revision that wins."""

from __future__ import annotations

import pytest

from weightlift.api.uri import ModelUri, hf_repo


@pytest.mark.parametrize(
    ("uri", "revision", "want"),
    [
        ("hf://acme/tiny", "main", ("acme/tiny", "main")),
        ("hf://acme/tiny@v2", "main", ("acme/tiny", "v2")),
        ("hf://acme/tiny@0123abcd/", "main", ("acme/tiny", "0123abcd")),
        ("hf://gpt2", "v1", ("gpt2", "v1")),
    ],
)
def test_hf_repo_and_revision(uri: str, revision: str, want: tuple[str, str]) -> None:
    assert hf_repo(ModelUri.parse(uri), revision) == want
