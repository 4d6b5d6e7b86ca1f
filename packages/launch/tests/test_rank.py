"""The per-rank supervisor's environment."""

from __future__ import annotations

from mpx.launch import Environment
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
            "RANK",
            "WORLD_SIZE",
        ]
    )


def test_torchrun_variables_the_user_set_are_kept() -> None:
    env = Environment(0, 0, 2, 2, 0, "mpich")
    out = rank_environment(env, {"MASTER_PORT": "1234", "MPX_MASTER_PORT": "29511"}, gpu_count=0)
    assert out["MASTER_PORT"] == "1234"
    assert "MASTER_PORT" not in out["MPX_TORCH_ENV"].split(",")
