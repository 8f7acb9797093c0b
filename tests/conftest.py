"""Shared fixtures: tiny random models written once per session, and the real default model."""
from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import TinySpec, write_tiny  # noqa: E402

VECTORS = Path(__file__).parent / "vectors"

# the fixtures that load a real model (seconds to minutes): every test using one is `slow`, so that
# `make test-fast` (-m "not slow") leaves out exactly the tests that need the packaged models
REAL_MODEL_FIXTURES = {"smollm2_path", "smollm2", "qwen", "qwen_path", "gemma"}


# what starts another process: a server (server_proc.Server), the CLI, a helper script, a fresh venv
SPAWNS = re.compile(r"\bServer\(|\bsubprocess\.|\bpexpect\.|\bPopen\(|\bLocalValkey(Cluster)?\(|\bmultiprocessing\.")


def pytest_collection_modifyitems(items):
    """`slow`: a real model. `processes`: a server, the CLI or a helper in a process of its own, seen in the
    test's source, its fixtures', or a function of its module that they call (one level down): seconds each,
    where the rest take milliseconds, so `make test-fast` leaves both out."""
    spawning: dict = {}  # module -> a pattern of calls to its functions whose source starts a process, or None
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if REAL_MODEL_FIXTURES & names:
            item.add_marker(pytest.mark.slow)
        module = item.module
        if module not in spawning:
            spawners = [n for n, f in vars(module).items()
                        if inspect.isfunction(f) and f.__module__ == module.__name__ and _spawns(_source(f))]
            spawning[module] = re.compile(r"\b(" + "|".join(map(re.escape, spawners)) + r")\(") if spawners else None
        calls = spawning[module]
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        for src in map(_source, [item.function, *fixtures]):
            if _spawns(src) or (calls is not None and calls.search(src)):
                item.add_marker(pytest.mark.processes)
                break


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _spawns(src: str) -> bool:
    return SPAWNS.search(src) is not None


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
