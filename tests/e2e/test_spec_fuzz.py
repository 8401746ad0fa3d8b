"""200 generated ModelDeployments (a fixed sequence of `weightlift bench fuzz --specs`) created on
the real API server while the real operator runs: every refusal names the field, nothing
crashes (no API 5xx, no operator exception, the operator stays up)."""

from __future__ import annotations

from pathlib import Path

from weightlift.bench.fuzz import fuzz_specs
from weightlift.local.stack import LocalStack


def test_generated_specs_are_admitted_or_refused_naming_the_field(
    stack: LocalStack, e2e_dir: Path
) -> None:
    counts = fuzz_specs(stack, 200, seed=0, model_prefix=str(e2e_dir / "fuzz-models"))
    assert counts.cases == 200
    assert counts.crashes == 0, counts
    assert counts.rejected_vague == 0, counts.vague_examples
    assert counts.other_status == 0, counts
    # Both sides are exercised: some specs pass admission, most hostile ones do not.
    assert counts.admitted > 0 and counts.rejected_field_named > counts.cases // 3, counts
    assert counts.admitted + counts.rejected_field_named == counts.cases
    stack.check_operator()
