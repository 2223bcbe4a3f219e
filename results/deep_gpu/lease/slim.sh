#!/usr/bin/env bash
# Here (the developer's machine), from the repository root: what travels with a device call is the tracked tree
# plus what git does not ignore, 51 MB in the thirty-third session, most of it past leases' results. `slim.sh on`
# takes results/ out of git's index (the files stay on disk, and HEAD is untouched) and ignores it through
# .git/info/exclude, keeping only what a job reads: results/lookup (the trees), results/deep_gpu/lease and the
# scripts and job folders named as arguments. The tree then weighs ~8 MB, and stage.sh cuts the model's wheel into
# two calls instead of fourteen. `slim.sh off` restores the index and the exclude file. Commit nothing in between:
# the index then says results/ is deleted (the thirty-ninth session's `git add -A` committed that deletion once), so
# `on` also installs a pre-commit hook that refuses every commit until `off` removes it.
#   bash results/deep_gpu/lease/slim.sh on results/deep_gpu/h100/v31 \
#       results/deep_gpu/{split_sweep,attention_feed}.py
#   bash results/deep_gpu/lease/stage.sh ... (the leases) ... bash results/deep_gpu/lease/slim.sh off
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=.git/info/exclude
hook=.git/hooks/pre-commit
case "${1:-}" in
  on)
    shift
    [ -z "$(git diff --cached --name-only)" ] || { echo "the index holds staged changes: commit them first" >&2; exit 2; }
    git rm -r -q --cached results
    git add results/lookup results/deep_gpu/lease "$@"
    grep -qx '/results/' "$exclude" 2>/dev/null || echo '/results/' >> "$exclude"
    mkdir -p "$(dirname "$hook")"
    printf '#!/bin/sh\necho "results/ is out of the index (slim.sh on): run slim.sh off before committing" >&2\nexit 1\n' \
      > "$hook" && chmod +x "$hook"
    echo "results/ out of the index; stage.sh prints what the tree now weighs"
    ;;
  off)
    sed -i '\#^/results/$#d' "$exclude"
    rm -f "$hook"
    git reset -q
    echo "index restored: $(git status --short | wc -l) changes against HEAD"
    ;;
  *) echo "usage: slim.sh on [PATH ...] | off" >&2; exit 2 ;;
esac
