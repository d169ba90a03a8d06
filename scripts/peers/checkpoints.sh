#!/usr/bin/env bash
# Build the forced checkpoints (reused while the cases, the fixtures and the construction are
# unchanged) and print their folder, .cache/peers/checkpoint-sets/STAMP.
# .cache/peers may be shared by several checkouts, each with its own cases, and by runs at once: every
# set of cases gets its own folder, built under a lock and renamed into place whole, so one run never
# rebuilds or deletes the folder another is serving; .cache/peers/checkpoints links to the newest.
# The newest 4 sets (by last use) are kept. Callers that write into a set (conform.sh's GGUF files)
# take the same lock: flock .cache/peers/checkpoints.lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=.cache/peers
SETS=$PEERS/checkpoint-sets
# A hash of everything that decides the set (presets.set_stamp), as `conform --preset` names it.
[ -x .venv/bin/decodespec ] || make setup >/dev/null
stamp=$(.venv/bin/decodespec checkpoints stamp)
SET=$SETS/$stamp
mkdir -p "$SETS"
exec 9>"$PEERS/checkpoints.lock"
flock 9
if [ ! -d "$SET" ]; then
  rm -rf "$SET.partial"
  .venv/bin/decodespec checkpoints build --out "$SET.partial" >&2
  mv "$SET.partial" "$SET"
fi
touch "$SET"
if [ -d "$PEERS/checkpoints" ] && [ ! -L "$PEERS/checkpoints" ]; then  # the older layout, maybe still in use
  echo "$PEERS/checkpoints is a folder of the older layout (rebuilt in place); remove it to get the link" >&2
else
  ln -sfn "checkpoint-sets/$stamp" "$PEERS/checkpoints.new" && mv -T "$PEERS/checkpoints.new" "$PEERS/checkpoints"
fi
# A set may be a link to the folder it was built in under another name (the same checkpoints):
# removed as a name (no trailing slash, which would empty the folder), and links left dangling go.
ls -dt "$SETS"/*/ | tail -n +5 | sed 's:/$::' | xargs -r rm -rf
find "$SETS" -maxdepth 1 -xtype l -delete
echo "$SET"
