"""Fixtures of the server tests: the tiny checkpoint and module-scoped engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_harness import LiveServer, serve, server_engine_config

from dsaserve.engine.engine import LLMEngine
from dsaserve.serve.async_engine import AsyncEngine


@pytest.fixture(scope="session")
def tiny_model_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny-glm5"]


@pytest.fixture(scope="module")
def make_async_engine(tiny_model_dir: Path) -> Iterator[Callable[..., AsyncEngine]]:
    """Factory of AsyncEngines over fresh LLMEngines (extra flags allowed); all shut down at the
    end of the module."""
    engines: list[AsyncEngine] = []

    def make(*flags: str, engine: LLMEngine | None = None) -> AsyncEngine:
        llm = engine or LLMEngine.from_config(server_engine_config(tiny_model_dir, *flags))
        engines.append(AsyncEngine(llm))
        return engines[-1]

    yield make
    for e in engines:
        e.shutdown()


@pytest.fixture(scope="module")
def engine(make_async_engine) -> AsyncEngine:
    """The module's default engine (tiny model, the test flags)."""
    return make_async_engine()


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[LiveServer]:
    """A real uvicorn server on 127.0.0.1 in front of `engine`."""
    with serve(engine) as s:
        yield s
