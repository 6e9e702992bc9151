"""The profiling harness under mpirun (pytest-mpi): passes at any world size of 2 or more."""
from __future__ import annotations

from pathlib import Path

import h5py
import pytest

from harness.plan.events import build_plan
from harness.plan.spec import loads_spec
from harness.store.hdf5_io import plain, read_attrs, read_environment
from harness.store.hdf5_schema import IN_CONTEXT_SERIES
from tests.helpers import tiny_spec_text


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _shared_dir(tmp_path: Path) -> Path:
    """Rank 0's temp folder, shared by every rank (they each have their own tmp_path)."""
    return Path(_world().bcast(str(tmp_path), root=0))


def _spec(**kwargs):
    return loads_spec(tiny_spec_text(layers=4, hidden=32, heads=4, ffn=64, seq=16, vocab=64, warmup=1, repeats=2,
                                     **kwargs))


@pytest.mark.mpi(min_size=2)
def test_placement_disjoint_and_complete():
    from launcher.placement import place
    from launcher.topology import discover

    comm = _world()
    spec = _spec(pp=2, dp=2, tp=2, global_batch=8, micro=2, nodes=2, gpus_per_node=4)
    plan = build_plan(spec)
    placement = place(plan.unique(), discover(comm))
    mine = set(placement.compute[comm.rank])
    everyone = comm.allgather(sorted(mine))
    flat = [e for share in everyone for e in share]
    assert len(flat) == len(set(flat)), "two ranks measure the same compute event"
    assert set(flat) == {e for e, ev in plan.events.items() if ev.kind == "compute"}


@pytest.mark.mpi(min_size=2)
def test_end_to_end_profile_then_resume(tmp_path):
    import sys

    import numpy as np

    from harness.profile.comm import LATE_ROUNDS
    from harness.profile.run import run_profile
    from harness.train.engine_gaps import measure_engine_gaps

    comm = _world()
    outdir = _shared_dir(tmp_path) / "profile"
    spec = _spec(pp=2, dp=2, global_batch=8, micro=2, nodes=1, gpus_per_node=4)
    plan = build_plan(spec)
    result = run_profile(spec, outdir, comm=comm, show_progress=False, engine_gaps=measure_engine_gaps)
    comm.Barrier()
    if comm.rank == 0:
        assert result.measured > 0 and not result.unmeasured
        with h5py.File(outdir / "profile.h5") as f:
            attrs = read_attrs(f)
            assert attrs["schema_version"] == 2 and attrs["kind"] == "distsim-profile"
            datasets = []
            f.visititems(lambda name, obj: datasets.append(obj) if isinstance(obj, h5py.Dataset) else None)
            assert datasets and all(ds.fletcher32 for ds in datasets), "every dataset is checksummed"
            stored = set(f["measurements"])
            assert set(plan.events) <= stored, "every unique event is measured"
            for eid in plan.events:
                samples = f[f"measurements/{eid}/samples_s"][()]
                assert samples.shape == (2,) and (samples > 0).all()
            for g in f["measurements"].values():  # the receive timed by the receiver, kept by the sender
                if plain(g.attrs["kind"]) == "p2p":
                    busy = g["sender_busy_samples_s"][()]
                    assert busy.shape == (2,) and (busy > 0).all() and (busy < 1.0).all()
                    # the sender's own, one per repeat, posted as a training step posts (post_send): the
                    # receiver waits already, so a post is host bookkeeping (0.2-0.5 ms here), never a transfer's wait
                    posts = g["send_post_samples_s"][()]
                    assert posts.shape == (2,) and (posts > 0).all() and (posts < 0.05).all()
                    # a P2P of the job on a CPU: its rounds of the stream of late receives (what one takes from
                    # each end's compute: a run-queue wait, near 0 or above); none for a sweep's sizes
                    if g.attrs["needed"] and sys.platform.startswith("linux"):
                        late = g["late_cpu_samples_s"][()]
                        assert late.size and late.size % LATE_ROUNDS == 0 and np.isfinite(late).all()
                        assert (np.abs(late) < 0.05).all()
                    elif not g.attrs["needed"]:
                        assert "late_cpu_samples_s" not in g
                else:
                    assert "sender_busy_samples_s" not in g and "send_post_samples_s" not in g
                    assert "late_cpu_samples_s" not in g
                for series in ("divide_samples_s", "zero_samples_s"):  # the bucket's division and zeroing
                    if plain(g.attrs["kind"]) == "allreduce":
                        passes = g[series][()]
                        assert passes.shape == (2,) and (passes > 0).all() and (passes < 1.0).all()
                    else:
                        assert series not in g
            assert f["environment"].attrs["world_size"] == comm.size
            first_probes = read_environment(f)["rank_speed_probe_s"]  # every rank's, for the one compute phase
            assert len(first_probes) == 1 and all(len(m) == comm.size and min(m) > 0 for m in first_probes.values())
            # the engine's host time between steps (a stage's copy trained alone on every rank): every kind of
            # transition, each a positive time well under a step's (0.03-0.6 ms on a CPU here)
            gaps = read_environment(f)["engine_gaps_s"]
            assert set(gaps) == {"F->B", "B->F", "F->F", "B->B", "B->opt", "start", "end"}
            assert all(0 < seconds < 0.05 for seconds in gaps.values()), gaps
        assert sorted(p.name for p in outdir.glob("rank-*.h5")) == [f"rank-{r:05d}.h5" for r in range(comm.size)]
    again = run_profile(spec, outdir, comm=comm, show_progress=False)
    if comm.rank == 0:
        assert again.measured == 0 and again.skipped >= len(plan.events)
        with h5py.File(outdir / "profile.h5") as f:  # every sample is the first run's: so is the probe kept
            assert read_environment(f)["rank_speed_probe_s"] == first_probes
        # a P2P measured before sender-busy samples existed, or an all-reduce before its division was timed,
        # is measured again on resume
        for path in [outdir / "profile.h5", *outdir.glob("rank-*.h5")]:
            with h5py.File(path, "r+") as f:
                for g in f["measurements"].values():
                    for series in ("sender_busy_samples_s", "divide_samples_s", "zero_samples_s"):
                        if series in g:
                            del g[series]
    comm.Barrier()
    third = run_profile(spec, outdir, comm=comm, show_progress=False)
    if comm.rank == 0:
        p2p = [eid for eid, e in plan.events.items() if e.kind == "p2p"]
        allreduces = [eid for eid, e in plan.events.items() if e.kind == "allreduce"]
        assert p2p and allreduces and third.measured >= len(p2p) + len(allreduces)
        with h5py.File(outdir / "profile.h5") as f:
            assert all("sender_busy_samples_s" in f["measurements"][eid] and "send_post_samples_s" in
                       f["measurements"][eid] for eid in p2p)
            assert all("divide_samples_s" in f["measurements"][eid] and "zero_samples_s" in f["measurements"][eid]
                       for eid in allreduces)


@pytest.mark.mpi(min_size=2)
def test_sampling_to_a_precision_then_resuming_for_a_finer_one(tmp_path):
    """Repeats are a minimum: a compute event is sampled until its mean is known within the precision (5 samples
    at least) or the budget is spent, communication alike on its median; a resume asking for a finer precision
    measures the events that miss it again."""
    from harness.plan.precision import MIN_SAMPLES
    from harness.profile.run import run_profile
    from harness.store.hdf5_schema import PRECISION_ATTR, PRECISION_BUDGET_ATTR, PRECISION_GOAL_ATTR

    comm = _world()
    outdir = _shared_dir(tmp_path) / "profile"
    spec = loads_spec(tiny_spec_text(layers=2, hidden=16, heads=2, ffn=32, seq=8, vocab=32, pp=2, global_batch=4,
                                     micro=2, warmup=1, repeats=2, precision=0.5, budget_s=3.0))
    plan = build_plan(spec)
    compute = [eid for eid, e in plan.events.items() if e.kind == "compute"]
    first = run_profile(spec, outdir, comm=comm, show_progress=False)
    if comm.rank == 0:
        assert first.precision == 0.5
        with h5py.File(outdir / "profile.h5") as f:
            for eid in compute:
                g = f[f"measurements/{eid}"]
                assert g["samples_s"].shape[0] >= MIN_SAMPLES, "two repeats cannot tell a mean within 50%"
                assert g.attrs[PRECISION_GOAL_ATTR] == 0.5 and g.attrs[PRECISION_BUDGET_ATTR] == 3.0
                reached = float(g.attrs[PRECISION_ATTR])
                assert reached <= 0.5 or any(name == plain(g.attrs["name"]) for name, _ in first.missed_precision)
            for eid in plan.events:  # communication too: its median held to the precision
                assert f[f"measurements/{eid}"].attrs[PRECISION_GOAL_ATTR] == 0.5
    same = run_profile(spec, outdir, comm=comm, show_progress=False)
    if comm.rank == 0:
        assert same.measured == 0, "the same precision and budget would only miss again what missed"
    finer = spec.with_changes(precision=1e-6, budget_s=0.5)  # unreachable: every event misses it
    again = run_profile(finer, outdir, comm=comm, show_progress=False)
    if comm.rank == 0:
        assert again.measured >= len(plan.events)
        assert sorted(name for name, _ in again.missed_precision) == sorted(e.name for e in plan.events.values())
        assert all(reached > 1e-6 for _, reached in again.missed_precision)
    comm.Barrier()


@pytest.mark.mpi(min_size=4)
def test_emulated_nodes_form_intra_and_inter_groups(tmp_path, monkeypatch):
    """4 ranks as 2 nodes of 2 (test-only setting): inter-node P2P and intra-node groups are measured."""
    from harness.profile.run import run_profile

    comm = _world()
    monkeypatch.setenv("DISTSIM_EMULATE_RANKS_PER_NODE", str(comm.size // 2))
    outdir = _shared_dir(tmp_path) / "two-nodes"
    spec = _spec(pp=2, dp=2, tp=2, global_batch=8, micro=2, nodes=2, gpus_per_node=4)
    run_profile(spec, outdir, comm=comm, show_progress=False)
    if comm.rank == 0:
        plan = build_plan(spec)
        per_node = comm.size // 2
        with h5py.File(outdir / "profile.h5") as f:
            assert f["environment"].attrs["nodes"] == 2
            seen = set()
            for eid, g in f["measurements"].items():
                if plain(g.attrs["kind"]) == "compute":
                    continue
                nodes = {int(r) // per_node for r in g.attrs["ranks"]}
                placement = plain(g.attrs["placement"])
                assert (len(nodes) == 1) == (placement == "intra"), (eid, placement, nodes)
                seen.add((str(plain(g.attrs["kind"])), str(placement)))
            assert {("p2p", "inter"), ("allreduce", "intra")} <= seen
            assert set(plan.events) <= set(f["measurements"])


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_layers_are_profiled_as_composites(tmp_path):
    """tp=2 blocks run with their all-reduces on a real group of 2 ranks; a sample runs from the last
    member's start to the last member's end."""
    from harness.plan.events import composite_content, event_id
    from harness.profile.run import run_profile

    comm = _world()
    outdir = _shared_dir(tmp_path) / "tp"
    spec = _spec(tp=2, global_batch=4, micro=2, nodes=1, gpus_per_node=2)
    run_profile(spec, outdir, comm=comm, show_progress=False)
    if comm.rank == 0:
        plan = build_plan(spec)
        blocks = [e for e in plan.events.values() if e.name in ("gpt2.block.fwd", "gpt2.block.bwd")]
        with h5py.File(outdir / "profile.h5") as f:
            for block in blocks:
                g = f["measurements"][event_id(composite_content(block.content))]
                assert plain(g.attrs["kind"]) == "composite" and list(g.attrs["ranks"]) == [0, 1]
                assert plain(g.attrs["composite_sample"]) == "last_start_to_last_end"
                assert (g["samples_s"][()] > 0).all()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("megatron", [False, True])
def test_zero_collectives_are_profiled_as_fsdp2_runs_them(tmp_path, monkeypatch, megatron):
    """zero = 3 over dp = 2: every all-gather and reduce-scatter of the plan is measured through FSDP2 on a real
    group of 2 ranks (its copies and allocations included), not as the bare collective. With bf16 weights and
    master weights (Megatron's: fp32 main gradients) the reduce-scatters run in float32, the all-gathers in
    bfloat16, as FSDP2's reduce_dtype runs them."""
    from harness.profile.comm import CommProfiler
    from harness.profile.run import run_profile

    measured = []
    through_fsdp = CommProfiler._fsdp

    def spy(self, task, *args):
        measured.append((task.kind, task.content["bytes"]))
        return through_fsdp(self, task, *args)
    monkeypatch.setattr(CommProfiler, "_fsdp", spy)
    comm = _world()
    outdir = _shared_dir(tmp_path) / f"zero{int(megatron)}"
    text = tiny_spec_text(dp=2, layers=2, global_batch=4, micro=1, zero=3, repeats=3)
    if megatron:
        text = text.replace('dtype = "float32"', 'dtype = "bfloat16"') + "[optimizer]\nmaster_weights = true\n"
    spec = loads_spec(text)
    if megatron:
        dtypes = {(e.kind, e.content["dtype"]) for e in build_plan(spec).events.values()
                  if e.kind in ("allgather", "reducescatter")}
        assert dtypes == {("allgather", "bfloat16"), ("reducescatter", "float32")}
    run_profile(spec, outdir, comm=comm, show_progress=False)
    if comm.rank == 0:
        plan = build_plan(spec)
        sharded = [e for e in plan.events.values() if e.kind in ("allgather", "reducescatter")]
        assert sharded and all(e.content["fsdp"] for e in sharded)
        assert {e.kind for e in sharded} == {"allgather", "reducescatter"}
        with h5py.File(outdir / "profile.h5") as f:
            for event in sharded:
                samples = f["measurements"][event.id]["samples_s"][()]
                assert len(samples) >= 3 and (samples >= 0).all() and samples.max() > 0, event.name
        # the layers' compute ran as FSDP2 units, as the run holds them (harness.profile.sharded), in context too
        layers = [e for e in plan.events.values() if e.kind == "compute" and e.content.get("phase") != "optimizer"]
        assert layers and all(e.content["fsdp2"] is True for e in layers)
        with h5py.File(outdir / "profile.h5") as f:
            for event in layers:
                group = f["measurements"][event.id]
                assert (group["samples_s"][()] > 0).all() and (group[IN_CONTEXT_SERIES][()] > 0).all(), event.name
    if comm.rank in (0, 1):  # the two members of the data-parallel group measure every sharded event through FSDP2
        expected = {(e.kind, e.content["bytes"]) for e in build_plan(spec).events.values()
                    if e.kind in ("allgather", "reducescatter")}
        assert set(measured) == expected and len(expected) == 6


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["torch", "mpi4py"])
def test_an_all_reduce_sample_divides_and_zeroes_its_buffer_and_restores_it(backend, monkeypatch):
    """Each repeat divides the buffer by the group size (timed apart, as a replica averages its gradient
    bucket), all-reduces it, which must give the ones back (the division by the group size undone by the
    sum), and zeroes it (timed apart, as a replica clears its bucket) before refilling it with ones. What
    each all-reduce returned is watched on the real group: the refill alone would hide a wrong division."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from harness.profile.comm import CommProfiler
    from harness.runtime.distributed import destroy_process_group, init_process_group
    from launcher.topology import discover

    after_sum: list[np.ndarray] = []  # the buffer as each summing all-reduce left it

    real_all_reduce = dist.all_reduce

    def watched_all_reduce(tensor, *args, **kwargs):
        work = real_all_reduce(tensor, *args, **kwargs)
        if kwargs.get("op", dist.ReduceOp.SUM) == dist.ReduceOp.SUM:
            after_sum.append(tensor.clone().numpy())
        return work

    class WatchedComm:
        """The real communicator; its in-place all-reduces are noted."""

        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def Allreduce(self, sendbuf, recvbuf, op):  # noqa: N802 (mpi4py's name)
            self.real.Allreduce(sendbuf, recvbuf, op=op)
            if sendbuf is MPI.IN_PLACE:
                after_sum.append(np.array(recvbuf, copy=True))

    comm = _world()
    pair = comm.Split(0 if comm.rank < 2 else 1, key=comm.rank)
    cpu = torch.device("cpu")
    started_here = backend == "torch" and not dist.is_initialized()
    if started_here:
        init_process_group(comm, discover(comm), cpu)
    try:
        group = dist.new_group([0, 1]) if backend == "torch" else None  # collective over the world
        if comm.rank < 2:
            monkeypatch.setattr(dist, "all_reduce", watched_all_reduce)
            buffer = torch.ones(4096)
            samples, busy, divide, zero, posts, late = CommProfiler(comm, backend, cpu)._allreduce(
                buffer, group, WatchedComm(pair) if backend == "mpi4py" else None, warmup=2, repeats=150)
            monkeypatch.undo()
            assert samples.shape == divide.shape == zero.shape == (150,) and busy.size == posts.size == late.size == 0
            assert (samples > 0).all() and (divide > 0).all() and (zero > 0).all()
            assert len(after_sum) == 2 + 150
            assert all(np.array_equal(values, np.ones(4096, dtype=np.float32)) for values in after_sum)
            assert torch.equal(buffer, torch.ones(4096))
        comm.Barrier()
    finally:
        pair.Free()
        if started_here:
            destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_ranks_in_pairs_run_a_zero_chain_together_and_agree_on_its_rounds():
    """In context, a ZeRO job's stage chain runs over pairs of ranks (an odd last rank alone), its layers FSDP2 units
    over the pair: each backward's post-backwards are timed, one a unit, and the pair's members run the same
    rounds whatever their own budgets say (one stopping alone would leave the other in a collective). Each unit's
    post-backward is a sample of its reduce-scatter event over a pair of one node."""
    import torch
    import torch.distributed as dist

    from harness.profile.in_context import MIN_ROUNDS, ChainRunner, measure_chains, stage_chains
    from harness.profile.run import pair_up
    from harness.profile.sharded import set_up_alone_group
    from harness.runtime.distributed import destroy_process_group, init_process_group
    from launcher.topology import discover

    comm, cpu = _world(), torch.device("cpu")
    started_here = not dist.is_initialized()
    if started_here:
        init_process_group(comm, discover(comm), cpu)
    try:
        set_up_alone_group()  # the optimizer steps FSDP2's shards over each rank alone (collective)
        share = pair_up(comm)
        group, agree = share.group, share.agree
        alone = comm.size % 2 == 1 and comm.rank == comm.size - 1
        assert (share.index, share.count) == (comm.rank // 2, (comm.size + 1) // 2)
        assert (group is None, agree is None) == (alone, alone)
        spec = _spec(dp=2, global_batch=8, micro=2, zero=2)
        plan = build_plan(spec)
        (chain,) = stage_chains([plan])
        contents = {eid: e.content for eid, e in plan.events.items()}
        if not alone:
            runner = ChainRunner(spec, chain, contents, torch.device("cpu"), group=group, micro_batches=2)
            assert runner.units and all(dict(contents[e]).get("fsdp2") for e in chain.forward)
            out = runner.run()
            assert len(runner.post_backwards) == len(runner.units)  # zero 2: every backward reduce-scatters
            scatters = [e for e in runner.unit_reduce_scatters if e is not None]
            assert len(scatters) == len(runner.units)  # every unit has its reduce-scatter event over the pair
            assert all(plan.events[e].kind == "reducescatter" and contents[e]["group"] == 2 for e in scatters)
            assert all(len(out[e]) == scatters.count(e) and min(out[e]) > 0 for e in scatters)
            # zero 1: only a step's last backward reduce-scatters; the first keeps its post-backwards
            spec1 = _spec(dp=2, global_batch=8, micro=2, zero=1)
            plan1 = build_plan(spec1)
            (chain1,) = stage_chains([plan1])
            contents1 = {eid: e.content for eid, e in plan1.events.items()}
            runner1 = ChainRunner(spec1, chain1, contents1, cpu, group=group, micro_batches=2)
            first, last = runner1.run(), runner1.run()
            scatters1 = set(e for e in runner1.unit_reduce_scatters if e is not None)
            assert scatters1 and not scatters1 & set(first) and scatters1 <= set(last)
        budget_s = 0.0 if comm.rank % 2 == 0 else 1e9  # the pair's first member wants to stop at MIN_ROUNDS
        samples = measure_chains(spec, [chain], contents, cpu, 1, 3 * MIN_ROUNDS, budget_s, group=group, agree=agree)
        counts = comm.allgather({eid: values.size for eid, values in samples.items()})
        positions = {eid: list(chain.forward).count(eid) + list(chain.backward).count(eid) + (chain.optimizer == eid)
                     for eid in chain.events}
        if not alone:
            positions.update({e: scatters.count(e) for e in scatters})
        if not alone:
            assert counts[comm.rank] == {eid: MIN_ROUNDS * n for eid, n in positions.items()}
            assert counts[comm.rank] == counts[comm.rank ^ 1]
        share.free()
        comm.Barrier()
    finally:
        if started_here:
            destroy_process_group()
