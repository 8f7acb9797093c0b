"""Shared fixtures: tiny random models written once per session, and the real default model."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import TinySpec, write_tiny  # noqa: E402

VECTORS = Path(__file__).parent / "vectors"

# the fixtures that load a real model (seconds to minutes): every test using one is `slow`, so that
# `make test-fast` (-m "not slow") leaves out exactly the tests that need the packaged models
REAL_MODEL_FIXTURES = {"smollm2_path", "smollm2", "qwen", "qwen_path", "gemma"}


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Keep the weights-digest cache out of the user's home."""
    os.environ["KVSESSION_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """tiny_factory(spec) -> path of a GGUF written once per spec for the whole run."""
    root = tmp_path_factory.mktemp("tiny")
    made: dict[TinySpec, Path] = {}

    def make(spec: TinySpec = TinySpec()) -> Path:
        if spec not in made:
            made[spec] = write_tiny(root / f"tiny{len(made)}.gguf", spec)
        return made[spec]

    return make


@pytest.fixture(scope="session")
def tiny_path(tiny_factory) -> Path:
    return tiny_factory(TinySpec())


@pytest.fixture(scope="session")
def tiny_engine(tiny_path):
    from kvsession.engine import Engine

    return Engine.load(tiny_path, device="cpu", precision="f32")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from kvsession.engine import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from kvsession.engine import Engine

    return Engine.load(smollm2_path, device="cpu")


@pytest.fixture(scope="session")
def qwen():
    """Qwen2.5-Coder-0.5B-Instruct, the tool-capable model (loaded once: about 7 s)."""
    from kvsession.engine import Engine

    return Engine.load("qwen2.5-coder-0.5b", device="cpu")


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    from kvsession.engine import model_path

    return model_path("qwen2.5-coder-0.5b")
