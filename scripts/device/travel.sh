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
# ignored through an excludes file of this worktree alone (`core.excludesFile` in its
# config.worktree: other worktrees of the repository, and their untracked files, are not touched);
# `restore` resets the index to HEAD and removes that setting. So `stage` and `run` refuse while
# changes are staged (a reset would drop them): commit first.
# Never commit while a mode is on (`git status` shows the whole repository as deleted).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
GIT_DIR=$(git rev-parse --git-dir)
STATE="$GIT_DIR/bistat-travel"              # the mode now on
EXCLUDE="$GIT_DIR/bistat-travel.ignore"     # this worktree's excludes while a mode is on
SAVED="$GIT_DIR/bistat-travel.excludesfile" # core.excludesFile of this worktree before it, if any

tree_bytes() {
  { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s \
    | awk '{s+=$1} END {print s+0}'
}

restore() {
  [ -f "$STATE" ] || { echo "travel: nothing to restore (no mode on)"; return 0; }
  git reset -q
  if [ -s "$SAVED" ]; then git config --worktree core.excludesFile "$(cat "$SAVED")"
  else git config --worktree --unset core.excludesFile || true; fi
  rm -f "$EXCLUDE" "$SAVED" "$STATE"
  echo "travel: restored; $(tree_bytes) bytes travel"
}

keep_only() {   # the paths (root-relative, folders with a trailing /) that stay tracked
  if [ -f "$STATE" ]; then restore > /dev/null; fi
  git diff --cached --quiet || {
    echo "travel: changes are staged in git's index; commit or unstage them first (restore resets the index to HEAD)"; exit 1; }
  git config extensions.worktreeConfig true   # per-worktree settings (git >= 2.20)
  git config --worktree --get core.excludesFile > "$SAVED" || true
  # the repository's own excludes still apply, then everything but the kept paths
  { cat "$GIT_DIR/info/exclude" 2>/dev/null; [ -s "$SAVED" ] && cat "$(cat "$SAVED")" 2>/dev/null
    echo "# written by scripts/device/travel.sh; travel.sh restore removes it"; echo "/*"
    for p in "${@:2}"; do echo "!/$p"; done; } > "$EXCLUDE"
  git config --worktree core.excludesFile "$EXCLUDE"
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
  run)   keep_only run .gitignore src/ scripts/ experiments/ preregistrations/ README.md pyproject.toml kernels/ && {
           printf '%s\n' "/kernels/results/" >> "$EXCLUDE"
           git rm -r -q --cached -- kernels/results > /dev/null
           echo "travel: run without kernels/results; $(tree_bytes) bytes travel"; } ;;
  restore) restore ;;
  size)  echo "$(tree_bytes) bytes travel (mode: $(cat "$STATE" 2>/dev/null || echo none))" ;;
  *) echo "usage: bash scripts/device/travel.sh stage|run|restore|size"; exit 2 ;;
esac
