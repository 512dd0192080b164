# The device machine's setup, shared by the scripts that run there (bench/gpu/run.sh,
# bench/gpu/heads_run.sh). Source it from the repository root with OUT and WORK set:
#
#     OUT=... WORK=... SAY_AS=<name in the log lines>; source bench/gpu/env.sh
#
# It installs the wheels carried in .whl/ into WORK/site (once per set of wheels: a later call on
# the same machine finds them installed, even when it carries no wheels), puts the repository on
# the path as the `specheads` package (pyproject's package-dir, as links in WORK/pkg), unsets
# TRITON_INTERPRET (the kernels compile for the GPU), sets the offline environment, prints the
# GPU and defines say() for timestamped log lines. The caller then runs `cd "$WORK"` before
# python: the repository root's own specheads/ folder would shadow the linked package. REPO is
# the repository root.

OUT=${OUT:?set OUT to the folder the report is written to}
WORK=${WORK:?set WORK to the folder for the installed wheels and the package links}
SAY_AS=${SAY_AS:-gpu}
REPO=$(pwd)
gpu_env_begin=$(date +%s)
say() { echo "[$SAY_AS $(( $(date +%s) - gpu_env_begin ))s] $*"; }

mkdir -p "$OUT" "$WORK/site"
if compgen -G ".whl/*.whl" >/dev/null; then
    wheels=$(stat -c '%n %s' .whl/*.whl)
    if [ "$wheels" != "$(cat "$WORK/site/.wheels" 2>/dev/null)" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
            .whl/*.whl || { say "installing the carried wheels failed"; exit 1; }
        echo "$wheels" >"$WORK/site/.wheels"
    else
        say "the carried wheels are installed already"
    fi
fi
if [ -f "$WORK/site/.wheels" ]; then
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi

# The repository's top-level folders are the package's parts (pyproject's package-dir).
rm -rf "$WORK/pkg" && mkdir -p "$WORK/pkg/specheads"
for path in specheads/*; do ln -s "$REPO/$path" "$WORK/pkg/specheads/"; done
for part in heads training serving data recipes bench; do ln -s "$REPO/$part" "$WORK/pkg/specheads/$part"; done
export PYTHONPATH=$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}

unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader || say "no nvidia-smi"
