#!/bin/bash
# Install wheels (or a project folder) into the site SITE, merging with what SITE already holds.
#   bash scripts/device/site_install.sh SITE PIP_ARGS...     e.g. SITE /tmp/pl/payload/whl/*.whl
# `pip install --target SITE` installs into a temporary prefix and then moves each top-level entry
# into SITE, skipping (with only a warning) every one that SITE already has: a second wheel of a
# shared folder (nvidia_cutlass_dsl/ holds libs-base's and libs-core's parts) is then silently
# not installed. Here pip installs into a new, empty folder, which is then merged into SITE file
# by file. Every pip message is shown; pip failing stops the script (exit 1), and so does a merge
# that could not copy a file (exit 2).
set -u
SITE=${1:?usage: site_install.sh SITE PIP_ARGS...}; shift
mkdir -p "$SITE" || exit 2
NEW=$(mktemp -d "${SITE%/}.new.XXXXXX") || exit 2
trap 'rm -rf "$NEW"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --root-user-action=ignore --target "$NEW" "$@" || { echo "[site-install] pip failed: $*"; exit 1; }
shared=$(cd "$NEW" && for e in *; do [ -d "$SITE/$e" ] && [ -d "$e" ] && echo "$e"; done | grep -v '^bin$' | tr '\n' ' ')
cp -a "$NEW"/. "$SITE"/ || { echo "[site-install] could not merge $NEW into $SITE"; exit 2; }
echo "[site-install] $(ls "$NEW" | wc -l) top-level entries into $SITE${shared:+; merged into folders it had: $shared}"
