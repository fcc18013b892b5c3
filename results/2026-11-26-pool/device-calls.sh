#!/usr/bin/env bash
# experiment=learn_pool_gpu at its full budget, warm start WS (model.init_seed and warmstart.seed = WS) for seeds SEEDS.
# MODE=prep: the warm start, its pool and the seeds' control arms. MODE=arms: GRPO, RFT and the ceiling.
set -u
mkdir -p /tmp/pw /tmp/proj && tar -xf .vc/project.tar -C /tmp/pw && pip install -q --no-deps --no-index --target /tmp/proj /tmp/pw/*.whl || exit 1
export PYTHONPATH=/tmp/proj:$PWD PYTHONUNBUFFERED=1 ARL_CACHE_DIR=/tmp/cache ARL_OUTPUT_DIR=/tmp/out
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
E="experiment=learn_pool_gpu hydra/launcher=local_parallel"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt
python -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)" >> $OUT/env.txt 2>&1
start=$(date +%s)
if [ "$MODE" = prep ]; then
  timeout -s TERM 560 python launch.py $E algorithm=rft algorithm.max_steps=1 algorithm.test_at_end=false \
    warmstart.seed=$WS model.init_seed=$WS hydra.run.dir=/tmp/out/prep/pool-ws$WS > $OUT/pool-ws$WS.log 2>&1 &
  timeout -s TERM 560 python launch.py -m $E algorithm=sft_continue seed=$SEEDS warmstart.seed=$WS model.init_seed=$WS \
    hydra.launcher.n_jobs=3 hydra.sweep.dir=/tmp/out/control-ws$WS > $OUT/control-ws$WS.log 2>&1 &
  wait
  SWEEPS="prep control-ws$WS"
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
