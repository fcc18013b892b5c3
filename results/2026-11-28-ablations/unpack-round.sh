#!/usr/bin/env bash
# A round's three calls (device-calls.sh) into this folder, here, after the calls came back:
#   bash results/2026-11-28-ablations/unpack-round.sh ws2-3 /work/.device/4 /work/.device/5 /work/.device/6
# LABEL names the round's calls folder (calls/LABEL/: each call's env, load and logs files); the last call's runs
# archive holds every run of the round (each call packs all of /tmp/out) and goes into runs/, without checkpoints and
# with its bulky text gzipped (results/README.md). A run folder already in runs/ is never overwritten. Then a report
# that reads no test score (--no-test: no look) into /tmp/ablations-check, and each run's status.
set -eu
[ $# -ge 2 ] || { echo "usage: $0 LABEL CALL_DIR..."; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
label=$1; shift
archive=$(ls "${@: -1}"/runs-*.tgz 2>/dev/null | head -1)
[ -n "$archive" ] || { echo "no runs-*.tgz in ${*: -1} (the round's last call)"; exit 1; }
[ ! -e "$here/calls/$label" ] || { echo "calls/$label exists already"; exit 1; }
new=$(mktemp -d)
trap 'rm -rf "$new"' EXIT
tar -xzf "$archive" -C "$new"
for sweep in "$new"/*/; do
  for run in "$sweep"*/; do
    name=${run#"$new"/}
    [ ! -e "$here/runs/$name" ] || { echo "runs/$name exists already: nothing unpacked"; exit 1; }
  done
done
find "$new" -name checkpoints -type d -prune -exec rm -rf {} +
find "$new" \( -name metrics.jsonl -o -name launch.log -o -name splits.json -o -path '*/samples/*.jsonl' \) \
  -exec gzip -n -9 {} +
mkdir -p "$here/runs" "$here/calls/$label"
cp -r "$new"/* "$here/runs/"
for call in "$@"; do
  cp "$call"/env-*.txt "$call"/load-*.txt "$call"/logs-*.tgz "$here/calls/$label/"
done
python -m analysis.report "$here/runs" --no-test --out /tmp/ablations-check
python - "$here/runs" <<'PY'
import collections, json, pathlib, sys
statuses = collections.Counter()
for summary in sorted(pathlib.Path(sys.argv[1]).glob("*/*/summary.json")):
    status = json.loads(summary.read_text()).get("status")
    statuses[status] += 1
    if status != "completed":
        print(f"{summary.parent.relative_to(sys.argv[1])}: {status}")
print(", ".join(f"{n} {s}" for s, n in sorted(statuses.items())), "runs in runs/")
PY
