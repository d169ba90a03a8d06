#!/usr/bin/env bash
# Build the forced checkpoints into .cache/peers/checkpoints (reused while the cases, the fixtures
# and the construction are unchanged) and print that folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
CKPTS=.cache/peers/checkpoints
stamp=$(cat properties/cases/*/*.json properties/conformance/forced.py properties/conformance/checkpoints.py \
        properties/fixtures.py | sha256sum | cut -c1-16)
if [ "$(cat "$CKPTS/.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$CKPTS"
  .venv/bin/decodespec checkpoints build --out "$CKPTS" >&2
  echo "$stamp" >"$CKPTS/.stamp"
fi
echo "$CKPTS"
