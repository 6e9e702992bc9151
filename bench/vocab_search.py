"""The strategy search over tp for a job whose vocabulary is large beside its hidden size, with the embedding and
the head replicated over tp (vocab_parallel = false, the layout before issue 37) and split by vocabulary (the
default): which strategy each picks, and how much each tp > 1 candidate's prediction and peak memory change.

Each layout is profiled on 4 ranks (2 emulated nodes of 2) as the union of the search's candidates (mpirun -n 4
harness profile), then searched (analysis search --json); the two profiles run one after the other, so the
changes mix the layouts' difference with the machine's drift between them (about 8-11% within an hour here):
read a change within that as none.
Run: .venv/bin/python bench/vocab_search.py [--keep DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import MODEL, run  # noqa: E402  (the accuracy bench's model, at a shorter sequence, a larger vocabulary)

JOB = MODEL.replace("seq_len = 128", "seq_len = 64").replace("vocab = 2048", "vocab = 16384") + """[batch]
global = 16
micro = 1
[strategy]
dp = 2
tp = 2
pp = 2
vocab_parallel = {vocab_parallel}
[cluster]
nodes = 2
gpus_per_node = 4
device_memory_gb = {memory_gb}
[profile]
warmup = 2
repeats = 10
budget_s = 5
[search]
tp = [1, 2, 4]
pp = [1, 2]
micro = [1, 2]
schedule = ["1f1b"]
"""
MEMORY_GB = 0.1  # per device: a whole head's weights, gradients and Adam states (67 MB) do not leave room for much


def profile_and_search(workdir: Path, vocab_parallel: bool, env: dict) -> dict:
    """The search's JSON for one layout (profiled into workdir)."""
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    workdir.mkdir(parents=True, exist_ok=True)
    job = workdir / "job.toml"
    job.write_text(JOB.format(vocab_parallel=str(vocab_parallel).lower(), memory_gb=MEMORY_GB))
    print(f"profiling vocab_parallel = {str(vocab_parallel).lower()} on 4 ranks ...", file=sys.stderr, flush=True)
    run([mpirun, "-n", "4", sys.executable, "-m", "mpi4py", "-m", "harness", "profile", str(job), "-o",
         str(workdir / "prof"), "--quiet", "--force"], {**env, "DISTSIM_EMULATE_RANKS_PER_NODE": "2"})
    result = run([sys.executable, "-m", "analysis", "search", str(workdir / "prof" / "profile.h5"), "--json",
                  "--exhaustive"], env)  # every layout's time, the slow ones too
    return json.loads(result.stdout)


def candidates_by_label(search: dict) -> dict[str, dict]:
    return {c["strategy"]: c for c in search["candidates"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="profile into this folder and keep it")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="vocab-search-") as scratch:
        root = args.keep or Path(scratch)
        searches = {layout: profile_and_search(root / layout, layout == "vocab-parallel", env)
                    for layout in ("replicated", "vocab-parallel")}
    before, after = (candidates_by_label(searches[layout]) for layout in ("replicated", "vocab-parallel"))
    rows = []
    for label in sorted(set(before) & set(after), key=lambda k: (before[k]["tp"], before[k]["pp"], k)):
        old, new = before[label], after[label]
        if old.get("batch_time_s") is None or new.get("batch_time_s") is None:
            continue
        rows.append({"strategy": label, "tp": old["tp"],
                     "before_ms": 1e3 * old["batch_time_s"], "after_ms": 1e3 * new["batch_time_s"],
                     "time_change_pct": 100 * (new["batch_time_s"] / old["batch_time_s"] - 1),
                     "before_memory_mb": old["peak_memory_bytes"] / 1e6,
                     "after_memory_mb": new["peak_memory_bytes"] / 1e6,
                     "memory_change_pct": 100 * (new["peak_memory_bytes"] / old["peak_memory_bytes"] - 1),
                     "fits_before": old["feasible"], "fits_after": new["feasible"]})
    best = {layout: next((c["strategy"] for c in searches[layout]["candidates"] if c["feasible"]), None)
            for layout in searches}
    if args.json:
        print(json.dumps({"best": best, "rows": rows}, indent=2))
        return 0
    print(f"best replicated: {best['replicated']}   best vocab-parallel: {best['vocab-parallel']}")
    print(f"{'strategy':<34} {'tp':>2} {'before ms':>10} {'after ms':>9} {'time':>7} {'before MB':>10} "
          f"{'after MB':>9} {'memory':>7} fits")
    for r in rows:
        fits = f"{'yes' if r['fits_before'] else 'no'}->{'yes' if r['fits_after'] else 'no'}"
        print(f"{r['strategy']:<34} {r['tp']:>2} {r['before_ms']:>10.1f} {r['after_ms']:>9.1f} "
              f"{r['time_change_pct']:>+6.1f}% {r['before_memory_mb']:>10.1f} {r['after_memory_mb']:>9.1f} "
              f"{r['memory_change_pct']:>+6.1f}% {fits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
