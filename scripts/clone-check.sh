#!/usr/bin/env bash
# A clone on its own passes its tests (run by .ci/run after the normal test run): copies the
# repository's files (tracked, and untracked ones git does not ignore) into a fresh temporary
# directory with no ../shared beside it and runs `cargo test --workspace` there (or the cargo
# test arguments given, e.g. `scripts/clone-check.sh -p moe-lanes --test chat_templates`), with
# target/clone-check/ as CARGO_TARGET_DIR (its own: cargo does not rebuild an unchanged crate
# for a new path, so sharing target/ ran the checkout's test binaries, which read the
# checkout's files, not the copy's; the first run builds the dependencies once).
# A test that reads the design repository (../shared) fails there. Removes the copy at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
# One fixed path, not a fresh temporary name: the test binaries keep the path they were built
# at (env!("CARGO_MANIFEST_DIR")), and target/clone-check/ keeps them between runs.
tmp="${TMPDIR:-/tmp}/moe-lanes-clone"
rm -rf "$tmp"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
copy="$tmp/moe-lanes"
mkdir "$copy"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  # Deleted but not yet committed files are still listed as cached.
  if [ -e "$f" ]; then printf '%s\0' "$f"; fi
done | tar -C "$repo" --null -T - -cf - | tar -C "$copy" -xf -
if [ -e "$tmp/shared" ]; then
  echo "clone-check: $tmp/shared exists; the copy must have no ../shared" >&2
  exit 1
fi
echo "clone-check: cargo test in $copy (no ../shared beside it)" >&2
[ "$#" -gt 0 ] || set -- --workspace
cd "$copy"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target/clone-check}" cargo test "$@"
