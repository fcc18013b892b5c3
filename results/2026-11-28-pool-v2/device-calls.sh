#!/usr/bin/env bash
# experiment=learn-pool-gpu-v2 on an nvidia-h200-x2 machine: warm start WS0 on GPU 0, WS1 on GPU 1, side by side.
# MODE=tune-sft: each warm start (built here, shared) and its pool, and the SFT arms' tuning runs.
# MODE=tune-rl: GRPO's and RFT's tuning runs (the next call on the same warm machine: the cache stays in /tmp/cache).
# MODE=tune-sft-edge GRID=3e-4,1e-3: the SFT arms' grid extended past its edge, with its old edge again for a
# comparison on the same build (a fresh machine builds the warm starts and pools again: their digests may differ).
# Carries .vc/trl (python bench/gpu_wheels.py --stack trl .vc/trl).
set -u
mkdir -p /tmp/proj && bash .vc/trl/install.sh /tmp/proj > /dev/null || exit 1
export PYTHONPATH=/tmp/proj:$PWD PYTHONUNBUFFERED=1 ARL_CACHE_DIR=/tmp/cache ARL_OUTPUT_DIR=/tmp/out
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
E="experiment=learn-pool-gpu-v2-tune hydra/launcher=local_parallel hydra.launcher.n_jobs=6"
GRID=${GRID:-3e-5,1e-4,3e-4}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env-$MODE.txt
python -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)" >> $OUT/env-$MODE.txt 2>&1
git log -1 --format=%H >> $OUT/env-$MODE.txt 2>&1
start=$(date +%s)
gpu=0
for W in ${WS0:-100} ${WS1:-101}; do
  SFT="algorithm=sft_continue,sft_ceiling algorithm.sft_learning_rate=$GRID"
  RL="algorithm=grpo,rft algorithm.learning_rate=$GRID"
  case $MODE in
    tune-sft*) SWEEPS=(sft) ;;
    tune-rl*) SWEEPS=(rl) ;;
    *) SWEEPS=(sft rl) ;;
  esac
  for part in "${SWEEPS[@]}"; do
    if [ $part = sft ]; then ARMS=$SFT; else ARMS=$RL; fi
    name=$MODE-ws$W${SWEEPS[1]:+-$part}
    CUDA_VISIBLE_DEVICES=$gpu timeout -s TERM ${LIMIT:-540} python launch.py -m $E $ARMS warmstart.seed=$W \
      model.init_seed=$W hydra.sweep.dir=/tmp/out/$name > $OUT/$name.log 2>&1 &
  done
  gpu=$((gpu + 1))
done
wait
echo "exit after $(( $(date +%s) - start )) s" >> $OUT/env-$MODE.txt
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill $pid 2>/dev/null; done
ls -la /tmp/cache/warmstarts /tmp/cache/warmstarts/pools >> $OUT/env-$MODE.txt 2>&1
cat /tmp/cache/warmstarts/pools/*.json 2>/dev/null | grep -v '^  "' | head -40 >> $OUT/env-$MODE.txt
cd /tmp/out && tar -czf $OUT/runs-$MODE.tgz --exclude="checkpoint-*" --exclude=final --exclude="*.safetensors" $MODE-ws*
ls -la $OUT
