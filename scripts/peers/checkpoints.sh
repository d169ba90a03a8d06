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
# Everything that decides the set: the cases, the construction, the chat templates and tool list
# (chat_cases.py), the reasoning and tool tags the chat tokenizers add (runtime/channels.py).
stamp=$(cat properties/cases/*/*.json properties/conformance/forced.py properties/conformance/checkpoints.py \
        properties/conformance/chat_cases.py runtime/channels.py properties/fixtures.py | sha256sum | cut -c1-16)
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
ls -dt "$SETS"/*/ | tail -n +5 | xargs -r rm -rf
echo "$SET"
