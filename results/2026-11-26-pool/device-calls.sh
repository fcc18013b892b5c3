#!/usr/bin/env bash
# experiment=learn_pool_gpu at its full budget, two warm starts (ws0: init 0, SFT seed 0 for seeds 0-2; ws1: init 1,
# SFT seed 1 for seeds 3-5). MODE=prep: both warm starts, both pools, the six control arms. MODE=arms: GRPO, RFT and
# the ceiling for seeds $SEEDS from warm start $WS.
set -u
mkdir -p /tmp/pw /tmp/proj && tar -xf .vc/project.tar -C /tmp/pw && pip install -q --no-deps --no-index --target /tmp/proj /tmp/pw/*.whl || exit 1
export PYTHONPATH=/tmp/proj:$PWD PYTHONUNBUFFERED=1 ARL_CACHE_DIR=/tmp/cache ARL_OUTPUT_DIR=/tmp/out
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
E="experiment=learn_pool_gpu hydra/launcher=local_parallel"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt
python -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)" >> $OUT/env.txt 2>&1
start=$(date +%s)
if [ "$MODE" = prep ]; then
  for w in 0 1; do
    timeout -s TERM 560 python launch.py $E algorithm=rft algorithm.max_steps=1 algorithm.test_at_end=false \
      warmstart.seed=$w model.init_seed=$w hydra.run.dir=/tmp/out/prep/pool-ws$w > $OUT/pool-ws$w.log 2>&1 &
  done
  timeout -s TERM 560 python launch.py -m $E algorithm=sft_continue seed=0,1,2 warmstart.seed=0 model.init_seed=0 \
    hydra.launcher.n_jobs=3 hydra.sweep.dir=/tmp/out/control-ws0 > $OUT/control-ws0.log 2>&1 &
  timeout -s TERM 560 python launch.py -m $E algorithm=sft_continue seed=3,4,5 warmstart.seed=1 model.init_seed=1 \
    hydra.launcher.n_jobs=3 hydra.sweep.dir=/tmp/out/control-ws1 > $OUT/control-ws1.log 2>&1 &
  wait
  SWEEPS="prep control-ws0 control-ws1"
else
  timeout -s TERM 560 python launch.py -m $E algorithm=grpo,rft,sft_ceiling seed=$SEEDS warmstart.seed=$WS \
    model.init_seed=$WS hydra.launcher.n_jobs=${JOBS:-9} hydra.sweep.dir=/tmp/out/arms-ws$WS > $OUT/arms-ws$WS.log 2>&1
  SWEEPS=arms-ws$WS
fi
echo "exit $? after $(( $(date +%s) - start )) s" >> $OUT/env.txt
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill $pid 2>/dev/null; done
ls -la /tmp/cache/warmstarts /tmp/cache/warmstarts/pools >> $OUT/env.txt 2>&1
cd /tmp/out && tar -czf $OUT/runs.tgz --exclude="checkpoint-*" --exclude=final --exclude="*.safetensors" $SWEEPS
ls -la $OUT
