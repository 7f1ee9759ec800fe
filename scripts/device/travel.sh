#!/bin/bash
# What of this checkout travels with the next device calls (64 MiB per call, tree and carried
# payload part together). The whole tree (34 MB after session 4, mostly data/ and
# kernels/results/) left 29 MiB per call for the payload: 13 calls to stage it. A call that
# only stages a part needs scripts/device alone; the calls that install and run need the package,
# the kernels' tables, the declarations and registrations, not the committed data, findings,
# docs or tests.
#   bash scripts/device/travel.sh stage     only scripts/device/ travels (payload-staging calls)
#   bash scripts/device/travel.sh run       src/, kernels/ (less kernels/results/), scripts/,
#                                           experiments/, preregistrations/, README.md, pyproject.toml
#   bash scripts/device/travel.sh restore   everything again, as committed
#   bash scripts/device/travel.sh size      the bytes that would travel now
# How: the other tracked files leave git's index (`git rm --cached`, never the disk) and are
# ignored through .git/info/exclude; `restore` resets the index to HEAD and puts the exclude file
# back. So `stage` and `run` refuse while changes are staged (a reset would drop them): commit first.
# Never commit while a mode is on (`git status` shows the whole repository as deleted).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
GIT_DIR=$(git rev-parse --git-dir)
STATE="$GIT_DIR/bistat-travel"              # the mode now on
EXCLUDE="$GIT_DIR/info/exclude"
SAVED="$GIT_DIR/bistat-travel.exclude"      # the exclude file before it

tree_bytes() {
  { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s \
    | awk '{s+=$1} END {print s+0}'
}

restore() {
  [ -f "$STATE" ] || { echo "travel: nothing to restore (no mode on)"; return 0; }
  git reset -q
  if [ -f "$SAVED" ]; then mv "$SAVED" "$EXCLUDE"; else rm -f "$EXCLUDE"; fi
  rm -f "$STATE"
  echo "travel: restored; $(tree_bytes) bytes travel"
}

keep_only() {   # the paths (root-relative, folders with a trailing /) that stay tracked
  if [ -f "$STATE" ]; then restore > /dev/null; fi
  git diff --cached --quiet || {
    echo "travel: changes are staged in git's index; commit or unstage them first (restore resets the index to HEAD)"; exit 1; }
  mkdir -p "$(dirname "$EXCLUDE")"; touch "$EXCLUDE"; cp "$EXCLUDE" "$SAVED"
  echo "$1" > "$STATE"
  { echo "# added by scripts/device/travel.sh; travel.sh restore removes it"; echo "/*"
    for p in "${@:2}"; do echo "!/$p"; done; } >> "$EXCLUDE"
  git rm -r -q --cached -- . > /dev/null
  git add -- "${@:2}"                     # back into the index: the kept paths, as in the worktree
  echo "travel: mode $1; $(tree_bytes) bytes travel"
}

case "${1:-}" in
  stage) keep_only stage .gitignore scripts/ && {
           # within scripts/, only device/
           printf '%s\n' "/scripts/*" "!/scripts/device/" >> "$EXCLUDE"
           git rm -r -q --cached -- scripts > /dev/null; git add -- scripts/device
           echo "travel: stage narrowed to scripts/device; $(tree_bytes) bytes travel"; } ;;
  run)   keep_only run .gitignore src/ scripts/ experiments/ preregistrations/ README.md pyproject.toml kernels/ && {
           printf '%s\n' "/kernels/results/" >> "$EXCLUDE"
           git rm -r -q --cached -- kernels/results > /dev/null
           echo "travel: run without kernels/results; $(tree_bytes) bytes travel"; } ;;
  restore) restore ;;
  size)  echo "$(tree_bytes) bytes travel (mode: $(cat "$STATE" 2>/dev/null || echo none))" ;;
  *) echo "usage: bash scripts/device/travel.sh stage|run|restore|size"; exit 2 ;;
esac
