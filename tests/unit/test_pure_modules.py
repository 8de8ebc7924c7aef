"""The pure modules (protocol, topology, layout, regions, tracking, chunking) import no transport, framework or
backend: they hold the logic and must stay testable and importable without sockets or devices.

Checked twice: statically, by reading each file's imports (including ``importlib``/``__import__``
calls with a literal name), and at run time, by importing the modules in a fresh interpreter and
looking at ``sys.modules``, which also catches a forbidden import made by something they import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import rd2h

PACKAGE = Path(rd2h.__file__).parent
REQUIRED = ["protocol", "topology", "layout", "planning", "tracking", "slots", "statemachine", "regions", "chunking", "coverage"]  # must exist
OPTIONAL: list[str] = []  # checked once they exist

FORBIDDEN_TOP = {"zmq", "torch", "torch_npu", "vllm", "memfabric_hybrid", "stevedore"}
# I/O from the standard library: checked in the source only (a dependency may load them)
FORBIDDEN_STDLIB = {"socket", "subprocess", "multiprocessing", "asyncio", "selectors"}
# rd2h modules that own threads, sockets or plugins, or import frameworks
FORBIDDEN_RD2H = {"source", "sink", "plugins", "api", "cli", "vllm", "proxy", "testing"}


def forbidden(name: str, *, stdlib: bool = True) -> bool:
    parts = name.split(".")
    if stdlib and parts[0] in FORBIDDEN_STDLIB:
        return True
    if parts[0] in FORBIDDEN_TOP or parts[0].startswith("rd2h_"):
        return True
    return parts[0] == "rd2h" and len(parts) > 1 and parts[1] in FORBIDDEN_RD2H


def imported_names(path: Path) -> list[str]:
    """Every module name the file imports, resolved to absolute names inside rd2h."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: rd2h/<file>.py sits in package rd2h
                base = "rd2h" + (f".{base}" if base else "")
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names if base == "rd2h"]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.append(arg.value)
    return names


def module_path(name: str) -> Path:
    path = PACKAGE / f"{name}.py"
    if not path.exists() and name in OPTIONAL:
        pytest.skip(f"rd2h/{name}.py does not exist yet")
    assert path.exists(), f"rd2h/{name}.py is missing"
    return path


@pytest.mark.parametrize("name", REQUIRED + OPTIONAL)
def test_pure_module_imports_nothing_forbidden(name: str) -> None:
    bad = sorted({n for n in imported_names(module_path(name)) if forbidden(n)})
    assert not bad, f"rd2h/{name}.py imports {bad}; pure modules must not"


def test_pure_modules_load_nothing_forbidden_at_run_time() -> None:
    present = [n for n in REQUIRED + OPTIONAL if (PACKAGE / f"{n}.py").exists()]
    assert "protocol" in present
    code = (
        "import importlib, json, sys\n"
        f"for n in {present!r}: importlib.import_module('rd2h.' + n)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if forbidden(m, stdlib=False)]
    assert not bad, f"importing {present} loads {bad}"


def test_the_scan_sees_forbidden_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nimport socket\nimport zmq.asyncio\nfrom torch import nn\nfrom . import sink\nfrom .plugins import load\n"
        "import importlib\nimportlib.import_module('rd2h_local')\n__import__('vllm')\n"
    )
    bad = sorted(n for n in imported_names(sample) if forbidden(n))
    assert bad == ["rd2h.plugins", "rd2h.sink", "rd2h_local", "socket", "torch", "vllm", "zmq.asyncio"]
