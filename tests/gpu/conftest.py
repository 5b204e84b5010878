"""Shared fixtures of the GPU suites (collected on the device machine: `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def g() -> torch.Generator:
    """A CUDA generator with a fresh seed every run, printed so that a failure can be replayed."""
    gen = torch.Generator(device="cuda")
    seed = torch.seed()
    gen.manual_seed(seed)
    print(f"seed {seed}")  # shown on failure
    return gen
