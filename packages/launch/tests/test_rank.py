"""The per-rank supervisor's environment."""

from __future__ import annotations

import pytest

from mpx.launch import Environment, environment
from mpx.launch.environment import MPI_LAUNCHERS
from mpx.launch.rank import rank_environment


def test_the_program_does_not_see_the_status_key() -> None:
    env = Environment(0, 0, 1, 1, 0, "mpich")
    out = rank_environment(env, {"MPX_STATUS_KEY": "secret", "MPX_JOB_ID": "j"}, gpu_count=0)
    assert "MPX_STATUS_KEY" not in out
    assert out["MPX_JOB_ID"] == "j"


def test_threads_are_cores_per_local_rank() -> None:
    env = Environment(0, 0, 4, 4, 0, "mpich")
    out = rank_environment(env, {}, gpu_count=0)
    assert int(out["OMP_NUM_THREADS"]) >= 1
    assert "CUDA_VISIBLE_DEVICES" not in out
    assert rank_environment(env, {"OMP_NUM_THREADS": "7"}, gpu_count=0)["OMP_NUM_THREADS"] == "7"


def test_one_gpu_per_local_rank_round_robin() -> None:
    picks = [
        rank_environment(Environment(r, r, 5, 5, 0, "mpich"), {}, gpu_count=2)[
            "CUDA_VISIBLE_DEVICES"
        ]
        for r in range(5)
    ]
    assert picks == ["0", "1", "0", "1", "0"]


def test_users_visible_devices_are_shared_out() -> None:
    env = Environment(1, 1, 2, 2, 0, "mpich")
    assert rank_environment(env, {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] == "6"
    assert (
        rank_environment(env, {"CUDA_VISIBLE_DEVICES": "4,6"}, gpus="none")["CUDA_VISIBLE_DEVICES"]
        == ""
    )


def test_torchrun_variables_for_an_unmodified_torchrun_script() -> None:
    env = Environment(3, 1, 4, 2, 1, "mpich")
    base = {"MPX_MASTER_ADDR": "10.0.0.1", "MPX_MASTER_PORT": "29511"}
    out = rank_environment(env, base, gpu_count=0)
    assert {k: out[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert (out["GROUP_RANK"], out["MASTER_ADDR"], out["MASTER_PORT"]) == ("1", "10.0.0.1", "29511")
    assert out["MPX_TORCH_ENV"].split(",") == sorted(
        [
            "GROUP_RANK",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "RANK",
            "WORLD_SIZE",
        ]
    )


def test_torchrun_variables_the_user_set_are_kept() -> None:
    env = Environment(0, 0, 2, 2, 0, "mpich")
    out = rank_environment(env, {"MASTER_PORT": "1234", "MPX_MASTER_PORT": "29511"}, gpu_count=0)
    assert out["MASTER_PORT"] == "1234"
    assert "MASTER_PORT" not in out["MPX_TORCH_ENV"].split(",")


_OMPI = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)


@pytest.mark.parametrize(
    "env",
    [
        Environment(3, 1, 4, 2, 1, "mpich"),
        Environment(0, 0, 1, 1, 0, "mpich"),
        Environment(5, 2, 6, 3, 1, "slurm"),
    ],
)
def test_open_mpis_variables_for_cgx_scripts_read_back_as_the_same_place(env: Environment) -> None:
    # CGX's scripts read OMPI_COMM_WORLD_RANK/SIZE; mpx's own detection reads them first
    # (environment()), so it must find the same rank, sizes and node as before.
    base = {"PMI_RANK": str(env.rank), "PMI_SIZE": str(env.world_size), "MPX_JOB_ID": "j"}
    out = rank_environment(env, base, gpu_count=0)
    assert [out[name] for name in _OMPI] == [
        str(v) for v in (env.rank, env.world_size, env.local_rank, env.local_world_size)
    ]
    assert set(_OMPI) <= set(out["MPX_TORCH_ENV"].split(","))  # a nested mpxrun replaces them
    got = environment(out)
    assert (got.rank, got.local_rank, got.world_size, got.local_world_size, got.node_rank) == (
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        env.node_rank,
    )
    assert got.launcher in MPI_LAUNCHERS  # init_torch_env_under_mpi behaves as before


def test_open_mpis_own_or_the_users_variables_are_kept() -> None:
    env = Environment(1, 1, 2, 2, 0, "openmpi")
    base = {name: value for name, value in zip(_OMPI, ("1", "2", "1", "2"), strict=True)}
    out = rank_environment(env, base, gpu_count=0)
    assert {name: out[name] for name in _OMPI} == base
    assert not set(_OMPI) & set(out["MPX_TORCH_ENV"].split(","))
    # one set by hand: none added beside it (a mix would name two different places)
    mpich = Environment(1, 1, 2, 2, 0, "mpich")
    assert rank_environment(mpich, {}, gpu_count=0)["OMPI_COMM_WORLD_SIZE"] == "2"
    out = rank_environment(mpich, {"OMPI_COMM_WORLD_SIZE": "9"}, gpu_count=0)
    assert out["OMPI_COMM_WORLD_SIZE"] == "9"
    assert not any(name in out for name in _OMPI if name != "OMPI_COMM_WORLD_SIZE")


def test_open_mpis_variables_are_not_exported_where_they_would_misplace_the_node() -> None:
    # Slurm's cyclic placement: rank 1 on node 1 is local rank 0; environment() would
    # compute node (1 - 0) // 2 = 0 from Open MPI's variables.
    out = rank_environment(Environment(1, 0, 4, 2, 1, "slurm"), {}, gpu_count=0)
    assert not any(name in out for name in _OMPI)
    assert environment(out).node_rank == 1
    # Slurm's by-blocks placement (its default) gets them: rank 2 is node 1's first
    out = rank_environment(Environment(2, 0, 4, 2, 1, "slurm"), {}, gpu_count=0)
    assert out["OMPI_COMM_WORLD_RANK"] == "2"
    assert environment(out).node_rank == 1


def test_under_srun_a_torchrun_script_meets_at_the_steps_first_node() -> None:
    """mpxrun under srun sets no rendezvous address (srun places the ranks; mpxrun may
    run on a login node): each rank takes its step's first node, where rank 0 runs."""
    env = Environment(1, 1, 4, 2, 0, "slurm")
    base = {"MPX_MASTER_PORT": "29511", "SLURM_STEP_NODELIST": "gpu[07-08],cpu1"}
    out = rank_environment(env, base, gpu_count=0)
    assert (out["MASTER_ADDR"], out["MASTER_PORT"]) == ("gpu07", "29511")
    # mpxrun's address, when it set one, wins over the step's list.
    out = rank_environment(env, {**base, "MPX_MASTER_ADDR": "10.0.0.1"}, gpu_count=0)
    assert out["MASTER_ADDR"] == "10.0.0.1"
