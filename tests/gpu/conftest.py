"""Shared fixtures of the GPU suites (collected on the device machine: `pytest -m gpu`)."""

from __future__ import annotations

import zlib

import pytest
import torch


@pytest.fixture
def g(request: pytest.FixtureRequest) -> torch.Generator:
    """A CUDA generator with a fixed seed per test case: the same inputs every run (a failure
    replays as it happened), different ones for each test and parametrization (the seed is a
    CRC of the test's name: str's hash() changes from process to process)."""
    seed = zlib.crc32(request.node.name.encode())
    print(f"seed {seed}")  # shown on failure
    return torch.Generator(device="cuda").manual_seed(seed)
