#!/usr/bin/env bash
# Profile a training job's unique events on a Slurm allocation, then predict its timeline.
#
#   sbatch slurm/profile.sh SPEC OUTDIR [harness profile options...]
#   sbatch -N 2 --ntasks-per-node=4 slurm/profile.sh SPEC OUTDIR     # override the defaults below
#
# Writes OUTDIR/profile.h5, OUTDIR/prediction.json, OUTDIR/timeline.json.gz, OUTDIR/timeline.png.
# Environment (all optional; see slurm/README.md):
#   DISTSIM_HOME      project root (default: $SLURM_SUBMIT_DIR if it holds harness/, else this script's repo)
#   DISTSIM_VENV      Python environment (default: $DISTSIM_HOME/.venv, else python3 on PATH)
#   DISTSIM_PYTHON    interpreter, overrides DISTSIM_VENV
#   DISTSIM_LAUNCHER  srun (default) or mpirun
#   DISTSIM_SRUN_MPI  srun's --mpi plugin (default pmi2, for MPICH; Open MPI: pmix)
#   DISTSIM_MPIRUN    mpirun to use with DISTSIM_LAUNCHER=mpirun (default: the env's bin, else PATH)
#
#SBATCH --job-name=distsim-profile
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
# One rank per GPU on GPU nodes: uncomment and match --ntasks-per-node (sbatch --gpus-per-node=4 works too).
##SBATCH --gpus-per-node=4
#SBATCH --time=00:30:00
#SBATCH --output=distsim-profile-%j.out
set -euo pipefail

die() { echo "profile.sh: error: $*" >&2; exit 2; }

[[ $# -ge 2 ]] || die "usage: sbatch slurm/profile.sh SPEC OUTDIR [harness profile options...]"
[[ -n "${SLURM_JOB_ID:-}" ]] || die "not inside a Slurm allocation: submit with sbatch (or run under salloc)"
SPEC=$1
OUTDIR=$2
shift 2
[[ -f "$SPEC" ]] || die "spec not found: $SPEC (relative paths are taken from $PWD)"
SPEC=$(cd "$(dirname "$SPEC")" && pwd)/$(basename "$SPEC")
[[ -n "$OUTDIR" ]] || die "OUTDIR is empty: give the folder the profile is written to"
[[ "$OUTDIR" != -* ]] || die "OUTDIR '$OUTDIR' looks like an option: give the output folder second (sbatch \
slurm/profile.sh SPEC OUTDIR [harness profile options...])"
for arg in "$@"; do
    case "$arg" in
        -o|-o?*|--output|--output=*)
            die "the output folder is OUTDIR, the second argument: drop '$arg' from the options" ;;
    esac
done

# Project root. Slurm runs a copy of this script from its spool folder, so $0 only helps
# when the script is run in place (e.g. under salloc).
if [[ -n "${DISTSIM_HOME:-}" ]]; then
    ROOT=$DISTSIM_HOME
elif [[ -n "${SLURM_SUBMIT_DIR:-}" && -d "$SLURM_SUBMIT_DIR/harness" ]]; then
    ROOT=$SLURM_SUBMIT_DIR
elif [[ -d "$(dirname "${BASH_SOURCE[0]}")/../harness" ]]; then
    ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
else
    die "cannot find the project root: set DISTSIM_HOME (sbatch ran from ${SLURM_SUBMIT_DIR:-?})"
fi
[[ -d "$ROOT/harness" ]] || die "DISTSIM_HOME=$ROOT holds no harness/"
ROOT=$(cd "$ROOT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Python: DISTSIM_PYTHON, else DISTSIM_VENV (or the project's .venv), else python3 on PATH.
VENV=${DISTSIM_VENV:-$ROOT/.venv}
if [[ -n "${DISTSIM_PYTHON:-}" ]]; then
    PY=$DISTSIM_PYTHON
    [[ -x "$PY" ]] || PY=$(command -v "$PY") || die "DISTSIM_PYTHON=$DISTSIM_PYTHON is not an interpreter found here"
elif [[ -x "$VENV/bin/python" ]]; then
    PY=$VENV/bin/python
elif [[ -n "${DISTSIM_VENV:-}" ]]; then
    die "DISTSIM_VENV=$DISTSIM_VENV has no bin/python"
else
    PY=$(command -v python3) || die "no $VENV/bin/python and no python3 on PATH: set DISTSIM_VENV or DISTSIM_PYTHON"
fi
# checked here, once, rather than as a traceback on every rank inside srun
"$PY" -c "import mpi4py, torch, h5py, numpy" 2>/dev/null \
    || die "$PY cannot import mpi4py, torch, h5py and numpy: set DISTSIM_VENV to the project's environment" \
           "(make setup) or DISTSIM_PYTHON"

NTASKS=${SLURM_NTASKS:-1}
echo "distsim-profile: job $SLURM_JOB_ID, $NTASKS tasks on ${SLURM_JOB_NUM_NODES:-1} node(s) (${SLURM_JOB_NODELIST:-?})"
echo "distsim-profile: project $ROOT, python $PY"

case "${DISTSIM_LAUNCHER:-srun}" in
    srun)
        LAUNCH=(srun --mpi="${DISTSIM_SRUN_MPI:-pmi2}" --kill-on-bad-exit=1)
        ;;
    mpirun)
        MPIRUN=${DISTSIM_MPIRUN:-}
        if [[ -z "$MPIRUN" ]]; then
            if [[ -x "$(dirname "$PY")/mpirun" ]]; then MPIRUN=$(dirname "$PY")/mpirun
            else MPIRUN=$(command -v mpirun) || die "DISTSIM_LAUNCHER=mpirun but no mpirun found: set DISTSIM_MPIRUN"
            fi
        fi
        LAUNCH=("$MPIRUN" -n "$NTASKS")
        ;;
    *) die "DISTSIM_LAUNCHER must be srun or mpirun, not '$DISTSIM_LAUNCHER'" ;;
esac

# The output folder last, once every setting is known good: a refusal leaves no empty folder behind.
mkdir -p "$OUTDIR" 2>/dev/null || die "cannot create OUTDIR $OUTDIR: give a folder this job can write"
OUTDIR=$(cd "$OUTDIR" && pwd)

PROFILE=$OUTDIR/profile.h5
PREDICTION=$OUTDIR/prediction.json
TRACE=$OUTDIR/timeline.json.gz
PICTURE=$OUTDIR/timeline.png

step() { echo "+ $*"; "$@"; }

step "${LAUNCH[@]}" "$PY" -m mpi4py -m harness profile "$SPEC" -o "$OUTDIR" "$@"
[[ -f "$PROFILE" ]] || die "the profile run wrote no $PROFILE"

echo "+ $PY -m analysis simulate $PROFILE --spec $SPEC --trace $TRACE --png $PICTURE --json > $PREDICTION"
"$PY" -m analysis simulate "$PROFILE" --spec "$SPEC" --trace "$TRACE" --png "$PICTURE" --json > "$PREDICTION.part" \
    || { rm -f "$PREDICTION.part"; die "the prediction failed (above); the profile is kept: $PROFILE"; }
mv "$PREDICTION.part" "$PREDICTION"
step "$PY" -m analysis simulate "$PROFILE" --spec "$SPEC"

echo
echo "profile:    $PROFILE"
echo "prediction: $PREDICTION"
echo "trace:      $TRACE (open in https://ui.perfetto.dev or chrome://tracing)"
echo "picture:    $PICTURE"
