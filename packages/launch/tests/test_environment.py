"""environment() and init_torch_env() against each launcher's variables."""

from __future__ import annotations

import itertools
import os
import socket

import pytest

from mpx.launch import (
    Environment,
    LaunchEnvironmentError,
    address_towards,
    environment,
    init_torch_env,
)
from mpx.launch.environment import slurm_first_node


def test_single_process_is_rank_0_of_1() -> None:
    assert environment({}) == Environment(0, 0, 1, 1, 0, "single")


def test_open_mpi_variables() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        # MPI's variables win over an enclosing torchrun's or batch script's.
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    assert environment(env) == Environment(5, 1, 8, 4, 1, "openmpi")


def test_mpich_hydra_variables() -> None:
    env = {
        "PMI_RANK": "2",
        "PMI_SIZE": "3",
        "MPI_LOCALRANKID": "2",
        "MPI_LOCALNRANKS": "3",
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
    }
    assert environment(env) == Environment(2, 2, 3, 3, 0, "mpich")


def test_mpich_without_local_variables_assumes_one_node() -> None:
    assert environment({"PMI_RANK": "1", "PMI_SIZE": "2"}) == Environment(1, 1, 2, 2, 0, "mpich")


@pytest.mark.parametrize(
    ("tasks_per_node", "node", "local_size"),
    [("4", 0, 4), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("3,5", 1, 5)],
)
def test_slurm_variables(tasks_per_node: str, node: int, local_size: int) -> None:
    env = {
        "SLURM_PROCID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "9",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node),
        "SLURM_TASKS_PER_NODE": tasks_per_node,
    }
    got = environment(env)
    assert (got.rank, got.world_size, got.node_rank, got.local_world_size, got.launcher) == (
        7,
        9,
        node,
        local_size,
        "slurm",
    )


def test_slurm_batch_script_without_a_step_is_not_a_rank() -> None:
    # sbatch sets SLURM_PROCID=0 for the batch script itself; only srun steps count.
    assert environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "single"


def test_torchrun_variables() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
    }
    assert environment(env) == Environment(3, 1, 4, 2, 1, "torchrun")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PMI_RANK": "one", "PMI_SIZE": "2"}, "PMI_RANK='one' is not an integer"),
        ({"PMI_RANK": "2", "PMI_SIZE": "2"}, "rank 2 is outside [0, 2)"),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_STEP_ID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_NODEID": "0",
                "SLURM_TASKS_PER_NODE": "two",
            },
            "SLURM_TASKS_PER_NODE='two'",
        ),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_STEP_ID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_NODEID": "3",
                "SLURM_TASKS_PER_NODE": "1(x2)",
            },
            "SLURM_NODEID=3",
        ),
    ],
)
def test_malformed_variables_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchEnvironmentError) as info:
        environment(env)
    assert message in str(info.value)


TORCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


def _forget_torch_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in TORCH_VARIABLES:
        # setenv first: monkeypatch then removes what init_torch_env writes, at teardown
        # (a plain delenv of an absent name would leave it set for later tests: an
        # mpxrun they start would hand RANK=0 WORLD_SIZE=1 to every rank).
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def test_init_torch_env_uses_mpxrun_master(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_torch_variables(monkeypatch)
    monkeypatch.setenv("MPX_MASTER_ADDR", "node17")
    monkeypatch.setenv("MPX_MASTER_PORT", "29511")
    got = init_torch_env(Environment(3, 1, 4, 2, 1, "mpich"))
    assert got.rank == 3
    assert {
        k: os.environ[k]
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    } == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node17",
        "MASTER_PORT": "29511",
    }


def test_init_torch_env_keeps_users_master(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_torch_variables(monkeypatch)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    init_torch_env(Environment(0, 0, 1, 1, 0, "single"))
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.1", "1234")


@pytest.mark.mpi
def test_environment_matches_mpi_comm_world() -> None:
    from mpi4py import MPI

    env = environment()
    comm = MPI.COMM_WORLD
    assert (env.rank, env.world_size) == (comm.Get_rank(), comm.Get_size())
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    assert (env.local_rank, env.local_world_size) == (local.Get_rank(), local.Get_size())
    local.Free()


@pytest.mark.mpi
def test_init_torch_env_lets_gloo_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    for key in ("MASTER_ADDR", "MASTER_PORT", "MPX_MASTER_ADDR", "MPX_MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)  # agree through MPI, as under a bare mpiexec
    _forget_torch_variables(monkeypatch)
    env = init_torch_env()
    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(t)
        assert t.item() == env.world_size * (env.world_size + 1) / 2
    finally:
        dist.destroy_process_group()


def test_address_towards_names_the_interface_on_the_route() -> None:
    # Loopback is reached from loopback; a documentation-only address (TEST-NET-1)
    # from one of this host's own addresses, whatever its interfaces are.
    assert address_towards("127.0.0.1") == "127.0.0.1"
    outward = address_towards("192.0.2.1") if _has_default_route() else "127.0.0.1"
    assert outward in _own_addresses()


def test_address_towards_an_address_it_cannot_route_to_raises() -> None:
    # An IPv6 address on the IPv4 probe: refused at once, with no name lookup.
    with pytest.raises(socket.gaierror, match="not supported"):
        address_towards("::1")


def _has_default_route() -> bool:
    try:
        address_towards("192.0.2.1")
    except OSError:
        return False
    return True


def _own_addresses() -> set[str]:
    """This host's IPv4 addresses, as the kernel lists its routes' sources."""
    found = {"127.0.0.1"}
    with open("/proc/net/fib_trie") as trie:
        lines = trie.read().splitlines()
    for before, line in itertools.pairwise(lines):
        if "/32 host LOCAL" in line:
            found.add(before.split()[-1])
    return found


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("vm", "vm"),
        ("node[01-04,07]", "node01"),
        ("a1,b2", "a1"),
        ("rack1-[3-5],x", "rack1-3"),
        ("c[1-2]n[3,5]-ib", "c1n3-ib"),
        ("x[2,4-6],y[1]", "x2"),
        ("", ""),
    ],
)
def test_slurm_first_node_reads_the_steps_hostlist(nodelist: str, first: str) -> None:
    assert slurm_first_node({"SLURM_STEP_NODELIST": nodelist}) == first
    assert slurm_first_node({}) == ""
