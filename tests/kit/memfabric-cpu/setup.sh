#!/usr/bin/env bash
# TEST-ONLY. Build the fake Ascend environment for memfabric-hybrid's host transports, once.
#
#   tests/kit/memfabric-cpu/setup.sh <python> [<outdir>]     (outdir defaults to <repo>/.rd2h-kit)
#
# <python> must be able to import memfabric_hybrid. Writes <outdir>/env.sh and prints its path on
# the last line of stdout. Skips the build when nothing it depends on changed (the kit sources, the
# wheel's libmf_hybm_core.so, the python), so calling it before every test run is cheap. Safe to call
# from several processes at once (flock). Needs gcc and strings (binutils).
set -euo pipefail
HERE=$(dirname "$(realpath "$0")")
PY=${1:?usage: setup.sh <python> [<outdir>]}
OUT=$(realpath -m "${2:-$HERE/../../../.rd2h-kit}")

for tool in gcc strings; do
  command -v "$tool" >/dev/null || { echo "setup.sh: '$tool' not found (install gcc / binutils)" >&2; exit 3; }
done
MFLIB=$("$PY" -c 'import os, importlib.util as u
s = u.find_spec("memfabric_hybrid")
if s is None: raise SystemExit("memfabric_hybrid is not installed for this python: pip install memfabric-hybrid==1.3.0")
print(os.path.join(os.path.dirname(s.origin), "lib"))')

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9

stamp=$( { cat "$HERE/realpath_shim.c" "$HERE/netns_exec.c" "$HERE/gen_fake_cann.py" "$HERE/setup_fake_ascend.sh";
           echo "$MFLIB" "$OUT"; sha256sum "$MFLIB/libmf_hybm_core.so"; } | sha256sum | cut -d' ' -f1)
if [ -f "$OUT/env.sh" ] && [ "$(cat "$OUT/.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$OUT/env.sh"
  exit 0
fi
rm -f "$OUT/.stamp"
bash "$HERE/setup_fake_ascend.sh" "$PY" "$OUT" >&2
echo "$stamp" > "$OUT/.stamp"
echo "$OUT/env.sh"
