"""Test modules are imported by basename (pytest's default ``prepend`` import mode with no
``__init__.py``), so two test files of one name in different folders make the whole run
stop at collection ("import file mismatch"): caught here, naming both, before CI is."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLLECTED = ("tests", "backends", "bench")  # pyproject's testpaths


def test_every_test_module_has_a_basename_of_its_own() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for top in COLLECTED:
        for path in (ROOT / top).rglob("*.py"):
            if path.name.startswith("test_") and ".venv" not in path.parts:
                where[path.name].append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename (rename one): {clashes}"
