#!/usr/bin/env bash
# The 1.5B agent step on one GPU (issue 49: <= 12 s, its synchronous baseline in the same call), run through the device
# tool on one warm machine: calls back to back in ONE message (a machine is given back 30 s after a call; /tmp stays):
#   1 call, carry [".vc"]:                    bash bench/agent_step_calls.sh trl
#       the trl stack to /tmp/proj (.vc/trl: bash bench/carry_parts.sh trl)
#   N calls, carry [".dv00"] ... :            bash bench/agent_step_calls.sh part    (the last: part install N)
#       vLLM 0.20.2's bundle, one part a call (a call carries the working tree too, 64 MiB in all): the closure of
#       ../shared/gpu/vllm-wheels.py in parts, each in a git-excluded folder of its own (.dvNN/partNN: `PART_MIB=16
#       bash bench/carry_parts.sh vllm` beside the 42 MB tree: 21 parts; VLLM_VERSION=0.22.0: 22); `install N` checks
#       that N parts came, joins them and installs to /tmp/site
#   2 calls:  bash bench/agent_step_calls.sh measure sync own-partial
#             bash bench/agent_step_calls.sh measure own in-partial
#       each variant in turn (vLLM starts anew in each: ~60 s of a variant's ~200 s), its JSON and log in $OUT, then
#       the table of the call's JSONs (bench/agent_rollouts.py --table); LIMIT (default 540) seconds from the call's
#       start, after which a variant still running is stopped (its JSON is then missing, its log says how far it got);
#       a variant is not started with under 200 s left; MICRO_BATCH (default 4) sets every variant's micro-batch
# Variants (bench/agent_rollouts.py, the 1.5B workload: 32 tasks x 4, 3 SQL turns with the check step, 4 timed steps
# after 1 warm-up, micro-batch 4, vLLM at 0.3 of the GPU: what bench/README.md's earlier rows ran):
#   sync         synchronous, vLLM in the trainer's process (the default)
#   own          algorithm.async_rollouts with backend.vllm_own_process=true (the fastest step so far)
#   own-partial  the same with algorithm.partial_rollouts (which also turns vLLM's asynchronous scheduling off:
#                vllm-project/vllm#42043; `own` keeps vLLM's default, on)
#   in-partial   partial rollouts with vLLM in the trainer's process
#   own-carry    own-partial with algorithm.carry_over: a step trains the groups finished first, the others carry over
#   own-carry-mps  own-carry with CUDA MPS (a daemon this script starts for the variant and stops after it): the
#                trainer's and vLLM's kernels then run side by side on the GPU's SMs instead of taking turns in time
#                slices, as two processes' kernels do without it: whether the update and generation slow each other less
#   own-carry-gc16-mps  own-carry-mps at micro-batch 16 with gradient checkpointing: a quarter of the micro-batches, so
#                fewer kernel launches a step (the profiled update kept the GPU busy 49 % of its time, launching ~200k
#                small kernels), at one more forward a micro-batch; checkpointing lets 16 fit beside vLLM
#   own-carry-gc8-mps  the same at micro-batch 8: half the micro-batches, a quarter of gc16's logits
#   own-carry-gc16-ra2-mps  own-carry-gc16-mps reading two steps ahead (algorithm.read_ahead_steps=2, max_staleness
#                3): each group has two steps to finish, and vLLM two steps' groups to batch (gc16's update beside
#                generation took 10 s, and its steps then alternated 11-13 s and 24-25 s, waiting for groups read
#                ahead one step before; not yet run); -ra3: three steps (max_staleness 4; not yet run); -ra2-kv40: two
#                steps with vLLM at 0.4 of the GPU, where more groups in flight outgrow 0.3's KV cache (~700,000
#                tokens by my estimate; gc16 peaked at 40 of 80 GiB in use; not yet run)
#   sync-peft-casts  sync with PEFT's casts of each adapter's input kept under bf16 autocast (--peft-casts): the
#                reference for the update without them (backends/trl/trainer.py), run beside `sync`
#   own-sync     synchronous with vLLM in its own process, the second timed step profiled (--profile-step 2): the
#                update's operators and kernels (with the weight sync and the agents' CPU work; generation runs in
#                vLLM's process), in the JSON's `profile`: where its 9.4 s on an H100 go (that step carries the
#                profiler's overhead: its time is not the variant's to compare)
#   own-carry-t64  own-carry at twice the tasks a step (64 x 4, 3 timed steps): twice the rollouts in flight, whether
#                generation's rate beside the update grows with them (carry-over's step is set by that rate; vLLM
#                sampled ~104 tokens an engine step of 256 allowed): a probe, not the workload
set -u -o pipefail
export PYTHONPATH=/tmp/proj:/tmp/site:$PWD PYTHONUNBUFFERED=1  # /tmp/proj first: this project pins openai < 3
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BENCH="bench/agent_rollouts.py --shape qwen25_1_5b --engine vllm --warmup 1 --steps 4 --micro-batch ${MICRO_BATCH:-4}"
OWN_CARRY="--async --partial --carry-over --override backend.vllm_gpu_memory_utilization=0.3
  backend.vllm_own_process=true"  # own-carry's, less its staleness bound
CARRY="$OWN_CARRY algorithm.max_staleness=2"  # own-carry's arguments
GC="backend.gradient_checkpointing=true"
declare -A VARIANT=(
  [sync]="--override backend.vllm_gpu_memory_utilization=0.3"
  [own]="--async --override backend.vllm_gpu_memory_utilization=0.3 backend.vllm_own_process=true"
  [own-partial]="--async --partial --override backend.vllm_gpu_memory_utilization=0.3 backend.vllm_own_process=true"
  [in-partial]="--async --partial --override backend.vllm_gpu_memory_utilization=0.3"
  [own-carry]="$CARRY"
  [own-carry-t64]="--tasks 64 --steps 3 $CARRY"
  [own-carry-mps]="$CARRY"
  [own-carry-gc16-mps]="--micro-batch 16 $CARRY $GC"
  [own-carry-gc8-mps]="--micro-batch 8 $CARRY $GC"
  [own-carry-gc16-ra2-mps]="--micro-batch 16 $OWN_CARRY algorithm.max_staleness=3 algorithm.read_ahead_steps=2 $GC"
  [own-carry-gc16-ra3-mps]="--micro-batch 16 $OWN_CARRY algorithm.max_staleness=4 algorithm.read_ahead_steps=3 $GC"
  [own-carry-gc16-ra2-kv40-mps]="--micro-batch 16 ${OWN_CARRY/=0.3/=0.4} algorithm.max_staleness=3
    algorithm.read_ahead_steps=2 $GC"
  [sync-peft-casts]="--peft-casts --override backend.vllm_gpu_memory_utilization=0.3"
  [own-sync]="--profile-step 2 --override backend.vllm_gpu_memory_utilization=0.3 backend.vllm_own_process=true"
)

mps() {  # mps start | stop: CUDA MPS's control daemon for this script's processes (pipes under /tmp/mps); its
  # variables are exported only once it runs, so a variant after a failed start runs without MPS
  local pipe=/tmp/mps/pipe log=/tmp/mps/log
  if [ "$1" = start ]; then
    mkdir -p $pipe $log && CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$log nvidia-cuda-mps-control -d &&
      export CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$log
  else
    echo quit | nvidia-cuda-mps-control
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
}

end_gpu_processes() {  # what a variant left on the GPU (a warm machine keeps it into the next call), up to 30 s
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill "$pid" 2>/dev/null; done
  for _ in $(seq 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && return; sleep 1; done
  echo "GPU processes still there after 30 s: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr '\n' ' ')"
}

case ${1:-} in
  trl)
    mkdir -p /tmp/proj && bash .vc/trl/install.sh /tmp/proj > /dev/null || exit 1
    python3 -c "import trl, peft; print('trl', trl.__version__, 'peft', peft.__version__)"
    ;;
  part)
    mkdir -p /tmp/vc && cp .dv*/part* /tmp/vc/ || exit 1
    echo "$(ls /tmp/vc | wc -l) parts in /tmp/vc"
    if [ "${2:-}" = install ]; then
      [ "$(ls /tmp/vc | wc -l)" = "${3:-}" ] || { echo "not installed: ${3:-?} parts expected"; exit 1; }
      mkdir -p /tmp/vb && cat /tmp/vc/part* | tar -xf - -C /tmp/vb || exit 1
      python3 -m pip install -q --no-deps --no-index --target /tmp/site /tmp/vb/*.whl 2>&1 | grep -vi warning
      python3 -c "import vllm, torch, trl; print('vllm', vllm.__version__, 'torch', torch.__version__)" || exit 1
    fi
    ;;
  measure)
    shift
    for name in "$@"; do [ -n "${VARIANT[$name]+set}" ] || { echo "unknown variant $name (${!VARIANT[*]})"; exit 2; }; done
    LIMIT=${LIMIT:-540}
    [[ $LIMIT =~ ^[0-9]+$ ]] || { echo "LIMIT=$LIMIT: seconds, a whole number"; exit 2; }
    deadline=$(($(date +%s) + LIMIT))
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/env.txt"
    git log -1 --format=%H >> "$OUT/env.txt" 2>&1
    for name in "$@"; do
      left=$((deadline - $(date +%s)))
      [ $left -ge 200 ] || { echo "$name: not started, $left s left" | tee -a "$OUT/env.txt"; continue; }
      if [[ $name == *-mps ]] && ! mps start; then
        echo "$name: not started, no MPS daemon" | tee -a "$OUT/env.txt"; continue
      fi
      start=$(date +%s)
      # shellcheck disable=SC2086  # the variant's arguments are words
      timeout -s TERM -k 20 $left python3 $BENCH ${VARIANT[$name]} --out "$OUT/agent_step_$name.json" \
        > "$OUT/$name.log" 2>&1
      echo "$name: exit $? after $(($(date +%s) - start)) s" | tee -a "$OUT/env.txt"
      if [[ $name == *-mps ]]; then mps stop; cp /tmp/mps/log/control.log "$OUT/$name-mps.log" 2>/dev/null; fi
      end_gpu_processes
    done
    ls "$OUT"/agent_step_*.json > /dev/null 2>&1 && python3 bench/agent_rollouts.py --table "$OUT"/agent_step_*.json
    ;;
  *)
    echo "usage: bash bench/agent_step_calls.sh trl | part [install N] | measure VARIANT... (${!VARIANT[*]})"
    exit 2
    ;;
esac
