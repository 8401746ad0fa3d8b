"""The one rule operator and worker share about peer-to-peer loading."""

from __future__ import annotations

import pytest

from weightlift.api.model import LoadingSpec, LoadStrategy, RuntimeSpec, pulls_from_peers

BUILTIN = RuntimeSpec()
EXTERNAL = RuntimeSpec.model_validate({"type": "External", "command": ["tritonserver"]})


@pytest.mark.parametrize(
    ("strategy", "runtime", "expected"),
    [
        (LoadStrategy.AUTO, BUILTIN, True),
        (LoadStrategy.PEER_TO_PEER, BUILTIN, True),
        (LoadStrategy.PRELOAD, BUILTIN, False),
        (LoadStrategy.DIRECT, BUILTIN, False),
        (LoadStrategy.AUTO, EXTERNAL, False),  # the runtime loads its own weights
        (LoadStrategy.PEER_TO_PEER, EXTERNAL, False),
    ],
)
def test_pulls_from_peers(strategy: LoadStrategy, runtime: RuntimeSpec, expected: bool) -> None:
    assert pulls_from_peers(LoadingSpec(strategy=strategy), runtime) is expected
