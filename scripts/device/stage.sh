#!/bin/bash
# Device side, one call per payload part: move the carried part out of the repo copy into /tmp,
# which lasts while the machine stays warm (30 s after a call).
#   0.25:   carry .dev/p/partNN (and .dev/p/SHA256)           -> /tmp/stage
#   latest: carry .dev/latest/p/partNN (and .dev/latest/p/SHA256SUMS, any call) -> "$L"
# Whichever payload's parts were carried is staged; no variable needed. (STAGE_LATEST moves the
# latest payload's staging folder, for tests.)
L=${STAGE_LATEST:-/tmp/stage-latest}
if [ -n "$(ls .dev/latest/p 2>/dev/null)" ]; then
  mkdir -p "$L" && mv .dev/latest/p/part[0-9][0-9] "$L"/ 2>/dev/null
  [ -f .dev/latest/p/SHA256SUMS ] && cp .dev/latest/p/SHA256SUMS "$L"/SHA256SUMS
  have=$(ls "$L" | grep -c '^part'); want=$(wc -l < "$L/SHA256SUMS" 2>/dev/null || echo '?')
  echo "stage latest: $have of $want parts ($(ls "$L" | grep '^part' | tail -1) last), $(du -sm "$L" | cut -f1) MiB"
  exit 0
fi
mkdir -p /tmp/stage && mv .dev/p/part* /tmp/stage/ 2>/dev/null
[ -f .dev/p/SHA256 ] && cp .dev/p/SHA256 /tmp/stage/SHA256
echo "stage: $(ls /tmp/stage | tr '\n' ' ') total $(du -sm /tmp/stage | cut -f1) MiB"
