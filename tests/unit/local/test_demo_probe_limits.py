"""The demo models' probes must be admissible: `make demo` applies them to a real API server,
whose CRD bounds the values of a probe request and of its expected outputs."""

from __future__ import annotations

import pytest

from weightlift.api import limits
from weightlift.local.models import dims_for


@pytest.mark.parametrize("size_mb", [1.0, 8.0, 64.0, 256.0, 4096.0])
def test_demo_probe_fits_the_admission_limits(size_mb: float) -> None:
    d_model, _ = dims_for(size_mb)
    values = 2 * d_model  # the probe sends a [2, d_model] input and expects a [2, d_model] output
    assert values <= limits.REQUEST_VALUES
    assert values <= limits.EXPECTED_VALUES
