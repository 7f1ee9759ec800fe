#!/bin/bash
# Device side: send a run directory back. A call returns at most 8 files of 16 MiB (64 MiB in
# all), and a served study with logprobs records hundreds of MB of JSONL, so the run goes back as
# one xz tarball split into 15 MiB parts, four per call:
#   bash scripts/device/pack.sh NAME        packs runs/NAME (once) and returns parts 0-3
#   bash scripts/device/pack.sh NAME 4      returns parts 4-7 (a later warm call), and so on
# Here: cat <files_at>/NAME.run.txz.* > NAME.run.txz; sha256sum -c NAME.run.txz.sha256; tar xJf ...
# By default the run is first compacted here (`bistat compact --slim`: lossless, each distinct
# output once) and packed without responses.jsonl, as it is committed (session 4: 12 MB instead
# of 127 MB). RAW=1 packs the run directory as recorded.
set -uo pipefail
. "$(dirname "$0")/env.sh"
NAME=$1; FIRST=${2:-0}
PK=/tmp/pack/$NAME
if [ ! -f "$PK/done" ]; then
  rm -rf "$PK"; mkdir -p "$PK"
  EXCLUDE=()
  if [ "${RAW:-0}" != 1 ]; then
    bistat compact "$REPO/runs/$NAME" --slim > /dev/null || { echo "[pack] compact failed: RAW=1 packs as recorded"; exit 1; }
    EXCLUDE=(--exclude "$NAME/responses.jsonl")
  fi
  tar cf - "${EXCLUDE[@]}" -C "$REPO/runs" "$NAME" | xz -T0 -6 > "$PK/$NAME.run.txz"
  (cd "$PK" && sha256sum "$NAME.run.txz" > "$NAME.run.txz.sha256" &&
   split -b 15m -d -a 2 "$NAME.run.txz" "$NAME.run.txz." && touch done)
fi
n=$(ls "$PK/$NAME.run.txz."[0-9][0-9] | wc -l)
cp "$PK/$NAME.run.txz.sha256" "$OUT/"
for i in $(seq "$FIRST" $((FIRST + 3))); do
  f=$(printf '%s/%s.run.txz.%02d' "$PK" "$NAME" "$i"); [ -f "$f" ] && cp "$f" "$OUT/"
done
echo "[pack] $NAME: $(du -h "$PK/$NAME.run.txz" | cut -f1) in $n part(s); returned parts $FIRST..$((FIRST + 3 < n - 1 ? FIRST + 3 : n - 1))" \
  "$([ $((FIRST + 4)) -lt "$n" ] && echo "; next: bash scripts/device/pack.sh $NAME $((FIRST + 4))")"
