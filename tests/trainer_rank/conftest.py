"""Fixtures shared by the TrainerRank tests."""

from __future__ import annotations

import pytest
from _trainer_helpers import provider


@pytest.fixture(scope="module")
def built():
    """The tiny selective-recompute model behind a real Provider, one per test module (a
    module that needs another model defines its own `built`)."""
    p = provider("selective")
    p.initialize_distributed()
    return p, p.build_model(seed=0)
