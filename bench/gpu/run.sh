#!/usr/bin/env bash
# The GPU suite's run on a GPU machine that starts bare for each short rental (on a machine of your
# own, run the suite directly: bench/gpu/README.md). Run it from the repository root:
#
#     OUT=<folder for the report> bash bench/gpu/run.sh [gpu_suite options, e.g. --sections end_to_end]
#
# The trained_heads section needs the real target and its trained heads on the machine:
# `--trained-target embedded:smollm2 --trained-heads DIR` (without them it reports itself skipped).
#
# It installs the wheels carried in .whl/ (the transformers version the project tests with; the
# machine's torch, triton and the rest stay), puts the repository on the path as the `specheads`
# package (pyproject's package-dir, as links), and runs `python -m specheads.bench.gpu.suite`,
# which writes OUT/gpu_suite.json and OUT/gpu_suite.md after every section and prints each goal
# beside its target at the end. Sections that would start after BUDGET_S seconds are skipped,
# and the suite is stopped at LIMIT_S, so the whole run ends inside one 10-minute call with time
# to spare. Inductor's compiled artefacts go to OUT/compile_cache.bin; carried back as
# .whl/compile_cache.bin, the next run starts from them instead of compiling.
set -uo pipefail

BUDGET_S=${BUDGET_S:-400}
LIMIT_S=${LIMIT_S:-540}
WORK=${WORK:-/tmp/specheads-gpu-run}  # the installed wheels and the package's links
SAY_AS=gpu_run
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # wheels, the linked package, the environment

if [ -f .whl/compile_cache.bin ]; then
    cp .whl/compile_cache.bin "$OUT/compile_cache.bin"
fi

cd "$WORK"  # the repository root's own specheads/ folder would shadow the linked package
python3 -c "import torch, transformers, triton, specheads.bench.gpu.suite as s; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, \
'from', s.__file__)" || { say "the suite does not import"; exit 1; }
say "suite starts (budget ${BUDGET_S}s, limit ${LIMIT_S}s)"
timeout -k 15 "$LIMIT_S" python3 -m specheads.bench.gpu.suite --output "$OUT" --budget-s "$BUDGET_S" \
    --compile-cache "$OUT/compile_cache.bin" "$@" 2>&1 | tee "$OUT/gpu_run.log"
status=${PIPESTATUS[0]}
say "suite ended with status $status"
ls -la "$OUT"
exit "$status"
