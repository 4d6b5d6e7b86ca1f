"""End to end: rank 1 SIGKILLed mid-epoch under ``mpxrun --max-restarts 1`` resumes bitwise.

The job trains a float64 model, checkpointing with
``mpx.dataparallel.save_resumable``; on attempt 0 (``MPX_RESTART_COUNT``) a
rank kills itself at a chosen step. mpxrun restarts the job, which resumes
with ``mpx.dataparallel.resume``; its final parameters must equal those of a
run that was never interrupted, bit for bit. Three jobs: data parallel; the
asynchronous pipeline and the 2-D pipeline x data parallel (sharded
checkpoints, taken after a flush); and data parallel whose writer dies in the
middle of writing a checkpoint, whose restart must load the one before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

MPXRUN = os.path.join(os.path.dirname(sys.executable), "mpxrun")
JOB_TIMEOUT_S = 240

# argv: checkpoint dir, output file, the global step at which rank 1 dies ("-1": never).
PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    import mpx.dataparallel as dp
    from mpx.launch.settings import RESTART_COUNT

    directory, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1)).double()
    dp.synchronize(model)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    x = torch.randn(36, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    data = dp.DistributedDataContainer((x, x.sum(1, keepdim=True)), shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    point = dp.resume(directory, model, opt, data=data)
    for epoch in range(point.epoch, 3):
        data.set_epoch(epoch)
        for i, (xb, yb) in point.batches(loader, epoch):
            step = epoch * len(loader) + i
            victim = dp.rank() == min(1, dp.world_size() - 1)
            if step == kill_at and RESTART_COUNT.get() == 0 and victim:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            dp.save_resumable(directory, model, opt, epoch=epoch, batch=i + 1)
    if dp.rank() == 0:
        torch.save([p.detach() for p in model.parameters()], out)
    """
)


# argv: checkpoint dir, output file, the step at which rank 1 dies ("-1": never),
# "async" (one stage per rank, prediction, gap aware, step_every 2) or "2d"
# (1F1B with dropout, 2 stages if the rank count is even, replicas for the rest).
PIPELINE_PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    import mpx.dataparallel as dp
    from mpx.collectives import world
    from mpx.launch.settings import RESTART_COUNT
    from mpx.pipeline import Pipeline

    directory, out, kill_at, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    comm = world()
    stages = comm.size if mode == "async" else (2 if comm.size % 2 == 0 else 1)
    replica, replicas = comm.rank // stages, comm.size // stages
    stage_comm = comm.split(replica)
    replica_comm = comm.split(comm.rank % stages)
    torch.manual_seed(0)
    layers = []
    for _ in range(stages):
        layers += [nn.Linear(4, 6), nn.Dropout(0.2), nn.Tanh(), nn.Linear(6, 4)]
    if mode == "async":
        options = dict(schedule="async", weight_prediction="msnag", gap_aware="ga", step_every=2)
    else:
        options = dict(schedule="1f1b")
    pipe = Pipeline(nn.Sequential(*layers).double(), [4] * stages, comm=stage_comm, chunks=2,
                    data_parallel_comm=replica_comm, **options)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 12, 4, generator=g, dtype=torch.float64)
    point = dp.resume(directory, pipe, opt, comm=comm)
    for step in range(point.batch, 12):
        if step == kill_at and RESTART_COUNT.get() == 0 and comm.rank == min(1, comm.size - 1):
            os.kill(os.getpid(), signal.SIGKILL)
        xb = x[step][replica::replicas]
        pipe.step(xb, xb.flip(1).tanh(), nn.functional.mse_loss, opt)
        if (step + 1) % 2 == 0:
            pipe.flush(opt)  # a checkpoint of the async stream is taken drained
            dp.save_resumable(directory, pipe, opt, epoch=0, batch=step + 1, sharded=True)
    pipe.flush(opt)
    mine = torch.cat([p.detach().reshape(-1) for p in pipe.parameters()])
    everyone = comm.allgather_object(mine)
    if comm.rank == 0:
        torch.save(everyone, out)
    """
)

# argv: checkpoint dir, output file, the step whose checkpoint rank 0 (the
# writer) dies writing: it cuts the temporary file to half and SIGKILLs itself
# before the file is renamed into place.
TORN_SAVE_PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    import mpx.dataparallel as dp
    from mpx.launch.settings import RESTART_COUNT

    directory, out, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    saving = [-1]
    real_fsync = os.fsync

    def fsync_or_die(fd):
        writing = os.readlink(f"/proc/self/fd/{fd}")
        if saving[0] == crash_at and RESTART_COUNT.get() == 0 and ".tmp-" in writing:
            os.ftruncate(fd, os.fstat(fd).st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)

    os.fsync = fsync_or_die
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    dp.synchronize(model)
    opt = dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), model)
    x = torch.randn(36, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    data = dp.DistributedDataContainer((x, x.sum(1, keepdim=True)), shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    point = dp.resume(directory, model, opt, data=data)
    if dp.rank() == 0:
        done = point.epoch * len(loader) + point.batch
        os.write(1, f"attempt {RESTART_COUNT.get()} resumed after {done} steps\\n".encode())
    for epoch in range(point.epoch, 3):
        data.set_epoch(epoch)
        for i, (xb, yb) in point.batches(loader, epoch):
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            saving[0] = epoch * len(loader) + i
            dp.save_resumable(directory, model, opt, epoch=epoch, batch=i + 1)
    if dp.rank() == 0:
        torch.save([p.detach() for p in model.parameters()], out)
    """
)


def _job(
    tmp_path: Path, program: str, nprocs: int, restarts: int, *args: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(program)
    return subprocess.run(
        [
            MPXRUN,
            "-n",
            str(nprocs),
            "--timeout",
            str(JOB_TIMEOUT_S),
            "--max-restarts",
            str(restarts),
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=2 * JOB_TIMEOUT_S + 60,
        check=False,
    )


def _train(tmp_path: Path, name: str, nprocs: int, kill_at: int) -> torch.Tensor:
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    out = tmp_path / f"{name}.pt"
    restarts = ["--max-restarts", "1"] if kill_at >= 0 else []
    proc = subprocess.run(
        [
            MPXRUN,
            "-n",
            str(nprocs),
            "--timeout",
            str(JOB_TIMEOUT_S),
            *restarts,
            str(script),
            str(tmp_path / name),
            str(out),
            str(kill_at),
        ],
        capture_output=True,
        text=True,
        timeout=2 * JOB_TIMEOUT_S + 60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    if kill_at >= 0:
        assert "was killed by SIGKILL" in proc.stderr, proc.stderr
        assert "Restart 1 of 1" in proc.stderr
    params: list[torch.Tensor] = torch.load(out, weights_only=True)
    return torch.cat([p.reshape(-1) for p in params])


@pytest.mark.timeout(4 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_a_rank_killed_mid_epoch_resumes_to_the_uninterrupted_result(
    tmp_path: Path, nprocs: int
) -> None:
    reference = _train(tmp_path, "straight", nprocs, kill_at=-1)
    # Step 7: in the middle of the first or second epoch for every rank count.
    restarted = _train(tmp_path, "restarted", nprocs, kill_at=7)
    assert torch.equal(restarted, reference)


@pytest.mark.timeout(4 * JOB_TIMEOUT_S)
@pytest.mark.parametrize(
    ("mode", "nprocs"),
    [
        ("async", 2),
        # 2 stages x 2 replicas: 4 processes on CI's 2 cores; another mode of the same job.
        pytest.param("2d", 4, marks=pytest.mark.extended),
        pytest.param("async", 3, marks=pytest.mark.extended),
        pytest.param("2d", 2, marks=pytest.mark.extended),
        pytest.param("2d", 3, marks=pytest.mark.extended),
    ],
)
def test_a_pipeline_rank_killed_resumes_to_the_uninterrupted_result(
    tmp_path: Path, mode: str, nprocs: int
) -> None:
    results = {}
    for name, kill_at in (("straight", -1), ("restarted", 7)):
        out = tmp_path / f"{name}.pt"
        proc = _job(tmp_path, PIPELINE_PROGRAM, nprocs, 1, str(tmp_path / name), str(out),
                    str(kill_at), mode)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert ("Restart 1 of 1" in proc.stderr) == (kill_at >= 0), proc.stderr
        results[name] = torch.load(out, weights_only=True)
    assert len(results["restarted"]) == nprocs
    for rank, (restarted, straight) in enumerate(
        zip(results["restarted"], results["straight"], strict=True)
    ):
        assert torch.equal(restarted, straight), f"rank {rank}"


@pytest.mark.timeout(4 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_a_crash_while_writing_a_checkpoint_resumes_from_the_one_before(
    tmp_path: Path, nprocs: int
) -> None:
    results = {}
    for name, crash_at in (("straight", -1), ("restarted", 8)):
        out = tmp_path / f"{name}.pt"
        directory = tmp_path / name
        proc = _job(tmp_path, TORN_SAVE_PROGRAM, nprocs, 1, str(directory), str(out),
                    str(crash_at))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        results[name] = torch.cat([p.reshape(-1) for p in torch.load(out, weights_only=True)])
        assert not [p.name for p in directory.iterdir() if ".tmp-" in p.name]
    assert "rank 0 was killed by SIGKILL" in proc.stderr, proc.stderr
    # Step 8's save was cut short: the restart loads step 7's (8 steps done).
    assert "attempt 1 resumed after 8 steps" in proc.stdout, proc.stdout
    assert torch.equal(results["restarted"], results["straight"])
