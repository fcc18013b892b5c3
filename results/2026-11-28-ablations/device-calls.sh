#!/usr/bin/env bash
# The pilot of experiment=learn-pool-gpu-ablations, warm start WSg on GPU g (as many of WS0-WS3 as are set: two on an
# nvidia-h200-x2 machine, four on an nvidia-h200-x4, the same GPU, cores and memory a GPU), three calls back to back
# on one warm machine (the warm starts and pools stay in /tmp/cache; a fresh machine builds the warm starts again, and
# a rebuild is other weights):
#   MODE=pools WS0=100 WS1=101 [WS2=102 WS3=103]: each warm start built once, and each cell's pool (the pool depends
#     on the agent and the lengths: every cell samples its own) by a one-step run of each cell (in /tmp/prep, not
#     returned)
#   MODE=cells-a (the same WSg): the baseline and no-check-step cells, seeds 2W and 2W+1 (four runs a GPU)
#   MODE=cells-b (the same WSg): the one-turn and short-context cells, likewise
# Pilot warm starts are none of the study's (W = 100-103, as the pool study's tuning stage). Then the plan again:
#   python -m analysis.plan results/2026-11-28-ablations/pilot/runs --mde 5 --experiment learn-pool-gpu-ablations \
#       --treatment agent.check_step=false --baseline agent.check_step=true --out results/2026-11-28-ablations/pilot
# Carries .vc/trl (python bench/gpu_wheels.py --stack trl .vc/trl); bench/device_call.sh does the rest of a call.
set -u
source bench/device_call.sh
device_call_begin

P="experiment=learn-pool-gpu-ablations"
declare -A CELL=(
  [baseline]=""
  [nocheck]="agent.check_step=false"
  [oneturn]="agent.max_turns=1"
  [short]="algorithm.max_response_length=256"
)
pids=()
cell() {  # cell GPU W NAME ROOT EXTRA...: the cell's sweep (both seeds) in the background, its log in $OUT
  local gpu=$1 w=$2 name=$3 root=$4; shift 4
  CUDA_VISIBLE_DEVICES=$gpu timeout -s TERM ${LIMIT:-540} python launch.py -m $P warmstart.seed=$w model.init_seed=$w \
    ${CELL[$name]} "$@" hydra/launcher=local_parallel hydra.launcher.n_jobs=4 hydra.sweep.dir=$root/ws$w-$name \
    > $OUT/ws$w-$name.log 2>&1 &
  pids+=($!)
}
case $MODE in
  pools) cells="baseline nocheck oneturn short"; extra="algorithm.flops_budget=null algorithm.max_steps=1 algorithm.val_points=null algorithm.test_at_end=false"; root=/tmp/prep ;;
  cells-a) cells="baseline nocheck"; extra=""; root=/tmp/out ;;
  cells-b) cells="oneturn short"; extra=""; root=/tmp/out ;;
  *) echo "unknown MODE=$MODE"; exit 2 ;;
esac
seeds() { [ $MODE = pools ] && echo "seed=$((2 * $1))" || echo "seed=$((2 * $1)),$((2 * $1 + 1))"; }
for c in $cells; do
  for g in 0 1 2 3; do
    w=$(eval echo "\${WS$g:-}")
    [ -z "$w" ] && continue
    cell $g $w $c $root $extra $(seeds $w)
  done
done
wait "${pids[@]}"
device_call_end
