"""Fixtures for the worker unit tests: small real demo models (helpers live in wl_support)."""

from __future__ import annotations

import pytest

from weightlift.local.models import DemoModel, make_demo


@pytest.fixture(scope="session")
def demo_tp1(tmp_path_factory: pytest.TempPathFactory) -> DemoModel:
    return make_demo(tmp_path_factory.mktemp("demo_tp1"), size_mb=3, tp=1, hook=True, seed=1)


@pytest.fixture(scope="session")
def demo_tp2(tmp_path_factory: pytest.TempPathFactory) -> DemoModel:
    return make_demo(
        tmp_path_factory.mktemp("demo_tp2"), size_mb=3, tp=2, hook=True, parts=2, seed=2
    )
