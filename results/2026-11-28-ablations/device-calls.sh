#!/usr/bin/env bash
# experiment=learn-pool-gpu-ablations on the GPU, warm start WSg (as many of WS0-WS7 as are set) on GPU g mod the
# machine's GPUs: two warm starts a GPU as the pilot ran (WS0-WS1 on an nvidia-h200, WS0-WS3 on nvidia-h200-x2, WS0-WS7
# on nvidia-h200-x4: the same GPU, cores and memory a GPU), three calls back to back on one warm machine (the warm
# starts and pools stay in /tmp/cache; a fresh machine builds the warm starts again, and a rebuild is other weights:
# every cell of a warm start runs on the machine that built it, within its 30 minutes held):
#   MODE=pools WS0=W [WS1=.. WS7=..]: each warm start built once, by a one-step run of the baseline cell without its
#     pool (the pool is not in the warm start's key), then each cell's pool (the pool depends on the agent and the
#     lengths: every cell samples its own) by a one-step run of every cell from that warm start, side by side (in
#     /tmp/prep, not returned, no test split scored; the pilot sampled the baseline's pool in the build run, before
#     the others: the baseline's pool's ~2 minutes of sampling ahead of the rest); ~400 s for W=0 and W=1 on one H200;
#     then the short-context cell's runs start (seeds 2W and 2W+1, in /tmp/out) if 120 s are left before LIMIT, stop
#     at it with a checkpoint and resume in cells-b (from round 5 on: in round 4, cells-b's LIMIT stopped two of them
#     short of their budget, README.md)
#   MODE=cells-a (the same WSg): the baseline and no-check-step cells, seeds 2W and 2W+1 (four runs a warm start); at
#     equal FLOPs the no-check cell takes ~2.2x the steps (the pilot: ~415), more than a call's beside the baseline:
#     its runs stop at LIMIT with a checkpoint and resume in cells-b
#   MODE=cells-b (the same WSg): the one-turn and short-context cells, likewise, and the no-check cell's sweeps again
#     (completed runs are skipped: only a run still unfinished resumes)
# LIMIT: seconds from the call's start (after the wheels' install, ~20 s) until every sweep still running is stopped
#   (SIGTERM: a run saves after its step; SIGKILL 60 s later), 540 by default; the call's end then waits up to 70 s
#   for stopped runs and packs (round 1's calls ended 413-544 s after their start at LIMIT 480 and 540: 436-563 s).
# Every cell of warm start W loads the baseline's build (warmstart.path and its digest, /tmp/cache/ws<W>.args): the
# warm start's own key holds the agent's demonstrations and the lengths, so each cell would otherwise build, and
# start from, its own.
# STAGE=pilot (the default): warm starts 100-103 (none of the study's, as the pool study's tuning stage), no test
#   split scored (algorithm.test_at_end=false); then the plan of the three declared comparisons:
#   python -m analysis.plan results/2026-11-28-ablations/pilot/runs --mde 5 --experiment learn-pool-gpu-ablations \
#       --out results/2026-11-28-ablations/pilot
# STAGE=study: the study's warm starts (README.md: W = 0-9), each run scoring the test split once at its end; the
#   report on all of them is the study's look at them (look 2 in runs/ledger.jsonl: a check of round 1 made look 1;
#   check a round with unpack-round.sh, whose report reads no test score).
# Carries .vc/trl (bash bench/carry_parts.sh trl: gpu_wheels.py --stack trl --leave-out openai-agents; no run here
# imports openai-agents, and the 7 MiB it saves leave the carry room for every round's runs); bench/device_call.sh
# does the rest of a call; unpack-round.sh brings a round's calls into runs/ and calls/ here.
set -u
P="experiment=learn-pool-gpu-ablations"
case ${STAGE:-pilot} in
  pilot) P="$P algorithm.test_at_end=false" ;;
  study) ;;
  *) echo "unknown STAGE=$STAGE"; exit 2 ;;
esac
case ${MODE:-} in
  pools) ;;
  cells-a) names="baseline nocheck" ;;
  cells-b) names="oneturn short nocheck" ;;
  *) echo "unknown MODE=${MODE:-} (pools, cells-a or cells-b)"; exit 2 ;;
esac
LIMIT=${LIMIT:-540}
[[ $LIMIT =~ ^[0-9]+$ ]] || { echo "LIMIT=$LIMIT: seconds, a whole number"; exit 2; }
source bench/device_call.sh
device_call_begin
DEADLINE=$((DEVICE_CALL_START + LIMIT))

declare -A CELL=(
  [build]="algorithm.pool_samples=null"  # the baseline cell without its pool: only its warm start, built once
  [baseline]=""
  [nocheck]="agent.check_step=false"
  [oneturn]="agent.max_turns=1"
  [short]="algorithm.max_response_length=256"
)
cell() {  # cell GPU W NAME ROOT EXTRA...: the cell's sweep on GPU until the call's DEADLINE, its log in $OUT
  local gpu=$1 w=$2 name=$3 root=$4; shift 4
  local left=$((DEADLINE - $(date +%s)))
  if [ $left -lt 120 ]; then  # too little time for a run to load and take a step: it starts in the next call
    echo "not started: ${left} s left before LIMIT" >> $OUT/ws$w-$name.log
    return 0
  fi
  CUDA_VISIBLE_DEVICES=$gpu timeout -s TERM -k 60 $left python launch.py -m $P warmstart.seed=$w model.init_seed=$w \
    ${CELL[$name]} "$@" hydra/launcher=local_parallel hydra.launcher.n_jobs=4 hydra.sweep.dir=$root/ws$w-$name \
    >> $OUT/ws$w-$name.log 2>&1
}
cells() {  # cells GPU W NAME...: those cells' sweeps from W's warm start, seeds 2W and 2W+1, side by side, in /tmp/out
  local gpu=$1 w=$2 c; shift 2
  for c in "$@"; do cell $gpu $w $c /tmp/out $(cat /tmp/cache/ws$w.args) seed=$((2 * w)),$((2 * w + 1)) & done
  wait
}
built() {  # built W: the overrides that load W's warm start, as the pools call's build run built it
  python -c "
import glob, json
[summary] = glob.glob('/tmp/prep/ws$1-build/*/summary.json')
sft = json.load(open(summary))['sft']
print(f\"warmstart.path={sft['checkpoint']} warmstart.weights_sha256={sft['weights_sha256']}\")"
}
prep() {  # prep GPU W: W's warm start built once, then every cell's pool from it, side by side
  local gpu=$1 w=$2 c
  local once="algorithm.flops_budget=null algorithm.max_steps=1 algorithm.val_points=null seed=$((2 * w))"
  once="$once algorithm.test_at_end=false"
  cell $gpu $w build /tmp/prep $once
  mkdir -p /tmp/cache
  # the args file only once it holds them: without it, no cell of W runs (each would build a warm start of its own)
  built $w > /tmp/cache/ws$w.args.tmp && mv /tmp/cache/ws$w.args.tmp /tmp/cache/ws$w.args \
    || { echo "no warm start built for W=$w" >> $OUT/ws$w-build.log; return 1; }
  for c in baseline nocheck oneturn short; do cell $gpu $w $c /tmp/prep $once $(cat /tmp/cache/ws$w.args) & done
  wait
  cells $gpu $w short  # a head start in this call's time left (cell() starts nothing with under 120 s)
}
ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
pids=()
for g in 0 1 2 3 4 5 6 7; do
  w=$(eval echo "\${WS$g:-}")
  [ -z "$w" ] && continue
  if [ $MODE != pools ] && [ ! -s /tmp/cache/ws$w.args ]; then
    echo "W=$w: no warm start built (MODE=pools first, on this machine)" >> $OUT/env-$MODE.txt
    continue
  fi
  if [ $MODE = pools ]; then
    prep $((g % ngpu)) $w &
  else
    cells $((g % ngpu)) $w $names &
  fi
  pids+=($!)
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"  # none: a bare `wait` would wait for the load sampler, for ever
device_call_end
