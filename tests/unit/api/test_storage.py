"""Model URI parsing and the local-path policy shared by the operator and the chart."""

from __future__ import annotations

import pytest

from weightlift.api.uri import ModelUri, path_allowed


@pytest.mark.parametrize(
    ("path", "prefixes", "allowed"),
    [
        ("/models/llama", ("/models",), True),
        ("/models", ("/models",), True),
        ("/models/./llama", ("/models",), True),
        ("//models//llama", ("/models",), True),
        ("/models-x/llama", ("/models",), False),
        ("/models/../etc", ("/models",), False),
        ("/etc", ("/models",), False),
        ("/", ("/models",), False),
        ("/anything", ("/",), False),  # the root is never a prefix
        ("/models/llama", (), False),  # nothing configured: nothing allowed
        ("/b/x", ("/a", "/b/"), True),
    ],
)
def test_path_allowed(path: str, prefixes: tuple[str, ...], allowed: bool) -> None:
    assert path_allowed(path, prefixes) is allowed


def test_parse_local_paths_are_absolute() -> None:
    assert ModelUri.parse("hostpath://models/x").path == "/models/x"
    assert ModelUri.parse("file:///models/x").path == "/models/x"
