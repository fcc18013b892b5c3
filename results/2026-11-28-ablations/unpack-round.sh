#!/usr/bin/env bash
# A round's three calls (device-calls.sh) into this folder, here, after the calls came back:
#   bash results/2026-11-28-ablations/unpack-round.sh ws2-3 /work/.device/4 /work/.device/5 /work/.device/6
# LABEL names the round's calls folder (calls/LABEL/: each call's env, load and logs files); the last call's runs
# archive holds every run of the round (each call packs all of /tmp/out) and goes into runs/, without checkpoints and
# with its bulky text gzipped (results/README.md). Nothing is written unless every call's files are there and none of
# the round's sweeps is in runs/ already. Then a report that reads no test score (--no-test: no look) into
# /tmp/ablations-check, and each run's status (PYTHON: the interpreter, default python).
set -eu
[ $# -ge 2 ] || { echo "usage: $0 LABEL CALL_DIR..."; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
label=$1; shift
shopt -s nullglob
# every check before anything is written: a refused round leaves this folder as it was
[ ! -e "$here/calls/$label" ] || { echo "calls/$label exists already"; exit 1; }
for call in "$@"; do
  for kind in env load logs; do
    files=("$call"/$kind-*)
    [ ${#files[@]} -gt 0 ] || { echo "no $kind-* file in $call (a call's files_at folder)"; exit 1; }
  done
done
last=("${@: -1}"/runs-*.tgz)
[ ${#last[@]} -eq 1 ] || { echo "not one runs-*.tgz in ${*: -1} (the round's last call)"; exit 1; }
new=$(mktemp -d)
trap 'rm -rf "$new"' EXIT
tar -xzf "${last[0]}" -C "$new"
sweeps=("$new"/*/)
[ ${#sweeps[@]} -gt 0 ] || { echo "no sweep in ${last[0]}"; exit 1; }
for sweep in "${sweeps[@]}"; do  # one sweep a warm start and cell: a round's sweeps are new to runs/
  name=$(basename "$sweep")
  [ ! -e "$here/runs/$name" ] || { echo "runs/$name exists already: nothing unpacked"; exit 1; }
done
find "$new" -name checkpoints -type d -prune -exec rm -rf {} +
find "$new" \( -name metrics.jsonl -o -name launch.log -o -name splits.json -o -path '*/samples/*.jsonl' \) \
  -exec gzip -n -9 {} +
mkdir -p "$here/runs" "$here/calls/$label"
cp -r "$new"/* "$here/runs/"
for call in "$@"; do
  cp "$call"/env-*.txt "$call"/load-*.txt "$call"/logs-*.tgz "$here/calls/$label/"
done
cd "$root"
PYTHONPATH=. "${PYTHON:-python}" -m analysis.report "$here/runs" --no-test --out /tmp/ablations-check
"${PYTHON:-python}" - "$here/runs" <<'PY'
import collections, json, pathlib, sys
statuses = collections.Counter()
for summary in sorted(pathlib.Path(sys.argv[1]).glob("*/*/summary.json")):
    status = json.loads(summary.read_text()).get("status")
    statuses[status] += 1
    if status != "completed":
        print(f"{summary.parent.relative_to(sys.argv[1])}: {status}")
print(", ".join(f"{n} {s}" for s, n in sorted(statuses.items())), "runs in runs/")
PY
