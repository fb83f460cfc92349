#!/usr/bin/env bash
# The checks and measurements that need the lent H200, grouped so that each group fits one device call
# (10 minutes) and prints a short table last; full logs and files go to $OUT. Run from the repository root on
# the GPU machine, after ../shared/gpu/wheels.sh has put the numpy 2.4 wheel in .whl/ (carry it):
#
#     bash tools/gpu_session.sh tests      # GPU tests not yet run on today's code (device drafter, k2-mini, torch golden)
#     bash tools/gpu_session.sh record     # k2-mini with --golden gpu (time to first step), then the pycoder-mini sample
#     bash tools/gpu_session.sh spec       # kdtree bench spec (32 held-out prompts x 128 tokens, T=0 and T=1)
#
# Each group writes $OUT/<group>.log and ends with one line per step: name, exit status, seconds.
set -u
group=${1:?usage: tools/gpu_session.sh tests|record|spec}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log="$OUT/$group.log"
summary=()

step() {  # step NAME TIMEOUT_S COMMAND...: run under a timeout, log everything, remember the outcome
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name: $*" >>"$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    local code=$?
    summary+=("$(printf '%-40s exit %-4s %5ss' "$name" "$code" "$((SECONDS - start))")")
    tail -n 3 "$log"
}

case "$group" in
tests)
    step device-drafter 240 python3 -m pytest -q tests/engine/test_device_drafter.py tests/kernels/test_topk_select.py \
        tests/engine/test_block_drafter.py
    step torch-golden-cuda 120 python3 -m pytest -q tests/engine/test_golden_torch.py
    step sampling-tree 150 python3 -m pytest -q tests/kernels/test_sampling_split.py tests/kernels/test_tree.py
    step k2-mini-device-model 330 python3 -m pytest -q -m gpu -k k2 tests/engine/test_device_model.py
    ;;
record)
    step k2-mini-golden-gpu 420 python3 -m kdspec.kdtree_tui.cli record --model k2-mini --golden gpu \
        --drafter noisy:0.7 --budget 64 --max-new-tokens 64 --out "$OUT/k2-mini-sample.h5" --force
    step k2-mini-check 60 python3 -m kdspec.kdtree_tui.cli check "$OUT/k2-mini-sample.h5"
    prompt=$(python3 -c "import json; print(','.join(map(str, json.load(open(
        'engine/model/presets/pycoder-mini/heldout_prompts.json'))['prompts'][0])))")
    step pycoder-sample 120 python3 -m kdspec.kdtree_tui.cli record --model pycoder-mini --drafter dflash \
        --budget 64 --max-new-tokens 128 --prompt-ids "$prompt" --out "$OUT/pycoder-mini-sample.h5" --force
    step pycoder-check 60 python3 -m kdspec.kdtree_tui.cli check "$OUT/pycoder-mini-sample.h5"
    ;;
spec)
    step bench-spec 560 python3 -m kdspec.kdtree_tui.cli bench spec --json
    cp "$log" "$OUT/spec.json.log"
    ;;
*)
    echo "unknown group $group (tests, record, spec)" >&2
    exit 2
    ;;
esac
printf '%s\n' "${summary[@]}"
