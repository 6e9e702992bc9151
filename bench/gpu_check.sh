#!/usr/bin/env bash
# The GPU paths end to end on a machine with CUDA: CUDA-event timing, the GPU tests, then per model size how a
# layer's time depends on how it is timed (gpu_timing.py) and what a backward() call costs (backward_call.py), a
# one-GPU profile, real training and the validation of the prediction against it (for the first size also a
# run traced layer by layer with CUDA events, --layer-times); harness device's curves and each size from its
# spec alone on them; then two ranks (NCCL, one device per local rank: dp=2, pp=2 and ZeRO-2, whose in-context
# chain runs over the pair of GPUs, each with its in-context check) where there are two GPUs, or the clear
# refusal where there is one.
#
#   bench/gpu_check.sh [OUTDIR]             # on a GPU machine, with the project's Python as python3
#   GPU_CHECK_DEVICE=cpu bench/gpu_check.sh # the same steps on the CPU (a dry run of this script)
#
# Every step runs even when an earlier one fails; each step's log is OUTDIR/NN-name.log and the summary
# (one line per step: ok or FAILED) is OUTDIR/summary.txt; OUTDIR.tar.gz packs the logs, profiles and traces
# (no per-rank files) to take off the machine and validate again offline. Figures are in docs/benchmarks-gpu.md.
set -u
OUTDIR=${1:-gpu-check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-$(command -v python3)}
MPIRUN=${MPIRUN:-$(command -v mpirun)}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
SUMMARY=$OUTDIR/summary.txt
: >"$SUMMARY"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME COMMAND...: run, log, record ok/FAILED with the wall time
    local name=$1; shift
    local log=$OUTDIR/$name.log t0=$SECONDS
    echo "== $name: $*" >"$log"
    if timeout "${STEP_TIMEOUT_S:-240}" "$@" >>"$log" 2>&1; then status=ok; else status="FAILED (rc $?)"; fi
    tail -n 25 "$log"
    printf '%-28s %-14s %4d s\n' "$name" "$status" $((SECONDS - t0)) | tee -a "$SUMMARY"
}

# name:hidden:ffn:heads:seq:micro:global. medium: the GPU runs behind the host; small: the host issues
# slower than the GPU runs (launch-bound), where how the profile times a layer matters most.
if [ "$DEVICE" = cuda ]; then
    SIZES="medium:2048:8192:16:1024:4:16 small:512:2048:8:256:4:16" DTYPE=bfloat16 REPEATS=40 ITER=20
else
    SIZES="medium:128:512:4:64:2:8" DTYPE=float32 REPEATS=5 ITER=4
fi
spec() {  # spec FILE HIDDEN:FFN:HEADS:SEQ:MICRO:GLOBAL DP PP [ZERO]
    local hidden ffn heads seq micro global
    IFS=: read -r hidden ffn heads seq micro global <<<"$2"
    printf '%s\n' "spec_version = 1" "[model]" 'name = "gpt2-small"' "layers = 4" "hidden = $hidden" \
        "heads = $heads" "ffn = $ffn" "seq_len = $seq" "vocab = 8192" "dtype = \"$DTYPE\"" \
        "[batch]" "global = $global" "micro = $micro" \
        "[strategy]" "dp = $3" "tp = 1" "pp = $4" 'schedule = "1f1b"' "zero = ${5:-0}" \
        "[cluster]" "nodes = 1" "gpus_per_node = $(($3 * $4))" \
        "[profile]" "warmup = 3" "repeats = $REPEATS" "device = \"$DEVICE\"" >"$1"
}

step 00-environment $PY -c "
import subprocess, torch, h5py, mpi4py, numpy
from launcher.topology import mpi_library_version
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(),
      'devices', torch.cuda.device_count())
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())
print('h5py', h5py.__version__, 'mpi4py', mpi4py.__version__, 'numpy', numpy.__version__)
print(mpi_library_version())
print(subprocess.run(['$MPIRUN', '--version'], capture_output=True, text=True).stdout.splitlines()[0])
"

# CUDA events against the wall clock (synchronized) for one region of known work.
step 01-timer $PY -c "
import time, torch
from harness.profile.timer import synchronize, time_region
device = torch.device('$DEVICE')
n = 8192 if device.type == 'cuda' else 512
dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
run = lambda: [a @ b for _ in range(10)]
for _ in range(3):
    run()
synchronize(device)
timed = sorted(time_region(run, device) for _ in range(10))[5]
t0 = time.perf_counter()
for _ in range(10):
    run()
synchronize(device)
wall = (time.perf_counter() - t0) / 10
print(f'10 products of {n}^3: timer {timed * 1e3:.3f} ms, wall clock {wall * 1e3:.3f} ms, '
      f'ratio {timed / wall:.3f}, {10 * 2 * n ** 3 / timed / 1e12:.1f} TFLOP/s')
assert device.type == 'cpu' or abs(timed / wall - 1) < 0.1, 'the timer and the wall clock disagree by over 10%'
"
step 02-cuda-tests $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py

# One GPU per size: profile, train, validate (no communication: the compute model alone).
first_name=${SIZES%% *}; first_name=${first_name%%:*}
for size in $SIZES; do
    name=${size%%:*}
    spec "$OUTDIR/$name.toml" "${size#*:}" 1 1
    if [ "$DEVICE" = cuda ]; then
        step "03-$name-timing" $PY bench/gpu_timing.py "$OUTDIR/$name.toml"
        step "03-$name-backward-call" $PY bench/backward_call.py "$OUTDIR/$name.toml"
    fi
    step "04-$name-profile" $PY -m harness profile "$OUTDIR/$name.toml" -o "$OUTDIR/$name"
    step "05-$name-train" $PY -m harness train "$OUTDIR/$name.toml" -o "$OUTDIR/$name-run" \
        --iterations $ITER --warmup 3
    step "06-$name-validate" $PY -m analysis validate "$OUTDIR/$name-run" "$OUTDIR/$name" \
        --trace-out "$OUTDIR/$name-validate.json.gz"
    $PY -m analysis validate --json "$OUTDIR/$name-run" "$OUTDIR/$name" >"$OUTDIR/$name-validate.json" 2>/dev/null
    # In context against alone (issue 44): each compute event's median inside its stage's chain (CUDA events at
    # the chain's marks) over its median alone, and the batch-time error costed each way on the same run.
    step "06-$name-in-context" $PY bench/in_context_check.py "$OUTDIR/$name-run" "$OUTDIR/$name"
done
# The per-layer trace on the GPU (CUDA events), on the first size: its own run, so that the runs above are
# timed without the backward hooks.
step "06-$first_name-layer-times" bash -c "$PY -m harness train $OUTDIR/$first_name.toml -o $OUTDIR/$first_name-layers \
    --iterations $ITER --warmup 3 --layer-times && $PY -m analysis validate $OUTDIR/$first_name-layers $OUTDIR/$first_name"

# The device model (issue 43): this device's curves measured by harness device (one calibration: the TOML and
# its JSON at once; the TOML's causal_tile is the flash kernel's key block, the JSON's "causal" rows the causal
# over full times it was read from), then each size from its spec alone on them (every compute event from the
# device model) beside the run above (its measured batch time); on the calibration refined on a profile; on a GPU
# also on the shipped description of an H200.
QUICK=$([ "$DEVICE" = cuda ] || echo --quick)
step 10-device-calibrate bash -c "$PY -m harness device --device $DEVICE --dtype $DTYPE $QUICK --quiet --json \
    -o $OUTDIR/local-device.toml >$OUTDIR/local-device.json && cat $OUTDIR/local-device.toml"
# The calibration refined on the first size's profile (analysis device): the other sizes are jobs it has not seen.
step 10-device-refine $PY -m analysis device "$OUTDIR/$first_name" --device "$OUTDIR/local-device.toml" \
    -o "$OUTDIR/local-refined.toml" --quiet
DESCRIPTIONS="local:$OUTDIR/local-device.toml refined:$OUTDIR/local-refined.toml"
[ "$DEVICE" = cuda ] && DESCRIPTIONS="$DESCRIPTIONS shipped-h200:h200"
for size in $SIZES; do
    name=${size%%:*}
    for described in $DESCRIPTIONS; do
        label=${described%%:*} file=${described#*:}
        sed "s|^\[cluster\]\$|[cluster]\ndevice = \"$file\"|" "$OUTDIR/$name.toml" >"$OUTDIR/$name-$label.toml"
        step "11-$name-spec-only-$label" bash -c "$PY -m analysis simulate $OUTDIR/$name-$label.toml --details \
            --resamples 0 && $PY -m analysis simulate $OUTDIR/$name-$label.toml --json --resamples 0 \
            >$OUTDIR/$name-$label.json && $PY bench/spec_only_check.py $OUTDIR/$name-$label.json \
            $OUTDIR/$name-validate.json"
    done
done

# Two ranks need two GPUs (NCCL refuses two ranks on one device); with fewer, the refusal must be clear.
first=${SIZES%% *}
spec "$OUTDIR/dp2.toml" "${first#*:}" 2 1
spec "$OUTDIR/pp2.toml" "${first#*:}" 1 2
spec "$OUTDIR/zero2.toml" "${first#*:}" 2 1 2  # ZeRO-2: FSDP2 units, the in-context chain over the pair of GPUs
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$DEVICE" = cuda ] && [ "$GPUS" -lt 2 ]; then
    step 07-one-gpu-two-ranks bash -c "$MPIRUN -n 2 $PY -m mpi4py -m harness profile $OUTDIR/dp2.toml -o $OUTDIR/dp2 \
        >$OUTDIR/refusal.txt 2>&1; status=\$?; cat $OUTDIR/refusal.txt; test \$status -eq 2 \
        && grep -q 'share one GPU' $OUTDIR/refusal.txt"
else
    for job in dp2 pp2 zero2; do
        step "07-$job-profile" $MPIRUN -n 2 $PY -m mpi4py -m harness profile "$OUTDIR/$job.toml" -o "$OUTDIR/$job"
        step "08-$job-train" $MPIRUN -n 2 $PY -m mpi4py -m harness train "$OUTDIR/$job.toml" -o "$OUTDIR/$job-run" \
            --iterations $ITER --warmup 3
        step "09-$job-validate" $PY -m analysis validate "$OUTDIR/$job-run" "$OUTDIR/$job"
        step "09-$job-in-context" $PY bench/in_context_check.py "$OUTDIR/$job-run" "$OUTDIR/$job"
    done
fi
echo; cat "$SUMMARY"
# One archive of the logs, profiles and traces (copying many files off a lent machine can hit a file count),
# so that the pairs can be validated again offline.
tar -czf "$OUTDIR.tar.gz" -C "$OUTDIR" --exclude='rank-*' --exclude='*.json.gz' . 2>/dev/null || true
