#!/bin/sh
# The init container of a pod whose image is the team's own (operator/inject.py): copies this
# bundle (weightlift's worker, its pure-Python dependencies and the compiled ones per Python ABI)
# into the pod's shared volume DEST. A failure (no space, a read-only volume) is a permanent
# WorkerReport in the termination log, which the replica's status names.
#   copy.sh DEST [MODULE...]   MODULE: a bundled dependency this pod needs no copy of (the
#                              operator knows from the spec: boto3 without s3://, NIXL without P2P)
set -u
DEST=$1
shift
SRC=$(cd "${0%/*}" && pwd)
LOG=${WEIGHTLIFT_TERMINATION_LOG:-/dev/termination-log}
rm -f "$DEST/.complete" 2>/dev/null

copy() {
  for entry in "$SRC"/* "$SRC"/.[!.]*; do
    [ -e "$entry" ] || continue
    case ${entry##*/} in
      deps | abi) ;;
      *) cp -R "$entry" "$DEST/" || return 1 ;;
    esac
  done
  for entry in "$SRC"/deps/* "$SRC"/abi/*/*; do
    [ -e "$entry" ] || continue
    for skip in "$@"; do
      [ "${entry##*/}" = "$skip" ] && continue 2
    done
    rel=${entry#"$SRC"/}
    mkdir -p "$DEST/${rel%/*}" && cp -R "$entry" "$DEST/$rel" || return 1
  done
}

if ! err=$(copy "$@" 2>&1); then
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
