#!/usr/bin/env bash
# What the device calls carry, built in this checkout from the package index (a new checkout has none of it; each is
# git-excluded here). A call carries the tracked tree and its `carry` paths, 64 MiB in all, so a stack travels in
# parts, one a call, each part in a top-level folder of its own:
#   bash bench/carry_parts.sh trl    .vc/trl (one 16 MiB part and install.sh): the trl stack without openai-agents,
#                                    for the ablation study's calls (results/2026-11-28-ablations/device-calls.sh) and
#                                    bench/agent_step_calls.sh's first call; ~30 s
#   bash bench/carry_parts.sh vllm   .dv00 .. .dvNN: vLLM 0.20.2's bundle (../shared/gpu/vllm-wheels.py) in 20 MiB
#                                    parts (17), .dvNN/partNN (bench/agent_step_calls.sh: `part`, the last `part install
#                                    N+1`); ~2 min. VLLM_VERSION=0.22.0: that release's closure instead (the same
#                                    script, its vLLM pin replaced; also built on torch 2.11), less the MLA and
#                                    mixed-precision kernels 0.22 adds (tokenspeed-*, humming-kernels: imported only
#                                    for other models and quantizations), with llguidance 1.6.1 for the 1.7 pinned
#                                    (below): 74 wheels, 22 parts of 16 MiB
#   bash bench/carry_parts.sh verl   .dl00 .. .dlNN: the verl stack (bench/gpu_wheels.py --stack verl) in 20 MiB parts,
#                                    .dlNN/partNN, install.sh with the last: there `cp .dlNN/* /tmp/vv/` a call, then
#                                    `bash /tmp/vv/install.sh /tmp/proj` once all are in; ~1 min
# PART_MIB (default 20): a part's size for vllm and verl. A call carries the tracked tree beside its part: 39 MB and a
# 20 MiB part came to 57.4 MiB on the device (2026-11-29); the tree is 42 MB since the ablation study's last round, so
# PART_MIB=16 (vLLM in 21 parts, `part install 21`) until it shrinks. Where tree + part nears 64 MiB: smaller parts.
# Each ends by listing what it wrote and the carry of each call.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PART_MIB=${PART_MIB:-20}
exclude() {  # a pattern in .git/info/exclude, once
  mkdir -p .git/info
  grep -qxF "$1" .git/info/exclude 2>/dev/null || echo "$1" >> .git/info/exclude
}
spread() {  # spread PREFIX PART...: each part into PREFIX<NN>/ (the old folders of PREFIX removed first)
  local prefix=$1 n=0 part; shift
  rm -rf "$prefix"[0-9][0-9]
  for part in "$@"; do
    local dir; dir=$(printf "%s%02d" "$prefix" "$n")
    mkdir -p "$dir" && mv "$part" "$dir/"
    n=$((n + 1))
  done
  printf '%s parts: carry ["%s00"] ... ["%s%02d"], one a call\n' "$n" "$prefix" "$prefix" $((n - 1))
}
case ${1:-} in
  trl)
    exclude "/.vc/"
    rm -rf .vc/trl
    "$PYTHON" bench/gpu_wheels.py --stack trl --leave-out openai-agents .vc/trl
    du -sh .vc/trl
    ;;
  vllm)
    exclude "/.dv[0-9][0-9]/"
    version=${VLLM_VERSION:-$(sed -n 's/^vllm==//p' constraints-vllm.txt)}  # default: the pinned release
    wheels=${VLLM_WHEELS:-/tmp/vllm-wheels-$version}
    if [ ! -f "$wheels/.done" ]; then
      script=$(mktemp --suffix=.py)
      sed "s/\"vllm==[0-9.]*\"/\"vllm==$version\"/" ../shared/gpu/vllm-wheels.py > "$script"
      grep -q "\"vllm==$version\"" "$script" || { echo "../shared/gpu/vllm-wheels.py pins no vllm"; exit 1; }
      "$PYTHON" "$script" "$wheels"
      rm -f "$script" "$wheels"/tokenspeed_* "$wheels"/humming_kernels-* "$wheels"/pyelftools-*
      # vLLM 0.22 imports llguidance with its structured outputs, on every start (a dataclass's annotations): where
      # the index lacks the release it pins (>=1.7 for 0.22; this index has 1.6.1 at most), the newest it has (its
      # grammars are never used here: the bench and training send no structured output; installed with --no-deps)
      if ! ls "$wheels"/llguidance-* > /dev/null 2>&1; then
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          --platform manylinux_2_28_x86_64 -d "$wheels" "llguidance<1.8"
      fi
      touch "$wheels/.done"
    fi
    tmp=$(mktemp -d)
    tar -cf - -C "$wheels" --exclude=.done . | split -b "${PART_MIB}M" -d - "$tmp/part"
    spread .dv "$tmp"/part*
    rmdir "$tmp"
    ;;
  verl)
    exclude "/.dl[0-9][0-9]/"
    tmp=$(mktemp -d)
    "$PYTHON" bench/gpu_wheels.py --stack verl --part-mib "$PART_MIB" "$tmp"
    spread .dl "$tmp"/part*
    mv "$tmp/install.sh" "$(ls -d .dl[0-9][0-9] | tail -1)/"
    rmdir "$tmp"
    ;;
  *)
    echo "usage: bash bench/carry_parts.sh trl|vllm|verl"
    exit 2
    ;;
esac
