"""Placement over ranks: compute shares disjoint, complete and balanced; groups of the right placement."""
from __future__ import annotations

import pytest

from harness.plan.events import build_plan
from harness.plan.spec import loads_spec
from launcher.placement import balance, place
from launcher.topology import (
    LaunchError,
    Topology,
    check_world_size,
    classify_cpu_binding,
    mpi_library_version,
    promised_world_size,
)
from tests.helpers import tiny_spec_text


def topology(size: int, per_node: int) -> Topology:
    return Topology(0, size, tuple(r // per_node for r in range(size)), tuple("host" for _ in range(size)),
                    source="emulated")


def test_balance_is_disjoint_complete_and_even():
    costs = {f"e{i}": float(c) for i, c in enumerate([9, 7, 6, 5, 4, 3, 2, 2, 1, 1])}
    share = balance(costs, 3)
    flat = [e for ids in share.values() for e in ids]
    assert sorted(flat) == sorted(costs) and len(flat) == len(set(flat))
    loads = [sum(costs[e] for e in ids) for ids in share.values()]
    assert max(loads) - min(loads) <= max(costs.values())


def test_more_ranks_than_events_leaves_some_idle():
    share = balance({"a": 1.0, "b": 2.0}, 4)
    assert sum(len(v) for v in share.values()) == 2


def plan_two_nodes():
    return build_plan(loads_spec(tiny_spec_text(layers=4, pp=2, dp=2, tp=2, global_batch=8, micro=2, nodes=2,
                                                gpus_per_node=4)))


def test_inter_and_intra_groups_on_two_emulated_nodes():
    plan = plan_two_nodes()
    placement = place(plan.unique(), topology(4, 2))
    nodes = lambda ranks: {r // 2 for r in ranks}  # noqa: E731
    assert not placement.unmeasured
    for task in placement.comm:
        if task.content["placement"] == "intra":
            assert len(nodes(task.ranks)) == 1, task
        else:
            assert len(nodes(task.ranks)) == 2, task
    kinds = {(t.kind, t.content["placement"]) for t in placement.comm}
    assert ("p2p", "inter") in kinds and ("allreduce", "intra") in kinds


def test_unmeetable_needs_are_recorded_with_a_reason_and_a_stand_in():
    plan = plan_two_nodes()
    placement = place(plan.unique(), topology(2, 2))  # one node: no inter-node pair
    reasons = list(placement.unmeasured.values())
    assert reasons and all("2 or more nodes" in why for why in reasons)
    big = build_plan(loads_spec(tiny_spec_text(layers=2, dp=8, global_batch=16, micro=2)))
    placement = place(big.unique(), topology(4, 4))
    assert any("larger than the 4 ranks" in why for why in placement.unmeasured.values())
    stand_ins = [t for t in placement.comm if t.kind == "allreduce" and not t.needed]
    assert stand_ins and max(len(t.ranks) for t in stand_ins) == 4


def test_already_measured_events_are_skipped():
    plan = plan_two_nodes()
    everything = place(plan.unique(), topology(4, 2))
    done = {e for ids in everything.compute.values() for e in ids} | {t.id for t in everything.comm}
    again = place(plan.unique(), topology(4, 2), skip=done)
    assert not any(again.compute.values()) and not again.comm


def test_world_size_promises():
    assert promised_world_size({"PMI_SIZE": "4"}) == (4, "PMI_SIZE")
    assert promised_world_size({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}) == (2, "SLURM_STEP_NUM_TASKS")
    assert promised_world_size({"SLURM_NTASKS": "8"}) is None  # an allocation, not a step: mpirun may use fewer
    check_world_size(4, {"OMPI_COMM_WORLD_SIZE": "4"})
    with pytest.raises(LaunchError, match="world size is 1 but the launcher promised 2"):
        check_world_size(1, {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"})


def test_srun_task_layout_must_match_mpi():
    from launcher.topology import check_slurm_task, slurm_context

    srun = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "1", "PMI_SIZE": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "node[01-02]"}
    check_slurm_task(1, 2, 0, 1, srun)
    with pytest.raises(LaunchError, match="SLURM_PROCID=1 but MPI says 0"):
        check_slurm_task(0, 2, 0, 0, srun)
    # mpirun inside an allocation: hydra's proxies are srun tasks (one per node), every rank sees PROCID 0
    hydra = dict(srun, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="1", MPI_LOCALRANKID="1")
    check_slurm_task(1, 2, 0, 1, hydra)
    check_slurm_task(1, 2, 0, 1, dict(hydra, MPI_LOCALRANKID="1"))
    assert slurm_context(srun)["SLURM_JOB_NODELIST"] == "node[01-02]"


def test_mpi_library_version_drops_open_mpis_trailing_nul():
    # Open MPI 4.1's MPI_Get_library_version counts the terminating NUL, which HDF5 string attributes refuse
    text = "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6, Sep 30, 2023\x00"
    assert mpi_library_version(text) == ("Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6, "
                                         "Sep 30, 2023")
    assert mpi_library_version("MPICH Version:      5.0.2\nMPICH Release date: x\n") == "MPICH Version:      5.0.2"
    assert mpi_library_version("\x00") == "unknown"
    assert "\x00" not in mpi_library_version()  # the library this suite runs on


def test_two_ranks_on_one_gpu_are_refused_before_nccl():
    from harness.common.errors import UserError
    from harness.runtime.distributed import check_one_rank_per_gpu

    check_one_rank_per_gpu([("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a"), ("n2", "GPU-b")])
    check_one_rank_per_gpu([("n1", None), ("n1", None)])  # CPU ranks
    # Slurm --gpus-per-task=1: every rank sees one device, cuda:0, but each a different GPU
    check_one_rank_per_gpu([("n1", "GPU-a"), ("n1", "GPU-b"), ("n1", "GPU-c")])
    with pytest.raises(UserError) as refused:
        check_one_rank_per_gpu([("gpu01", "GPU-a"), ("gpu01", "GPU-b"), ("gpu01", "GPU-a")])
    message = str(refused.value)
    assert "ranks 0 and 2 on gpu01 share one GPU (GPU-a)" in message and "3 ranks run there on 2 GPU(s)" in message
    assert "--ntasks-per-node=2" in message and "device = 'cpu'" in message
    assert refused.value.exit_status == 2


def test_cpu_binding_tells_bound_ranks_from_ranks_that_share_cores():
    assert classify_cpu_binding(["a", "a"], [(0,), (1,)]) == "bound"
    assert classify_cpu_binding(["a", "a", "b", "b"], [(0, 1), (2, 3), (0, 1), (2, 3)]) == "bound"  # per host
    assert classify_cpu_binding(["a", "a"], [(0, 1), (0, 1)]) == "shared"  # unbound ranks
    assert classify_cpu_binding(["a", "a"], [(0, 1), (1, 2)]) == "shared"  # overlapping sets
    assert classify_cpu_binding(["a", "b"], [(0, 1), (0, 1)]) == "single"  # one rank per host: nothing shared
    assert classify_cpu_binding(["a", "a"], []) == "unknown"  # not gathered
    assert classify_cpu_binding(["a", "a"], [(0,)]) == "unknown"


def test_an_emulated_topology_judges_binding_by_the_real_hosts():
    # two emulated nodes on one machine: their ranks still compete for the same CPUs
    emulated = Topology(0, 4, (0, 0, 1, 1), ("host",) * 4, source="emulated", cpus=((0,), (1,), (0,), (1,)))
    assert emulated.cpu_binding == "shared"
    assert Topology(0, 2, (0, 0), ("host",) * 2, cpus=((0,), (1,))).cpu_binding == "bound"
    assert topology(2, 2).cpu_binding == "unknown"  # no affinities gathered


def test_a_note_asks_for_binding_only_where_each_rank_could_have_a_core_of_its_own():
    unbound = Topology(0, 2, (0, 0), ("host",) * 2, cpus=((0, 1), (0, 1)))
    assert "--bind-to core" in unbound.unbound_note()
    assert Topology(0, 2, (0, 0), ("host",) * 2, cpus=((0,), (1,))).unbound_note() is None  # bound
    # four ranks on two CPUs share cores whatever the binding: nothing to advise
    assert Topology(0, 4, (0,) * 4, ("host",) * 4, cpus=((0, 1),) * 4).unbound_note() is None
    assert Topology(0, 2, (0, 1), ("a", "b"), cpus=((0, 1), (0, 1))).unbound_note() is None  # one per host
    assert topology(2, 2).unbound_note() is None  # affinities not gathered


def test_a_note_says_when_torch_threads_outnumber_the_cpus_they_run_on():
    bound = Topology(0, 2, (0, 0), ("host",) * 2, cpus=((0,), (1,)))
    assert bound.threads_note(1) is None
    note = bound.threads_note(2)  # two threads on a rank's one core
    assert "2 rank(s) of 2 torch thread(s) each ran on 2 CPU(s) of a host, at least one on 1 of its own" in note
    assert "give each rank 1 thread(s) or fewer" in note
    free = Topology(0, 2, (0, 0), ("host",) * 2, cpus=((0, 1, 2, 3),) * 2)
    assert free.threads_note(2) is None  # 2 x 2 threads on 4 CPUs
    assert "give each rank 2 thread(s) or fewer" in free.threads_note(3)  # 6 threads on the host's 4
    # one thread a rank: more ranks than CPUs share them however they run; nothing a thread count changes
    assert Topology(0, 4, (0,) * 4, ("host",) * 4, cpus=((0, 1),) * 4).threads_note(1) is None
    assert topology(2, 2).threads_note(8) is None  # affinities not gathered


def test_every_communication_is_swept_from_below_its_smallest_message_to_its_largest():
    """Each (kind, placement, group) the plan sends over, and all-gather and reduce-scatter on every all-reduce
    group, measured at sizes at most SWEEP_FACTOR apart from a SWEEP_DIVISOR-th of the smallest need (or
    MIN_SWEEP_BYTES) to beyond the largest, so the analysis interpolates every message on measured points."""
    from launcher.placement import MIN_SWEEP_BYTES, SWEEP_DIVISOR, SWEEP_FACTOR

    plan = plan_two_nodes()
    placement = place(plan.unique(), topology(8, 4))
    measured: dict[tuple, list[int]] = {}
    for task in placement.comm:
        c = task.content
        measured.setdefault((c["kind"], c["placement"], c.get("group", 2)), []).append(c["bytes"])
    needs: dict[tuple, list[int]] = {}
    for event in plan.events.values():
        if event.kind != "compute":
            needs.setdefault((event.kind, event.placement, event.group_size), []).append(event.bytes)
            if event.kind == "allreduce":
                for kind in ("allgather", "reducescatter"):
                    needs.setdefault((kind, event.placement, event.group_size), []).append(event.bytes)
    assert set(needs) <= set(measured)
    for key, sizes in needs.items():
        got = sorted(measured[key])
        assert got[0] <= max(MIN_SWEEP_BYTES, min(sizes) / SWEEP_DIVISOR) and got[-1] > max(sizes), key
        assert all(b / a <= SWEEP_FACTOR * 1.01 for a, b in zip(got, got[1:]) if a >= min(sizes) / SWEEP_DIVISOR)
    # a rank's share of an all-gather is whole elements (float32 on groups of 2)
    assert all(t.content["bytes"] % (4 * t.content["group"]) == 0 for t in placement.comm
               if t.kind in ("allgather", "reducescatter"))
    assert {t.kind for t in placement.comm if t.needed} == {"p2p", "allreduce"}
