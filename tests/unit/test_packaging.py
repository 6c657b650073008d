"""The wheel installs one name, ``specpool`` (docs/ARCHITECTURE.md, "Layout").

Built from a copy of the tracked files, so neither the checkout's build/ folder nor anything
untracked can hide a packaging mistake; then installed into a fresh virtual environment, without
dependencies, to show what an installed environment holds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _tracked_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        source = REPO / rel
        if source.is_file():  # a file deleted in the work tree but not yet in git
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = _tracked_copy(tmp_path_factory.mktemp("checkout"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(out)], check=True, capture_output=True)
    (built,) = out.glob("specpool-*.whl")
    return built


def test_the_wheel_holds_only_the_specpool_package(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"specpool", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    # The shipped zoo travels inside; the benchmarks, their results and the tests do not.
    assert "specpool/drafters/zoo/manifest.json" in names
    assert any(n.startswith("specpool/drafters/zoo/code/") and n.endswith(".safetensors") for n in names)
    assert "specpool/drafters/heads/manifest.json" in names  # the white-box heads too
    assert any(n.startswith("specpool/drafters/heads/general/") and n.endswith(".safetensors") for n in names)
    assert "specpool/v1/specpool_pb2_grpc.py" in names
    assert not [n for n in names if "/bench/" in n or n.startswith(("bench/", "tests/", "scripts/"))]


def test_an_installed_environment_imports_specpool_and_nothing_else(wheel: Path, tmp_path: Path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=True, system_site_packages=False)
    python = env / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)

    def imports(module: str) -> subprocess.CompletedProcess:
        # From a folder with nothing importable in it, so only site-packages can answer.
        return subprocess.run([str(python), "-c", f"import {module}"], cwd=tmp_path, capture_output=True, text=True)

    assert imports("specpool.core.defaults").returncode == 0  # torch-free: imports without dependencies
    for stray in ("router", "services", "drafters", "target", "bench"):
        result = imports(stray)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, stray
