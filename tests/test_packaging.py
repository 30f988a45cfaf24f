"""A clean venv with `pip install .` (no extras) imports every module of the package: the runtime dependencies in
pyproject.toml are complete. pip's own cache makes a rerun quick; the first run needs PyPI."""

import json
import shutil
import subprocess
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = PYPROJECT["tool"]["setuptools"]["packages"]
CHECK = """
import importlib, json, pathlib, pkgutil, sys
failed, modules = {}, []
for package in sys.argv[1:]:
    root = importlib.import_module(package)
    modules.append(package)
    if not (pathlib.Path(root.__file__).parent / "py.typed").is_file():
        failed[package] = "no py.typed"
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        modules.append(info.name)
        try:
            importlib.import_module(info.name)
        except Exception as e:  # every failure is reported, not only the first
            failed[info.name] = f"{type(e).__name__}: {e}"
print(json.dumps({"modules": modules, "failed": failed, "files": [m.__file__ for m in map(sys.modules.get, sys.argv[1:])]}))
"""


@pytest.mark.packaging
def test_clean_install_imports_every_module(tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    # from a copy: setuptools builds in the source tree, and a `build/` left in the checkout would be reused
    source = shutil.copytree(ROOT, tmp_path / "source", ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", ".pytest_cache", "__pycache__"))
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(source)],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]
    # run outside the source tree, so only the installed copy can be imported
    check = subprocess.run([python, "-c", CHECK, *PACKAGES], capture_output=True, text=True, cwd=tmp_path,
                           timeout=600, env={"PATH": str(env / "bin"), "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"})
    assert check.returncode == 0, check.stderr[-3000:]
    result = json.loads(check.stdout.splitlines()[-1])
    assert result["failed"] == {}
    assert all(str(env) in f for f in result["files"]), result["files"]
    expected = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    assert set(result["modules"]) == expected
    # the console command and a module run as a program
    version = subprocess.run([env / "bin" / "jaxseek", "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert version.stdout.startswith("jaxseek ") and version.returncode == 0
    router = subprocess.run([python, "-m", "serving.api.router", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert router.returncode == 0 and "usage" in router.stdout, router.stderr[-2000:]
    assert any(env.glob("lib/python3.*/site-packages/jaxseek-*.dist-info/**/LICENSE"))
