#!/bin/bash
# What of this checkout travels with the next device calls (64 MiB per call, tree and carried
# payload part together). The whole tree (34 MB after session 4, mostly data/ and
# kernels/results/) left 29 MiB per call for the payload: 13 calls to stage it. A call that
# only stages a part needs scripts/device alone; the calls that install and run need the package,
# the kernels (the package kernels/bistat_kernels with its tables; kernels/device), the
# declarations and registrations, not the committed data, findings, docs or tests.
#   bash scripts/device/travel.sh stage     only scripts/device/ travels (payload-staging calls)
#   bash scripts/device/travel.sh run       src/, kernels/ (less kernels/results/), scripts/,
#                                           experiments/, preregistrations/, README.md, pyproject.toml,
#                                           and scripts/device/SOURCE_COMMIT ("SHA clean|dirty": the
#                                           commit that travels; env.sh exports it for the runs)
#   bash scripts/device/travel.sh restore   everything again, as committed
#   bash scripts/device/travel.sh size      the bytes that would travel now
# How: the other tracked files leave git's index (`git rm --cached`, never the disk) and are
# ignored through this worktree's own .gitignore, to which the mode's patterns are appended (its
# committed text is kept aside and put back by `restore`; the device tool reads .gitignore like
# git does, and other worktrees of the repository, which share .git/info/exclude, are not touched:
# their new files stay visible to `git add`). `restore` resets the index to HEAD. So `stage` and
# `run` refuse while changes are staged (a reset would drop them): commit first.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
GIT_DIR=$(git rev-parse --git-dir)
STATE="$GIT_DIR/bistat-travel"              # the mode now on
EXCLUDE=.gitignore                          # this worktree's; the mode's patterns go at its end
SAVED="$GIT_DIR/bistat-travel.gitignore"    # .gitignore as it was before the mode

tree_bytes() {
  { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s \
    | awk '{s+=$1} END {print s+0}'
}

SOURCE=scripts/device/SOURCE_COMMIT        # run mode: the commit this copy is of (env.sh exports it)

restore() {
  [ -f "$STATE" ] || { echo "travel: nothing to restore (no mode on)"; return 0; }
  git reset -q
  rm -f "$SOURCE"
  if [ -f "$SAVED" ]; then mv "$SAVED" "$EXCLUDE"; fi
  rm -f "$STATE"
  echo "travel: restored; $(tree_bytes) bytes travel"
}

keep_only() {   # the paths (root-relative, folders with a trailing /) that stay tracked
  if [ -f "$STATE" ]; then restore > /dev/null; fi
  git diff --cached --quiet || {
    echo "travel: changes are staged in git's index; commit or unstage them first (restore resets the index to HEAD)"; exit 1; }
  # what travels, read with no mode on (a mode's cut index and .gitignore would read as changes):
  # the commit, and whether tracked files differ from it (run mode writes both to $SOURCE)
  COMMIT=$(git rev-parse HEAD); STATE_OF_TREE=clean; git diff --quiet HEAD -- || STATE_OF_TREE=dirty
  cp "$EXCLUDE" "$SAVED"
  { echo "# written by scripts/device/travel.sh; travel.sh restore removes it"; echo "/*"
    for p in "${@:2}"; do echo "!/$p"; done; } >> "$EXCLUDE"
  echo "$1" > "$STATE"
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
  run)   # the device copy's own .git can be an earlier commit's: say which commit travels, and
         # whether tracked files differed from it (runs record it: bistat.run.fingerprint.git_info)
         keep_only run .gitignore src/ scripts/ experiments/ preregistrations/ README.md pyproject.toml kernels/ && {
           printf '%s\n' "/kernels/results/" >> "$EXCLUDE"
           git rm -r -q --cached -- kernels/results > /dev/null
           echo "$COMMIT $STATE_OF_TREE" > "$SOURCE"; git add -f -- "$SOURCE"
           echo "travel: $SOURCE says $COMMIT $STATE_OF_TREE"
           echo "travel: run without kernels/results; $(tree_bytes) bytes travel"; } ;;
  restore) restore ;;
  size)  echo "$(tree_bytes) bytes travel (mode: $(cat "$STATE" 2>/dev/null || echo none))" ;;
  *) echo "usage: bash scripts/device/travel.sh stage|run|restore|size"; exit 2 ;;
esac
