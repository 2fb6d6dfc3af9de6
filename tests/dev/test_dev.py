"""The development area is checked though nothing routes it: every module of dev/ (not
installed: machine-code analysis, cost models) imports, and every script of tools/ and
benchmarks/ (run by hand on a GPU machine) compiles."""

import importlib
import py_compile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEV_MODULES = sorted(p.stem for p in (ROOT / "dev").glob("*.py") if p.stem != "__init__")
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for d in ("tools", "benchmarks") for p in (ROOT / d).glob("*.py"))


@pytest.mark.parametrize("name", DEV_MODULES)
def test_dev_module_imports(name):
    pytest.importorskip("triton")
    importlib.import_module(f"dev.{name}")


def test_dev_is_not_installed():
    import fp4attn

    assert DEV_MODULES
    assert not (Path(fp4attn.__file__).parent / "dev").exists()


@pytest.mark.parametrize("path", SCRIPTS)
def test_script_compiles(path, tmp_path):
    py_compile.compile(str(ROOT / path), cfile=str(tmp_path / "out.pyc"), doraise=True)
