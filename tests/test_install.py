"""kvsession installs without a C compiler, and runs on its PyTorch path, saying once why it is slower."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUN = """
import sys
from kvsession import kernels
from kvsession.engine import Engine
from kvsession.generate import generate_tokens
from kvsession.sampling import GREEDY
assert not kernels.available(), "the kernels are built"
engine = Engine.load(sys.argv[1])
s = engine.session(sampler=GREEDY)
s.prefill(engine.tokenizer.encode("the sea is on the string of words"))
print("tokens", list(generate_tokens(s, 4)))
"""


def test_an_install_without_a_compiler_runs_a_prompt(tmp_path, tiny_path):
    src = tmp_path / "src"  # a copy of the project: the build writes next to its sources
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    env = {**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false"}
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(src)], env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("kvsession-*.whl"))
    assert not any(n.endswith((".so", ".pyd")) for n in zipfile.ZipFile(wheel).namelist())
    # a fresh environment: the wheel, and this one's dependencies (torch and the rest) seen through a .pth
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run = subprocess.run([python, "-c", RUN, str(tiny_path)], capture_output=True, text=True, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("tokens [")
    assert run.stderr.count("dequantized to dense bfloat16, slowly") == 1
    assert "the block kernels are not built" in run.stderr


def test_the_kernels_are_built_where_there_is_a_compiler():
    """The extension is optional, so a build that failed would leave an install that works, slowly, and a suite
    whose kernel tests skip: where a compiler exists, it must have been built, with its best build chosen."""
    from kvsession import kernels

    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        return
    assert kernels.available(), kernels.unavailable_reason()
    assert "generic" in kernels.isas()
    if not os.environ.get("KVSESSION_ISA"):  # tools/avx2_emulate.sh sets it
        assert kernels.isa() == kernels.isas()[0]
