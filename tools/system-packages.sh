#!/usr/bin/env bash
# The Debian packages of tools/system-packages.txt, for `make setup` and .ci/run alike.
# Checks them first (one dpkg-query, so it runs on every `make setup`); installs what is missing
# with apt-get as root or through sudo that needs no password; otherwise stops with one line
# naming the packages and the command that installs them.
#   --check                 never install: that line and exit 1 if anything is missing
#   RD2H_SYSTEM_PACKAGES    another list of the same form (the tests use one)
set -euo pipefail

list=${RD2H_SYSTEM_PACKAGES:-$(dirname "$0")/system-packages.txt}
check_only=0
case "${1-}" in
  "") ;;
  --check) check_only=1 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

wanted=()
while read -r pkg _; do wanted+=("$pkg"); done < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$list")
[ "${#wanted[@]}" -gt 0 ] || exit 0

if ! command -v dpkg-query >/dev/null; then
  echo "system packages: no dpkg here, so nothing checked: the tests need the equivalents of ${wanted[*]}" >&2
  exit 0
fi

missing_packages() {
  local -A ok=()
  local pkg status
  while read -r pkg status; do
    [ "$status" = installed ] && ok[$pkg]=1
  done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' -- "${wanted[@]}" 2>/dev/null || true)
  for pkg in "${wanted[@]}"; do
    [ -n "${ok[$pkg]-}" ] || echo "$pkg"
  done
}

mapfile -t missing < <(missing_packages)
[ "${#missing[@]}" -eq 0 ] && exit 0

command_line="sudo apt-get update && sudo apt-get install -y ${missing[*]}"
[ "$(id -u)" = 0 ] && command_line="apt-get update && apt-get install -y ${missing[*]}"
stop() {
  echo "system packages: missing ${missing[*]} ($1); install them with: $command_line" >&2
  exit 1
}

[ "$check_only" = 1 ] && stop "--check installs nothing"
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  stop "not root, and sudo asks for a password"
fi

echo "system packages: installing ${missing[*]}" >&2
apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=300)
if ! "${apt[@]}" update >/dev/null || ! "${apt[@]}" install -y -- "${missing[@]}" >/dev/null; then
  stop "apt-get failed, above"
fi
mapfile -t missing < <(missing_packages)
[ "${#missing[@]}" -eq 0 ] || stop "still not installed after apt-get"
