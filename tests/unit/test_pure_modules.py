"""The pure modules import no transport, framework, thread or runtime: they hold the logic and must
stay testable and importable without sockets or devices.

The rule itself is the import-linter contract ``pure`` in pyproject.toml (run by
test_import_contracts.py). These checks cover what import-linter cannot see, for the same module
list: ``importlib``/``__import__`` calls with a literal name in the source, and what importing the
modules in a fresh interpreter really loads (``sys.modules``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import rd2h

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PACKAGE = Path(rd2h.__file__).parent
PYPROJECT = PACKAGE.parent / "pyproject.toml"


def _pure_contract() -> dict:
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c.get("id") == "pure")


CONTRACT = _pure_contract()
PURE = [name.removeprefix("rd2h.") for name in CONTRACT["source_modules"]]
FORBIDDEN = tuple(CONTRACT["forbidden_modules"])
IGNORED = {tuple(part.strip() for part in rule.split("->")) for rule in CONTRACT.get("ignore_imports", [])}


def forbidden(name: str, *, importer: str = "", stdlib: bool = True) -> bool:
    if (importer, name) in IGNORED:
        return False
    if not stdlib and name.split(".")[0] in sys.stdlib_module_names:
        return False
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def imported_names(path: Path, package: str = "rd2h") -> list[str]:
    """Every module name the file imports, resolved to absolute names inside rd2h (``package``
    is the one the file sits in, for relative imports)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the file's package (one level up per extra dot)
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = parent + (f".{base}" if base else "")
            names.append(base)
            if (PACKAGE.parent / base.replace(".", "/")).is_dir():  # a package: the names may be modules
                names += [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.append(arg.value)
    return names


@pytest.mark.parametrize("name", PURE)
def test_pure_module_imports_nothing_forbidden(name: str) -> None:
    path = PACKAGE / (name.replace(".", "/") + ".py")
    package = "rd2h." + name.rpartition(".")[0] if "." in name else "rd2h"
    assert path.exists(), f"{path} is in the import contract but missing"
    bad = sorted({n for n in imported_names(path, package) if forbidden(n, importer=f"rd2h.{name}")})
    assert not bad, f"{path} imports {bad}; pure modules must not"


def test_pure_modules_load_nothing_forbidden_at_run_time() -> None:
    assert "wire.protocol" in PURE and "layout.layers" in PURE
    code = (
        "import importlib, json, sys\n"
        f"for n in {PURE!r}: importlib.import_module('rd2h.' + n)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout)
    # the standard library's own modules (threading, socket) may be loaded by a dependency
    bad = [m for m in loaded if forbidden(m, stdlib=False)]
    assert not bad, f"importing {PURE} loads {bad}"


def test_the_scan_sees_forbidden_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nimport socket\nimport zmq.asyncio\nfrom torch import nn\nfrom .decode import sink\nfrom .plugins import load\n"
        "import importlib\nimportlib.import_module('rd2h_local')\n__import__('vllm')\nimport threading\n"
    )
    bad = sorted(n for n in imported_names(sample) if forbidden(n))
    assert bad == ["rd2h.decode.sink", "rd2h.plugins", "rd2h_local", "socket", "threading", "torch", "vllm", "zmq.asyncio"]
