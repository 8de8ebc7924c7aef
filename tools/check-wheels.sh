#!/usr/bin/env bash
# Every distribution of this repository (rd2h and backends/*) builds an sdist and a wheel (the
# wheel from the sdist) with no deprecation warning, `twine check --strict` passes, and rd2h with
# its default backends installs from those wheels into a clean venv where `rd2h demo` runs.
# Uses build and twine from $PY (default .venv/bin/python: the dev extra has them); the clean venv
# is made by $PYTHON (default python3) and gets torch==2.13.0, as the Makefile does, through pip's
# cache. Everything goes in a temporary directory, removed at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTHON=${PYTHON:-python3}
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/rd2h-wheels.XXXXXX")
trap 'rm -rf "$work"' EXIT
dist=$work/dist

for project in . backends/*/; do
  log=$work/build.log
  if ! "$PY" -m build --outdir "$dist" "$project" >"$log" 2>&1; then
    cat "$log" >&2
    echo "check-wheels: $project does not build" >&2
    exit 1
  fi
  if grep -iE "deprecat|SetuptoolsWarning" "$log" >&2; then
    echo "check-wheels: $project builds with the warnings above" >&2
    exit 1
  fi
done
"$PY" -m twine check --strict "$dist"/*
"$PY" - "$dist"/*.whl <<'EOF'
import sys, zipfile
for wheel in sys.argv[1:]:  # the license text travels in every wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), f"no LICENSE in {wheel}"
EOF

"$PYTHON" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
# the files themselves: no index is asked for a distribution named rd2h*
"${pip[@]}" "$dist"/rd2h-*.whl "$dist"/rd2h_zmq-*.whl "$dist"/rd2h_local-*.whl
cd "$work"  # nothing of the checkout on sys.path
"$work/venv/bin/python" - "$work/venv" <<'EOF'
import importlib.metadata, sys
import rd2h, rd2h_local, rd2h_zmq
for module, dist in ((rd2h, "rd2h"), (rd2h_zmq, "rd2h-zmq"), (rd2h_local, "rd2h-local")):
    assert module.__file__.startswith(sys.argv[1]), f"{module.__name__} from {module.__file__}"
    assert module.__version__ == importlib.metadata.version(dist), (dist, module.__version__)
EOF
"$work/venv/bin/rd2h" --version
"$work/venv/bin/rd2h" backends
"$work/venv/bin/rd2h" demo
echo "check-wheels: $(ls "$dist" | wc -l) distributions built, checked, installed and run in $((SECONDS - start)) s"
