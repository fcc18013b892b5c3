#!/usr/bin/env bash
# experiment=learn-pool-gpu-v2 on an nvidia-h200-x2 machine (2 x H200, 32 cores), two GPUs side by side.
# Tuning (experiment=learn-pool-gpu-v2-tune; warm start WS0 on GPU 0, WS1 on GPU 1):
#   MODE=tune-sft: each warm start (built here, shared) and its pool, and the SFT arms' tuning runs.
#   MODE=tune-rl: GRPO's and RFT's tuning runs (the next call on the same warm machine: the cache stays in /tmp/cache).
#   MODE=tune-sft-edge GRID=3e-4,1e-3: the SFT arms' grid extended past its edge, with its old edge again for a
#   comparison on the same build (a fresh machine builds the warm starts and pools again: their digests may differ).
# The main study at equal FLOPs (experiment=learn-pool-gpu-v2, each arm at its tuned learning rate; three warm starts
# a pair of calls, WS0 on GPU 0, WS1 on GPU 1, WS2's arms split between them: six runs a GPU, as in tuning):
#   MODE=main-sft WS0=0 WS1=1 WS2=2: the warm starts and pools (built once, here), both SFT arms, seeds 2W and 2W+1.
#   MODE=main-rl WS0=0 WS1=1 WS2=2: GRPO and RFT from the same builds (the next call on the same warm machine).
# The main study at equal GPU-seconds (experiment=learn-pool-gpu-v2-gpu-s; its own builds of the warm starts): the
# eight runs of a warm start side by side on one GPU for the whole budget, so every arm meets the same co-tenants;
# one warm start a GPU, warm start WSg on GPU g (as many of WS0-WS3 as are set): every GPU holds one warm start's
# eight runs and nothing else, so every warm start meets the same co-tenants (with a third split between the GPUs,
# twelve runs a GPU would fit the memory, ~114 GB of 141 at the equal-FLOPs calls' peaks, but SFT continued's 400 s of
# training plus its validations and the warm start's build under twelve co-tenants would come near the call's limit):
#   on nvidia-h200-x4 (4 x H200, 64 cores: the same GPU, cores and memory a GPU as the x2 machine):
#   MODE=gpu-s WS0=0 WS1=1 WS2=2 WS3=3 LIMIT=570   (then 4 5 6 7)
#   on nvidia-h200-x2: MODE=gpu-s WS0=0 WS1=1 LIMIT=570   (then 2 3, 4 5, 6 7)
# Carries .vc/trl (python bench/gpu_wheels.py --stack trl .vc/trl); bench/device_call.sh does the rest of a call.
set -u
source bench/device_call.sh
device_call_begin
GRID=${GRID:-3e-5,1e-4,3e-4}

sweep() {  # sweep GPU NAME OVERRIDES...: one multirun in the background, its log in $OUT
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout -s TERM ${LIMIT:-540} python launch.py -m "$@" hydra/launcher=local_parallel \
    hydra.launcher.n_jobs=6 hydra.sweep.dir=/tmp/out/$name > $OUT/$name.log 2>&1 &
  pids+=($!)
}
pids=()
ws() { echo "warmstart.seed=$1 model.init_seed=$1"; }
seeds() { echo "seed=$((2 * $1)),$((2 * $1 + 1))"; }
# each arm's learning rate chosen by the tuning stage (tuning/tuning.json, tuning/edge*/tuning.json)
GRPO="algorithm=grpo algorithm.learning_rate=1e-4"
RFT="algorithm=rft algorithm.learning_rate=1e-4"
CONT="algorithm=sft_continue algorithm.sft_learning_rate=3e-3"
GOLD="algorithm=sft_ceiling algorithm.sft_learning_rate=1e-3"
arm() {  # each arm at the learning rate the tuning stage chose
  case $1 in grpo) echo "$GRPO" ;; rft) echo "$RFT" ;; cont) echo "$CONT" ;; gold) echo "$GOLD" ;; esac
}
run_arms() {  # run_arms PRESET PREFIX ARM...: WS0's runs on GPU 0, WS1's on GPU 1; WS2's first half of the arms on
  # GPU 0, its second half on GPU 1 (every GPU the same number of runs); each arm's seeds 2W and 2W+1
  local preset=$1 prefix=$2 i=0 half
  shift 2
  half=$(( ($# + 1) / 2 ))
  for a in "$@"; do
    sweep 0 $prefix-ws$WS0-$a $preset $(ws $WS0) $(seeds $WS0) $(arm $a)
    [ -n "${WS1:-}" ] && sweep 1 $prefix-ws$WS1-$a $preset $(ws $WS1) $(seeds $WS1) $(arm $a)
    [ -n "${WS2:-}" ] && sweep $(( i < half ? 0 : 1 )) $prefix-ws$WS2-$a $preset $(ws $WS2) $(seeds $WS2) $(arm $a)
    i=$((i + 1))
  done
}
run_per_gpu() {  # run_per_gpu PRESET PREFIX ARM...: warm start WSg's runs, every arm, all on GPU g (g = 0-3, where set)
  local preset=$1 prefix=$2 g w a
  shift 2
  for g in 0 1 2 3; do
    w=$(eval echo "\${WS$g:-}")
    [ -z "$w" ] && continue
    for a in "$@"; do sweep $g $prefix-ws$w-$a $preset $(ws $w) $(seeds $w) $(arm $a); done
  done
}
M="experiment=learn-pool-gpu-v2"
T="experiment=learn-pool-gpu-v2-tune"
G="experiment=learn-pool-gpu-v2-gpu-s"

case $MODE in
  tune-*)
    gpu=0
    for W in ${WS0:-100} ${WS1:-101}; do
      case $MODE in
        tune-sft*) sweep $gpu $MODE-ws$W $T $(ws $W) algorithm=sft_continue,sft_ceiling algorithm.sft_learning_rate=$GRID ;;
        tune-rl) sweep $gpu $MODE-ws$W $T $(ws $W) algorithm=grpo,rft algorithm.learning_rate=$GRID ;;
      esac
      gpu=$((gpu + 1))
    done ;;
  main-sft) run_arms $M main cont gold ;;
  main-rl) run_arms $M main grpo rft ;;
  gpu-s) run_per_gpu $G gpu-s grpo cont rft gold ;;
  *) echo "unknown MODE=$MODE"; exit 2 ;;
esac
wait "${pids[@]}"
device_call_end
