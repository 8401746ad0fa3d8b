#!/bin/sh
# The init container of a pod whose image is the team's own (operator/inject.py): copies this
# bundle (weightlift's worker, its pure-Python dependencies and the compiled ones per Python ABI)
# into the pod's shared volume DEST. A failure (no space, a read-only volume) is a permanent
# WorkerReport in the termination log, which the replica's status names.
set -u
DEST=$1
SRC=$(cd "$(dirname "$0")" && pwd)
LOG=${WEIGHTLIFT_TERMINATION_LOG:-/dev/termination-log}
rm -f "$DEST/.complete" 2>/dev/null
if ! err=$(cp -R "$SRC/." "$DEST/" 2>&1); then
  need=$(du -sm "$SRC" 2>/dev/null | cut -f1)
  free=$(df -Pm "$DEST" 2>/dev/null | awk 'NR == 2 {print $4}')
  case $err in
    *"No space"*) reason=NoSpaceForWorker ;;
    *) reason=CopyFailed ;;
  esac
  detail=$(printf '%s' "$err" | tail -n 3 | tr '\n\t"\\' '  '"'"'/')
  printf '{"phase":"Failed","permanentFailure":true,"message":"%s: copying weightlift (%s MB) into %s (%s MB free) failed: %s"}' \
    "$reason" "${need:-?}" "$DEST" "${free:-?}" "$detail" >"$LOG" 2>/dev/null || true
  echo "weightlift copy: $reason: $err" >&2
  exit 1
fi
: >"$DEST/.complete"
