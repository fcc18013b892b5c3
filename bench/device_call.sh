#!/usr/bin/env bash
# What every study's device script (results/*/device-calls.sh) does around its runs on a GPU machine, sourced:
#   source bench/device_call.sh; device_call_begin; ...its sweeps into /tmp/out, logs as $OUT/*.log...; device_call_end
# begin: the carried wheels installed (.vc/trl: python bench/gpu_wheels.py --stack trl [--leave-out openai-agents]
#   .vc/trl), the environment
#   (caches and runs under /tmp, NVLink multicast off), the machine's versions and commit in $OUT/env-$MODE.txt, and
#   its load every 20 s in $OUT/load-$MODE.txt (how many runs a GPU can take is measured, not guessed);
# end: the sampler stopped, this call's GPU processes ended (stopped runs given time to save first), the warm-start
#   cache listed, and what comes back packed in two archives (the device tool returns at most 8 files): the runs without
#   weights, and the sweeps' logs.
device_call_begin() {
  mkdir -p /tmp/proj && bash .vc/trl/install.sh /tmp/proj > /dev/null || exit 1
  export PYTHONPATH=/tmp/proj:$PWD PYTHONUNBUFFERED=1 ARL_CACHE_DIR=/tmp/cache ARL_OUTPUT_DIR=/tmp/out
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env-$MODE.txt
  python -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)" >> $OUT/env-$MODE.txt 2>&1
  git log -1 --format=%H >> $OUT/env-$MODE.txt 2>&1
  ( while true; do echo "$(date +%s) $(cut -d' ' -f1-3 /proc/loadavg) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader | tr '\n' ' ')"; sleep 20; done ) > $OUT/load-$MODE.txt 2>&1 &
  DEVICE_CALL_SAMPLER=$!
  DEVICE_CALL_START=$(date +%s)
}

device_call_end() {
  kill $DEVICE_CALL_SAMPLER
  # A run its sweep's timeout stopped saves a checkpoint after its step, in a worker process its launcher does not
  # wait for (joblib keeps the idle worker, and its GPU context, afterwards): up to 60 s for every run under /tmp/out
  # and /tmp/prep to have written the summary of its latest attempt; then this call's GPU processes are ended (a
  # second SIGTERM stops a run that is still training without a save) and, up to 10 s, gone.
  for _ in $(seq 60); do settled_runs && break; sleep 1; done
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill $pid 2>/dev/null; done
  for _ in $(seq 10); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break; sleep 1; done
  echo "exit after $(( $(date +%s) - DEVICE_CALL_START )) s" >> $OUT/env-$MODE.txt
  ls -la /tmp/cache/warmstarts /tmp/cache/warmstarts/pools >> $OUT/env-$MODE.txt 2>&1
  cat /tmp/cache/warmstarts/pools/*.json 2>/dev/null | grep -v '^  "' | head -40 >> $OUT/env-$MODE.txt
  [ -d /tmp/out ] && (cd /tmp/out && tar -czf $OUT/runs-$MODE.tgz --exclude="checkpoint-*" --exclude=final --exclude="*.safetensors" *)
  (cd $OUT && tar -czf logs-$MODE.tgz *.log && rm *.log)
  ls -la $OUT
}

settled_runs() {  # every run's summary.json records its latest attempt (attempts.jsonl: one line an attempt)
  python - <<'PY'
import json, pathlib, sys
for root in ("/tmp/out", "/tmp/prep"):
  for attempts in pathlib.Path(root).glob("*/*/attempts.jsonl"):
    summary = attempts.parent / "summary.json"
    latest = len(attempts.read_text().splitlines())
    if not summary.is_file() or json.loads(summary.read_text()).get("attempts") != latest:
      sys.exit(1)
PY
}
