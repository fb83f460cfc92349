#!/usr/bin/env bash
# The checks and measurements that need the lent H200, in groups that fit one device call (10 minutes) each or
# run side by side in one; each prints a short table last; full logs and files go to $OUT. Run from the
# repository root on the GPU machine, after ../shared/gpu/wheels.sh has put the numpy 2.4 wheel in .whl/ (carry
# it), and carry .train_data (python -m kdspec.engine.train.prepare --data-dir .train_data) for `train`:
#
#     bash tools/gpu_session.sh record-k2  # k2-mini --golden gpu: seconds to the first durable step, then check
#     bash tools/gpu_session.sh profile-k2 # where those seconds go: phases and kernel compilation (twice: the
#                                          # second process shows what the kernel cache saves)
#     bash tools/gpu_session.sh train      # kdtree train drafter for pycoder-mini into $OUT/drafter
#     bash tools/gpu_session.sh tests      # GPU tests of the device drafter, torch golden, sampling/tree, k2-mini
#     bash tools/gpu_session.sh sample     # the pycoder-mini sample trace (dflash drafter, B=64, held-out prompt)
#     bash tools/gpu_session.sh e2e        # kdtree bench e2e (k2-mini bf16, budgets 7..255, rooflines, host time)
#     bash tools/gpu_session.sh profile-step  # cProfile of AR and DDTree oracle B=7 / 63 steps on k2-mini
#     bash tools/gpu_session.sh profile-kernels  # GPU time per kernel of AR and DDTree oracle B=7 / 63 / 255 steps
#     bash tools/gpu_session.sh invariance  # which bf16 products give a row the same bits at every row count
#     bash tools/gpu_session.sh experts-tc  # tensor-core experts: GPU tests, the TcConfig sweep at k2-mini's 32
#                                          # experts, e2e, the k2-mini invariance test, K2's 384 experts
#     bash tools/gpu_session.sh experts-tc-e2e  # the same without the sweeps
#     bash tools/gpu_session.sh ncu-experts  # Nsight Compute on the staged expert kernels: time, instructions,
#                                          # issue and tensor-pipe activity, stall reasons, DRAM / L2 / L1 throughput
#                                          # (tools/experts_probe.py; NCU_CONFIG: another shape, e.g. wgmma:64,4,2)
#     bash tools/gpu_session.sh device-steps  # whole steps on the device: their tests (tiny: captured graphs
#                                          # against the stages one by one; k2-mini decodes), then bench e2e
#     bash tools/gpu_session.sh host-turns  # per step, unprofiled: the host's turn from the results read to the next
#                                          # launch (AR, oracle B=7..255); then GPU time per kernel at B=63..255
#     bash tools/gpu_session.sh host-spread  # the host turns unpinned, then pinned to one core (CORE, default 2)
#     bash tools/gpu_session.sh e2e-tests  # bench e2e, then the unpadded products', stamps' and device steps' tests
#                                          # and the k2-mini invariance test (WITH_FP32=1: and fp32 k2-mini == golden)
#     bash tools/gpu_session.sh ar-kernels  # the small kernels of an AR step: the invariant attention's launch shapes
#                                          # (sweep), the norms', router's and attention's GPU tests, then e2e-tests
#     bash tools/gpu_session.sh attention-tc  # the tensor-core invariant attention: its GPU tests, the k2-mini
#                                          # invariance test (its default there), the attention sweep (its launch
#                                          # shapes and the fp32 kernel's side by side); WITH_E2E=1: e2e-tests
#     bash tools/gpu_session.sh steps-profile  # bench e2e, then GPU time per kernel of AR and oracle B=7 / 63 / 255
#     bash tools/gpu_session.sh many-pairs  # GPU time per kernel of the oracle B=255 step with each staged-experts
#                                          # shape for many pairs, side by side (MANY_CONFIGS: "4,2,2,6,4,2 4,2,4,4,4,2")
#     bash tools/gpu_session.sh grouped-experts  # the routed experts through torch's grouped GEMM: their GPU tests,
#                                          # tools/grouped_mm_probe.py, the k2-mini invariance test with them, and
#                                          # GPU time per kernel of AR and oracle B=7 / 255 with the Numba tensor-
#                                          # core experts (step_profile --tensor-core-experts), then with the grouped
#                                          # ones (the default; TOP: kernels listed, default 6)
#     bash tools/gpu_session.sh experts-routing  # the staged experts alone under k2-mini's own routing of its B=255
#                                          # verify (3 MoE layers, summed), each shape beside MANY_PAIRS_CONFIG and
#                                          # the launcher's choice, with their bits (ROUTING_CONFIGS: more shapes,
#                                          # e.g. "4,3,2,4,4,2;wgmma:64,4,2")
#     AGAINST=old_experts_tc.py bash tools/gpu_session.sh experts-against  # the staged experts alone at s = 64,
#                                          # 128, 256: MANY_PAIRS_CONFIG and STAGED_CONFIGS against an earlier
#                                          # experts_tc.py (git show REV:numba_kernels/moe/experts_tc.py > FILE,
#                                          # untracked so that it travels), times and bits side by side
#     bash tools/gpu_session.sh wgmma-experts  # the wgmma experts (experts_wgmma.py): wgmma's bits at N = 64, the
#                                          # kernels beside MANY_PAIRS_CONFIG at s = 256 / 128 / 64 under k2-mini-
#                                          # like routing (WGMMA_CONFIGS: "wgmma:64,4,2;wgmma:64,4,2,1,1"), their tests
#     bash tools/gpu_session.sh moe-graphs  # kdtree bench moe, then the tensor-core experts' launch shapes at K2's
#                                          # 384 experts as graph replays (MOE_CONFIGS: which, e.g. t0,t8)
#     bash tools/gpu_session.sh spec [T [B,..]]  # kdtree bench spec (32 held-out prompts x 128 tokens, T=0 and T=1,
#                                          # budgets 8..256; or T and those budgets only)
#
# Each group writes $OUT/<group>.log and ends with one line per step: name, exit status, seconds.
set -u
groups="record-k2|ar-kernels|attention-tc|profile-k2|train|tests|tests-k2|sample|e2e|device-steps|e2e-tests|host-turns|host-spread|steps-profile|many-pairs|grouped-experts|experts-routing|experts-against|wgmma-experts|moe-graphs|profile-step|profile-kernels|invariance|experts-tc|experts-tc-e2e|ncu-experts|spec"  # the one list of groups: usage and the unknown-group message
group=${1:?usage: tools/gpu_session.sh $groups}
case "|$groups|" in
*"|$group|"*) ;;
*) echo "unknown group $group ($groups)" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -f /tmp/site/numpy/__init__.py ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1   # once: groups started side by side share it
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
kdtree=(python3 -m kdspec.kdtree_tui.cli)
suffix="${2:+-$2}${3:+-$3}"
log="$OUT/$group${suffix//,/_}.log"   # names that come back from the device: letters, digits, '.', '_', '-'

summary=()

step() {  # step NAME TIMEOUT_S COMMAND...: run under a timeout, log everything, remember the outcome
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name: $*" >>"$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    local code=$?
    summary+=("$(printf '%-28s exit %-4s %5ss' "$name" "$code" "$((SECONDS - start))")")
}

first_step_seconds() {  # first_step_seconds TRACE: the trace appears at its path once its first step is durable
    local start=$EPOCHREALTIME
    while [ ! -e "$1" ]; do sleep 0.1; done
    python3 -c "print(f'time to the first durable step: {$EPOCHREALTIME - $start:.1f} s')" >>"$log"
}

case "$group" in
record-k2)
    rm -f "$OUT/k2-mini-sample.h5"
    first_step_seconds "$OUT/k2-mini-sample.h5" &
    step k2-mini-golden-gpu 300 "${kdtree[@]}" record --model k2-mini --golden gpu --drafter noisy:0.7 --budget 64 \
        --max-new-tokens 64 --out "$OUT/k2-mini-sample.h5"
    kill %1 2>/dev/null
    step k2-mini-check 60 "${kdtree[@]}" check "$OUT/k2-mini-sample.h5"
    grep -a "first durable step" "$log"
    ;;
profile-k2)
    for run in 1 2; do
        step "profile-k2 run $run" 240 python3 -W ignore tools/first_step_profile.py
    done
    grep -a -E "^ +[0-9.]+ s|^kernels:" "$log"
    ;;
train)
    step train-drafter 560 "${kdtree[@]}" train drafter --model engine/model/presets/pycoder-mini --data .train_data ${TRAIN_ARGS:-} \
        --out "$OUT/drafter" --force
    tail -n 8 "$log"
    ;;
tests)
    step device-drafter 200 python3 -m pytest -q tests/engine/test_device_drafter.py tests/kernels/test_topk_select.py \
        tests/engine/test_block_drafter.py
    [ -n "${SKIP_TORCH_GOLDEN:-}" ] || step torch-golden-cuda 90 python3 -m pytest -q tests/engine/test_golden_torch.py
    step sampling-tree 400 python3 -m pytest -q tests/kernels/test_sampling_split.py tests/kernels/test_tree.py
    grep -a -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR)" "$log"
    ;;
tests-k2)
    step k2-mini-device-model 420 python3 -m pytest -q -m gpu -k k2 tests/engine/test_device_model.py
    grep -a -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR)" "$log"
    ;;
sample)
    prompt=$(python3 -c "import json; print(','.join(map(str, json.load(open(
        'engine/model/presets/pycoder-mini/heldout_prompts.json'))['prompts'][0])))")
    step pycoder-sample 120 "${kdtree[@]}" record --model pycoder-mini --drafter dflash --budget 64 \
        --max-new-tokens 128 --prompt-ids "$prompt" --out "$OUT/pycoder-mini-sample.h5" --force
    step pycoder-check 60 "${kdtree[@]}" check "$OUT/pycoder-mini-sample.h5"
    ;;
e2e)
    step bench-e2e 560 "${kdtree[@]}" bench e2e   # the table comes last in the log
    tail -n 40 "$log"
    ;;
profile-step)
    step profile-step 400 python3 -W ignore tools/step_profile.py --budgets 7,63 --out "$OUT/pstats"
    tail -n 3 "$log"
    ;;
profile-kernels)
    step profile-kernels 240 python3 -W ignore tools/step_profile.py --kernels --budgets 7,63,255 --top 14
    step profile-kernels-variant 240 python3 -W ignore tools/step_profile.py --kernels --budgets 7,63,255 --top 14 \
        --variant
    grep -a -E "^=====|ms/step" "$log" | cut -c1-150
    ;;
experts-tc)
    step tc-tests 150 python3 -m pytest -q -m gpu tests/kernels/test_moe_tc.py
    step bench-e2e 200 "${kdtree[@]}" bench e2e
    step tc-sweep-32 240 python3 -W ignore -m tools.sweeps.moe --tensor-cores --experts 32 --tokens 1,8,64,256
    step invariance-k2 90 python3 -m pytest -q "tests/engine/test_batch_invariance.py::test_k2_mini_tree_verify_equals_ar_steps_bit_for_bit[grouped]"
    step tc-sweep-384 120 python3 -W ignore -m tools.sweeps.moe --tensor-cores --tokens 1,256 --only t0,t1
    grep -a -E "^ +[0-9]+ +(auto|t[0-9])|^best|^[0-9]+ (passed|failed)|^(FAILED|ERROR)|CHECKS|copy bandwidth|breakdown" "$log" \
        | cut -c1-160
    grep -a -E "^e2e " "$log" | cut -c1-230
    ;;
experts-tc-e2e)
    step tc-tests 150 python3 -m pytest -q -m gpu tests/kernels/test_moe_tc.py tests/kernels/test_attention_invariant.py \
        tests/engine/test_device_tree_ops.py
    step bench-e2e 200 "${kdtree[@]}" bench e2e
    step invariance-k2 90 python3 -m pytest -q "tests/engine/test_batch_invariance.py::test_k2_mini_tree_verify_equals_ar_steps_bit_for_bit[grouped]"
    grep -a -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR)" "$log"
    grep -a -E "^e2e " "$log" | cut -c1-230
    ;;
ncu-experts)
    stalls=$(for r in barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle wait not_selected \
        dispatch_stall branch_resolving; do printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $r; done)
    step ncu-experts 200 /usr/local/cuda/bin/ncu --kernel-name regex:"^kernel" --launch-count 2 --section SpeedOfLight \
        --section Occupancy --metrics "${stalls}smsp__inst_executed.sum,gpu__time_duration.sum,dram__bytes_read.sum,\
smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
lts__t_bytes.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read.sum" \
        python3 tools/experts_probe.py ${NCU_CONFIG:+--config "$NCU_CONFIG"}
    PATH=$PATH:/usr/local/cuda/bin step sass-experts 100 python3 tools/experts_probe.py --sass
    grep -a -E "  kernel|stalled|inst_exec|duration|dram__|lts__|issue_active|hmma|SASS|Theoretical Occ|Throughput" "$log" \
        | cut -c1-160
    ;;
device-steps)
    step device-steps-tests 200 python3 -m pytest -q -m "sim or gpu" tests/engine/test_device_steps.py \
        tests/kernels/test_attention_invariant.py tests/engine/test_device_tree_ops.py tests/kernels/test_sampling_split.py
    step invariance-k2 90 python3 -m pytest -q "tests/engine/test_batch_invariance.py::test_k2_mini_tree_verify_equals_ar_steps_bit_for_bit[grouped]"
    step bench-e2e 290 "${kdtree[@]}" bench e2e
    grep -a -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR)|Error" "$log" | head -20
    grep -a -E "^e2e " "$log" | cut -c1-230
    ;;
host-turns)
    step host-turns 240 python3 -W ignore tools/step_profile.py --timeline --budgets 7,63,127,255
    step profile-kernels 300 python3 -W ignore tools/step_profile.py --kernels --budgets 63,127,255 --top "${TOP:-24}"
    grep -a -E "host turn|no host turn" "$log" | cut -c1-220
    grep -a -E "^=====|ms/step|GPU idle" "$log" | cut -c1-190
    ;;
host-spread)
    # whether the host's turn moves with the CPU it runs on: the same timeline unpinned, then on one core
    grep -m1 "model name" /proc/cpuinfo >>"$log"
    step timeline-unpinned 240 python3 -W ignore tools/step_profile.py --timeline --budgets 7,127,255
    step timeline-pinned 240 taskset -c "${CORE:-2}" python3 -W ignore tools/step_profile.py --timeline \
        --budgets 7,127,255
    grep -a -E "model name|^===|host turn|no host turn" "$log" | cut -c1-220
    ;;
e2e-tests)
    step bench-e2e 300 "${kdtree[@]}" bench e2e
    step unpadded-tests 120 python3 -m pytest -q -m "sim or gpu" tests/engine/test_torch_ops.py tests/kernels/test_clock.py \
        tests/engine/test_device_steps.py
    step invariance-k2 240 python3 -m pytest -q "tests/engine/test_batch_invariance.py::test_k2_mini_tree_verify_equals_ar_steps_bit_for_bit[grouped]"
    [ -n "${WITH_FP32:-}" ] && step k2-mini-fp32 240 python3 -m pytest -q -m gpu -k k2 tests/engine/test_device_model.py
    grep -a -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR)|Error" "$log" | head -20
    grep -a -E "^e2e " "$log" | cut -c1-230
    ;;
ar-kernels)
    step attention-shapes 200 python3 -W ignore -m tools.sweeps.attention_invariant
    step kernel-tests 200 python3 -m pytest -q -m gpu tests/kernels/test_attention_invariant.py \
        tests/kernels/test_attention_gpu.py::test_norms_at_hidden_size "tests/kernels/test_moe.py::test_router_matches_reference"
    grep -a -E "^[a-z0-9 ]+ +regs|^best|CHECKS|all checks|^FAILED" "$log" | cut -c1-170
    bash "$0" e2e-tests
    ;;
attention-tc)
    step tc-attention-tests 150 python3 -m pytest -q -m gpu tests/kernels/test_attention_invariant.py -k tensor_core
    step invariance-k2 120 python3 -m pytest -q "tests/engine/test_batch_invariance.py::test_k2_mini_tree_verify_equals_ar_steps_bit_for_bit[grouped]"
    step attention-shapes 240 python3 -W ignore -m tools.sweeps.attention_invariant
    grep -a -E "^[a-z0-9 ]+ +regs|^best|^tensor cores|CHECKS|all checks|^[0-9]+ (passed|failed)|^FAILED" "$log" \
        | cut -c1-170
    [ -n "${WITH_E2E:-}" ] && bash "$0" e2e-tests
    ;;
steps-profile)
    step bench-e2e 290 "${kdtree[@]}" bench e2e
    step profile-kernels 240 python3 -W ignore tools/step_profile.py --kernels --budgets 7,63,255 --top "${TOP:-16}"
    grep -a -E "^e2e " "$log" | cut -c1-230
    grep -a -E "^=====|ms/step|GPU idle" "$log" | cut -c1-190
    ;;
many-pairs)
    for config in ${MANY_CONFIGS:-4,2,2,6,4,2 4,2,4,4,4,2}; do
        step "many-pairs $config" 150 python3 -W ignore tools/step_profile.py --kernels --budgets 255 --top 4 \
            --many-pairs "$config"
    done
    grep -a -E "^MANY_PAIRS_CONFIG|^=====|staged_kernels" "$log" | cut -c1-150
    ;;
grouped-experts)
    step grouped-tests 120 python3 -m pytest -q tests/engine/test_grouped_experts.py tests/kernels/test_moe_pair_rows.py
    step grouped-probe 40 python3 -W ignore tools/grouped_mm_probe.py
    step grouped-invariance-k2 200 python3 -m pytest -q \
        "tests/engine/test_batch_invariance.py::test_k2_mini_tree_verify_equals_ar_steps_bit_for_bit[grouped]"
    step profile-tensor-cores 110 python3 -W ignore tools/step_profile.py --kernels --budgets 7,255 --top ${TOP:-6} \
        --tensor-core-experts
    step profile-grouped 110 python3 -W ignore tools/step_profile.py --kernels --budgets 7,255 --top ${TOP:-6}
    grep -a -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR)|^ *[0-9]+ +[0-9]+ +[0-9]+ |^=====" "$log" | cut -c1-150
    ;;
experts-routing)
    step experts-routing 480 python3 -W ignore tools/experts_probe.py --model-routing "${BUDGET:-255}" \
        --time "${ROUTING_CONFIGS:-}"
    grep -a -E "^k2-mini B=|^B=[0-9]+ " "$log" | cut -c1-150
    ;;
experts-against)
    step experts-against 540 python3 -W ignore tools/experts_probe.py --tokens 64,128,256 \
        --time "${STAGED_CONFIGS:-5,2,2,2,3,2;4,2,2,4,4;4,2,2,4,3,2;2,4,4,2,3,2;4,2,4,4,3}" --against "${AGAINST:?AGAINST=an earlier experts_tc.py}"
    grep -a -E "^s= *[0-9]+ " "$log" | cut -c1-150
    ;;
wgmma-experts)
    step wgmma-probe 60 python3 -W ignore tools/wgmma_probe.py --n 64 --trials 10
    step wgmma-time 300 python3 -W ignore tools/experts_probe.py --skew 2.5 --tokens 256,128,64 \
        --time "${WGMMA_CONFIGS:-wgmma:64,4,2;wgmma:64,4,2,1,1;wgmma:128,4,1,1,1}"
    step wgmma-tests 180 python3 -m pytest -q -x -m gpu tests/kernels/test_moe_tc.py -k wgmma
    grep -a -E "bit-identical|max \||^s= *[0-9]+ | passed| failed" "$log" | cut -c1-150
    ;;
moe-graphs)
    step bench-moe 240 "${kdtree[@]}" bench moe
    step tc-sweep-384 200 python3 -W ignore -m tools.sweeps.moe --tensor-cores --graphs --tokens 1,256 \
        --only "${MOE_CONFIGS:-t0,t3,t4,t6,t7,t8,t9}"
    grep -a -E "^moe |^ +t[0-9]+: |copy bandwidth|read-only" "$log" | cut -c1-230
    ;;
invariance)
    step invariance-probe 200 python3 -W ignore tools/invariance_probe.py
    tail -n 30 "$log"
    ;;
spec)
    step "bench-spec${2:+ T=$2}" "${SPEC_LIMIT_S:-560}" python3 -c "import sys
from kdspec.engine.bench import runner, spec
t, b = (tuple(float(x) for x in a.split(',')) for a in sys.argv[1:])
print(runner.format_table(spec.run(temperatures=t, budgets=tuple(int(x) for x in b))))" "${2:-0,1}" \
        "${3:-8,16,32,64,128,256}"
    tail -n 60 "$log"
    ;;
esac
printf '%s\n' "${summary[@]}"
