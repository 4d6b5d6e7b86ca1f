"""Live recovery end to end: ``mpxrun --replica-groups R``, a group SIGKILLed at a chosen point.

The job (``PROGRAM``) trains a small model per rank with
:class:`mpx.dataparallel.FaultTolerantOptimizer`; every rank logs each step's
outcome and membership. The test then replays the committed steps in one
process, averaging exactly the logged members' gradients (their batches are a
function of step, group and rank), and checks that every group's final
weights equal the replay and each other: no step was applied by some replicas
and not others, and a restarted group took the live state.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from mpx.launch.virtual_cluster import VirtualCluster

PROGRAM = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import torch
    from torch import nn
    import mpx.dataparallel as dp
    from mpx.dataparallel.recovery import gradients as ft_gradients, links as ft_links
    from mpx.dataparallel.recovery import catching_up as ft_catching_up
    from mpi4py import MPI

    group = int(os.environ["MPX_REPLICA_GROUP"])
    groups = int(os.environ["MPX_REPLICA_GROUPS"])
    rank = MPI.COMM_WORLD.Get_rank()
    attempt = int(os.environ["MPX_RESTART_COUNT"])
    out = os.environ["FT_OUT"]
    steps = int(os.environ["FT_STEPS"])
    hold = int(os.environ["FT_HOLD"])
    # FT_KILL: group:rank:step:point:attempt,... -- that process SIGKILLs itself
    # there (for point "rejoin": when it sends a state at that step or later).
    ks, point, victim = "-1", "", False
    for kill in filter(None, os.environ.get("FT_KILL", "").split(",")):
        kg, kr, k_step, k_point, ka = kill.split(":")
        if (int(kg), int(kr), int(ka)) == (group, rank, attempt):
            ks, point, victim = k_step, k_point, True

    def die(where):
        print(f"group {group} rank {rank} killed {where}", flush=True)
        os.kill(os.getpid(), 9)

    # FT_DP: data parallel inside each group too, one model per group, through
    # DistributedOptimizer ("optimizer"; "optimizer-4bit": its gradients quantized
    # to 4 bits by mpx.quantize) or torch DDP on the mpx backend ("ddp"); "" (none):
    # each rank of a group has its own model (a column's).
    dp_mode = os.environ.get("FT_DP", "")
    dp_in_group = dp_mode != ""

    def make_model():
        torch.manual_seed(100 + (0 if dp_in_group else rank))  # every group alike
        return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))

    def batch(step, g):
        gen = torch.Generator().manual_seed(10_000 * step + 100 * g + rank)
        return torch.randn(5, 6, generator=gen), torch.randn(5, 2, generator=gen)

    model = make_model()
    net = model  # what the forward runs
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if dp_mode.startswith("optimizer"):
        dp.init()
        compression = None
        if dp_mode == "optimizer-4bit":
            from mpx.quantize import CompressionConfig

            compression = CompressionConfig(bits=4, bucket_size=64)
        # Buckets fly in backward.
        opt = dp.DistributedOptimizer(opt, model, overlap=True, compression=compression)
    elif dp_mode == "ddp":
        import torch.distributed as dist
        from mpx.launch import init_torch_env

        init_torch_env()
        dist.init_process_group("mpx")  # the group's own world: each group is one
        net = nn.parallel.DistributedDataParallel(model)  # the group's mean in backward
    # FT_COMPRESS=BITS: the gradients between groups that do not share memory quantized.
    compress = os.environ.get("FT_COMPRESS")
    if compress:
        from mpx.quantize import CompressionConfig

        compression = CompressionConfig(bits=int(compress), bucket_size=64)
        ft = dp.FaultTolerantOptimizer(opt, model, state={"seen": 0}, compression=compression)
    else:
        ft = dp.FaultTolerantOptimizer(opt, model, state={"seen": 0})
    log = open(f"{out}/log_g{group}_r{rank}_a{attempt}.jsonl", "w")
    # FT_CKPT: each group checkpoints after every commit and, restarted, resumes from
    # its newest checkpoint (the live state, if a peer has it, then replaces it).
    ckpt = f"{out}/ckpt_g{group}_r{rank}.pt" if os.environ.get("FT_CKPT") else None
    if ckpt and os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        ft.state.update(saved["state"])
        ft.step_count = saved["step"]
        print(f"group {group} rank {rank} resumed from its checkpoint of step {ft.step_count}",
              flush=True)

    if victim and point == "reduce":
        exchange = ft_gradients.exchange
        def partial(links, quorum, kind, payload, check, *into):
            if ft.step_count == int(ks):
                # Only the lowest peer gets this rank's gradients: it can
                # average them all, yet must discard the step with the rest.
                # (On one host the frame only names the shared buffer holding them.)
                first = min(links)
                part = payload[first] if isinstance(payload, dict) else payload
                ft_links.send_frame(links[first], quorum, kind, part, check)
                die(point)
            return exchange(links, quorum, kind, payload, check, *into)
        ft_gradients.exchange = partial
        stamp = ft._grads.segment.stamp
        def stamped(index, quorum):
            stamp(index, quorum)
            if ft.step_count == int(ks):
                # On one host no frame carries them: it dies after publishing its
                # gradients in shared memory, before its vote.
                die(point)
        ft._grads.segment.stamp = stamped
    if victim and point == "rejoin":
        send = ft_catching_up.send_frame
        def patched(sock, quorum, kind, payload, check):
            if kind == ft_catching_up.STATE and ft.step_count >= int(ks):
                die(point)
            send(sock, quorum, kind, payload, check)
        ft_catching_up.send_frame = patched
    if victim and point == "optimizer":
        inner = opt.step
        def stepping(*args, **kwargs):
            if ft.step_count == int(ks):
                die(point)
            return inner(*args, **kwargs)
        opt.step = stepping

    rejoined = False
    while ft.step_count < steps:
        if ft.step_count >= hold and not rejoined:
            # Survivors wait for the killed group to come back (its restart
            # imports torch: seconds), then go on slowly until it is a member.
            deadline = time.monotonic() + 120
            while len(ft.live_groups()) < groups and time.monotonic() < deadline:
                time.sleep(0.05)
        ft.zero_grad()
        rejoined = rejoined or len(ft.members) == groups and ft.step_count >= hold
        step = ft.step_count
        x, y = batch(step, group)
        nn.functional.mse_loss(net(x), y).backward()
        if victim and point == "backward" and step == int(ks):
            die(point)
        if victim and point == "hang" and step == int(ks):
            print(f"group {group} rank {rank} hangs", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if victim and point.startswith("pause") and step == int(ks):
            # A load spike: stopped for a few seconds (point "pause4": 4 s), then on.
            import subprocess
            seconds = point[len("pause"):]
            subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
            print(f"group {group} rank {rank} pauses {seconds} s", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            print(f"group {group} rank {rank} goes on", flush=True)
        ok = ft.step()
        ft.state["seen"] += ok
        if ok and ckpt:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "state": dict(ft.state), "step": ft.step_count}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        log.write(json.dumps({"step": step, "members": ft.members, "ok": ok}) + "\\n")
        log.flush()
        if not rejoined and ft.step_count >= hold:
            time.sleep(0.2)
    torch.save(model.state_dict(), f"{out}/final_g{group}_r{rank}.pt")
    # Whether the gradients went through shared memory (recovery.shm), as they do on one host.
    shared = any(reader is not None for _, reader in ft._grads.shared.values())
    print(f"group {group} rank {rank} shared memory: {shared}", flush=True)
    print(f"group {group} rank {rank} listens on {ft._links.address[0]}", flush=True)
    assert ft.state["seen"] == steps, ft.state  # the data position came with the state
    print(f"group {group} rank {rank} done", flush=True)
    # FT_LINGER: leave the membership, then stay a while (a restarted group then comes
    # back after this one ended training, while mpxrun still runs it).
    linger = float(os.environ.get("FT_LINGER", "0"))
    if linger:
        ft.close()
        time.sleep(linger)
    """
)


def _mpxrun() -> Path:
    mpxrun = Path(sys.executable).parent / "mpxrun"
    if not mpxrun.exists():
        pytest.fail(f"mpxrun not found next to {sys.executable}; pip install packages/launch")
    return mpxrun


def _run(
    tmp_path: Path,
    groups: int,
    nprocs: int,
    kill: str,
    steps: int,
    hold: int,
    beats: float = 20,
    data_parallel: str = "",
    extra: dict[str, str] | None = None,
    succeeds: bool = True,
    placement: tuple[str, ...] = (),
) -> str:
    """The job's output (stdout and stderr); ``extra``: more environment; ``succeeds``:
    whether mpxrun must exit 0 (else: must not); ``placement``: mpxrun's flags that put
    the groups on nodes (``--virtual-nodes 2``)."""
    script = tmp_path / "job.py"
    script.write_text(PROGRAM)
    env = {
        **os.environ,
        "FT_OUT": str(tmp_path),
        "FT_STEPS": str(steps),
        "FT_HOLD": str(hold),
        "FT_KILL": kill,
        "FT_DP": data_parallel,
        # A loaded 2-core machine can pause a process for a while: a hang is
        # not what these tests kill, and a SIGKILL is seen by the closed socket.
        "MPX_FT_HEARTBEAT_TIMEOUT": str(beats),
        **(extra or {}),
    }
    done = subprocess.run(
        [
            str(_mpxrun()),
            "--replica-groups",
            str(groups),
            *placement,
            "-n",
            str(nprocs),
            "--max-restarts",
            "2",
            "--timeout",
            "240",
            "--",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        env=env,
    )
    output = done.stdout + done.stderr
    assert (done.returncode == 0) == succeeds, output
    return output


def _committed(tmp_path: Path, rank: int) -> dict[int, list[int]]:
    """step -> the members that committed it, the same in every log that has it."""
    steps: dict[int, list[int]] = {}
    for path in sorted(tmp_path.glob(f"log_g*_r{rank}_a*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["ok"]:
                seen = steps.setdefault(entry["step"], entry["members"])
                assert seen == entry["members"], (path, entry, seen)
    return steps


def _replay(
    rank: int, committed: dict[int, list[int]], steps: int, ranks: list[int]
) -> dict[str, torch.Tensor]:
    """One process: every committed step averages the logged members' gradients (each
    member's the mean over ``ranks``: its ranks in data parallel, or this rank alone)."""
    torch.manual_seed(100 + (rank if ranks == [rank] else 0))
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    assert sorted(committed) == list(range(steps)), committed
    for step in range(steps):
        total: list[torch.Tensor] | None = None
        for g in committed[step]:
            model.zero_grad()
            for r in ranks:
                gen = torch.Generator().manual_seed(10_000 * step + 100 * g + r)
                x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 2, generator=gen)
                (nn.functional.mse_loss(model(x), y) / len(ranks)).backward()
            grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
            total = grads if total is None else [t + g_ for t, g_ in zip(total, grads, strict=True)]
        assert total is not None
        for p, t in zip(model.parameters(), total, strict=True):
            p.grad = t / len(committed[step])
        opt.step()
    return model.state_dict()


def _check(
    tmp_path: Path,
    groups: int,
    nprocs: int,
    steps: int,
    changed: bool,
    dp_in_group: bool = False,
    atol: float = 1e-6,
) -> None:
    """The groups' final weights are the same bytes, and within ``atol`` of the replay
    (a compressed run's off by its quantization error, so it must differ from it)."""
    for rank in range(nprocs):
        committed = _committed(tmp_path, rank)
        if changed:  # the kill did change the membership at some step
            assert any(len(m) < groups for m in committed.values()), committed
            assert len(committed[steps - 1]) == groups, committed  # and it came back
        expected = _replay(rank, committed, steps, list(range(nprocs)) if dp_in_group else [rank])
        for g in range(groups):
            final = torch.load(tmp_path / f"final_g{g}_r{rank}.pt", weights_only=True)
            for name, value in expected.items():
                torch.testing.assert_close(
                    final[name], value, rtol=1e-5 * (atol <= 1e-6), atol=atol
                )
            if atol > 1e-6:  # the gradients really went through the quantizer
                assert any(not torch.equal(final[k], v) for k, v in expected.items())
        first = torch.load(tmp_path / f"final_g0_r{rank}.pt", weights_only=True)
        for g in range(1, groups):
            other = torch.load(tmp_path / f"final_g{g}_r{rank}.pt", weights_only=True)
            assert all(torch.equal(first[k], other[k]) for k in first), f"group {g} differs"


def _survives(
    tmp_path: Path,
    kill: str,
    said: tuple[str, ...],
    *,
    groups: int,
    nprocs: int,
    steps: int,
    hold: int,
    beats: float = 20,
    data_parallel: str = "",
    atol: float = 1e-6,
    extra: dict[str, str] | None = None,
) -> str:
    """Runs the job with ``kill``; its output says each of ``said``, the kill changed
    the membership, which came back, and every group's weights equal the replay
    (within ``atol``). ``data_parallel``: "optimizer", "optimizer-4bit" or "ddp" inside
    each group (see PROGRAM's FT_DP); ``extra``: more environment. Returns the output."""
    out = _run(tmp_path, groups, nprocs, kill, steps, hold, beats, data_parallel, extra)
    for words in said:
        assert words in out
    _check(tmp_path, groups, nprocs, steps, True, data_parallel != "", atol)
    return out


def test_two_groups_kill_in_backward(tmp_path: Path) -> None:
    """Group 1 dies before its gradients reach the reduction: group 0's step is discarded,
    redone alone; group 1 restarts, loads group 0's state and rejoins."""
    _survives(
        tmp_path, "1:0:3:backward:0", ("killed backward",), groups=2, nprocs=1, steps=12, hold=5
    )


@pytest.mark.extended
def test_three_groups_root_killed_mid_reduction(tmp_path: Path) -> None:
    """Group 0 dies in the reduction after publishing its gradients in shared memory (over
    TCP: after sending them to group 1 only), before its vote: groups 1 and 2 could
    average all three, yet discard the step (no partial update)."""
    _survives(
        tmp_path,
        "0:0:4:reduce:0",
        ("killed reduce", "group 1 rank 0 shared memory: True"),
        groups=3,
        nprocs=1,
        steps=12,
        hold=6,
    )


@pytest.mark.extended
def test_two_groups_kill_in_optimizer(tmp_path: Path) -> None:
    """Group 1 dies in optimizer.step after the commit: group 0 keeps the committed step
    (reading group 1's gradients from its shared memory, which outlives its death)."""
    _survives(
        tmp_path, "1:0:4:optimizer:0", ("killed optimizer",), groups=2, nprocs=1, steps=12, hold=6
    )


@pytest.mark.extended
def test_three_groups_donor_killed_during_rejoin(tmp_path: Path) -> None:
    """Group 2 dies; when it rejoins, its donor (group 0) dies while sending the state:
    group 1 hands the state to both restarted groups."""
    _survives(
        tmp_path,
        "2:0:3:backward:0,0:0:1:rejoin:0",
        ("killed backward", "killed rejoin"),
        groups=3,
        nprocs=1,
        steps=14,
        hold=5,
    )


@pytest.mark.extended
def test_two_groups_of_two_ranks(tmp_path: Path) -> None:
    """Rank 1 of group 0 dies: mpxrun stops and restarts group 0 as a whole."""
    _survives(
        tmp_path, "0:1:3:backward:0", ("killed backward",), groups=2, nprocs=2, steps=12, hold=5
    )


def test_two_groups_of_three_ranks(tmp_path: Path) -> None:
    """Rank 2 of group 1 dies: group 1 restarts as a whole and each of its three ranks
    joins a step with its column's state and gradients from group 0's same rank."""
    _survives(
        tmp_path, "1:2:3:backward:0", ("killed backward",), groups=2, nprocs=3, steps=10, hold=5
    )


@pytest.mark.extended
def test_hung_group_is_counted_out_and_restarted(tmp_path: Path) -> None:
    """Group 1 stops (SIGSTOP) in its backward: no socket closes, the lighthouse counts
    it out after the heartbeat timeout, group 0 goes on alone, mpxrun restarts group 1."""
    _survives(
        tmp_path,
        "1:0:3:hang:0",
        ("hangs", "missed its heartbeats", "silent past its hang timeout"),
        groups=2,
        nprocs=1,
        steps=12,
        hold=5,
        beats=3,
        extra={"MPX_FT_HANG_TIMEOUT": "6"},
    )


@pytest.mark.extended
def test_a_group_paused_by_a_load_spike_is_waited_for_not_restarted(tmp_path: Path) -> None:
    """Group 1 stops for 4 s (SIGSTOP, then SIGCONT: a load spike) with a 1 s heartbeat
    timeout: it is counted out and group 0 goes on alone, then its beats bring it back
    and it rejoins with group 0's state, as the same process: no restart."""
    out = _survives(
        tmp_path,
        "1:0:3:pause4:0",
        ("pauses 4 s", "missed its heartbeats", "beats again", "goes on"),
        groups=2,
        nprocs=1,
        steps=12,
        hold=6,
        beats=1,
    )
    assert "Restart" not in out, out
    assert not list(tmp_path.glob("log_g*_a1.jsonl"))


@pytest.mark.extended
def test_a_group_back_after_the_others_finished_stops_and_the_job_succeeds(
    tmp_path: Path,
) -> None:
    """Group 1 dies near the end; group 0 finishes, leaves and stays up a while: the
    restarted group 1 is told the training is over, says so in one line and exits 0,
    and mpxrun exits 0 (not 1 with tracebacks). Group 0's weights equal the replay."""
    out = _run(tmp_path, 2, 1, "1:0:6:backward:0", steps=8, hold=100, extra={"FT_LINGER": "15"})
    assert "killed backward" in out
    assert "nothing left to train, it stops here" in out, out
    assert "Traceback" not in out, out
    expected = _replay(0, _committed(tmp_path, 0), 8, [0])
    final = torch.load(tmp_path / "final_g0_r0.pt", weights_only=True)
    assert all(torch.equal(final[k], v) for k, v in expected.items())


def test_no_live_peer_and_no_checkpoint_ends_the_job_not_fresh_weights(tmp_path: Path) -> None:
    """Both groups die at step 3 and restart from nothing: no group holds the state, so
    the job ends non-zero saying why, instead of training again from step 0."""
    out = _run(tmp_path, 2, 1, "0:0:3:backward:0,1:0:3:backward:0", 8, 100, succeeds=False)
    assert "no group holds the state of step 3" in out, out
    assert "not restarted" in out, out
    assert not list(tmp_path.glob("final_g*.pt"))  # nothing trained from fresh weights
    assert not [
        line for path in tmp_path.glob("log_g*_a1.jsonl") for line in path.read_text().splitlines()
    ]


@pytest.mark.extended
def test_no_live_peer_resumes_from_the_groups_checkpoints(tmp_path: Path) -> None:
    """The same double death with checkpoints: both groups resume from step 3 and finish
    (each waits for the other to be up: hold 3); their weights equal the replay of the
    committed steps and each other."""
    out = _run(
        tmp_path,
        2,
        1,
        "0:0:3:backward:0,1:0:3:backward:0",
        8,
        3,
        extra={"FT_CKPT": "1"},
    )
    for group in (0, 1):
        assert f"group {group} rank 0 resumed from its checkpoint of step 3" in out, out
    _check(tmp_path, 2, 1, 8, False)


@pytest.mark.extended
def test_three_groups_of_two_ranks_one_rank_dies_mid_reduction(tmp_path: Path) -> None:
    """Rank 0 of group 2 dies after sending its gradients to group 0 only: column 1's
    exchange completes, yet every group discards the step (the ranks of a group agree
    on the outcome) and group 2 restarts as a whole."""
    _survives(tmp_path, "2:0:3:reduce:0", ("killed reduce",), groups=3, nprocs=2, steps=10, hold=5)


@pytest.mark.extended
def test_three_groups_of_two_ranks_donor_rank_dies_during_rejoin(tmp_path: Path) -> None:
    """Group 2 dies; at its rejoin rank 1 of its donor (group 0) dies while sending: the
    newcomer's rank 0 got its column's state, rank 1 did not, so the whole group redoes
    the join (from group 1) rather than going on half loaded."""
    _survives(
        tmp_path,
        "2:0:3:backward:0,0:1:1:rejoin:0",
        ("killed backward", "killed rejoin"),
        groups=3,
        nprocs=2,
        steps=12,
        hold=5,
    )


def _inside_each_group(tmp_path: Path, kill: str, mode: str, atol: float = 1e-6) -> None:
    """Two groups of 2 ranks, data parallel inside each (``mode``: PROGRAM's FT_DP), one
    rank killed in its backward (``kill``): the job survives it (see _survives)."""
    _survives(
        tmp_path,
        kill,
        ("killed backward",),
        groups=2,
        nprocs=2,
        steps=10,
        hold=5,
        data_parallel=mode,
        atol=atol,
    )


@pytest.mark.extended
def test_two_groups_data_parallel_inside_each_group(tmp_path: Path) -> None:
    """DistributedOptimizer over each group's 2 ranks, FaultTolerantOptimizer across the
    groups: rank 1 of group 1 dies; the weights equal the replay of the global mean."""
    _inside_each_group(tmp_path, "1:1:3:backward:0", "optimizer")


@pytest.mark.extended
def test_two_groups_ddp_on_the_mpx_backend_inside_each_group(tmp_path: Path) -> None:
    """torch DDP on the mpx backend over each group's 2 ranks (init_process_group("mpx")
    in the group's own world), FaultTolerantOptimizer across the groups: rank 0 of group
    1 dies in its backward, mpxrun restarts the group, which builds DDP again and takes
    the live state; the weights equal the replay of the global mean."""
    _inside_each_group(tmp_path, "1:0:3:backward:0", "ddp")


@pytest.mark.extended
def test_two_groups_compressed_data_parallel_inside_each_group(tmp_path: Path) -> None:
    """DistributedOptimizer with 4-bit gradients (mpx.quantize) over each group's 2 ranks,
    FaultTolerantOptimizer across the groups: rank 1 of group 1 dies, the group restarts
    and takes the live state. Every group ends with the same bytes, within the
    quantizer's error of the uncompressed replay of the global mean: this model's
    gradients stay within +-0.91 (the replay's), so a 64-value bucket's unit is at most
    1.82 / 15 = 0.121 and a step's group mean is off by at most one (quantized at the
    reduce-scatter and again at the all-gather); SGD (lr 0.05, momentum 0.9) carries a
    per-step error e to at most 0.05 * e * sum(10 * (1 - 0.9**k), k = 1..10) = 2.07 e
    after 10 steps: 0.25."""
    pytest.importorskip("mpx.quantize")
    _inside_each_group(tmp_path, "1:1:3:backward:0", "optimizer-4bit", atol=0.25)


needs_netns = pytest.mark.skipif(
    not VirtualCluster.supported(), reason="needs root and iproute2 (network namespaces)"
)


@needs_netns
@pytest.mark.parametrize("nprocs", [1, pytest.param(2, marks=pytest.mark.extended)])
def test_two_groups_on_two_virtual_hosts_survive_a_kill(tmp_path: Path, nprocs: int) -> None:
    """``mpxrun --replica-groups 2 -n N --virtual-nodes 2``: each group on a host of its
    own (a network namespace), the lighthouse reached over the bridge, the gradients
    between the hosts over TCP (``MPX_FT_SHM=0``: what another host means); rank 0 of
    group 1 is killed, its group restarts on its host and rejoins."""
    out = _run(
        tmp_path,
        2,
        nprocs,
        "1:0:3:backward:0",
        12,
        5,
        extra={"MPX_FT_SHM": "0"},
        placement=("--virtual-nodes", "2"),
    )
    assert "killed backward" in out
    hosts = {
        (int(g), int(r)): address
        for g, r, address in re.findall(r"group (\d) rank (\d) listens on (\S+)", out)
    }
    assert sorted(hosts) == [(g, r) for g in range(2) for r in range(nprocs)], out
    for (g, _), address in hosts.items():
        assert address.startswith("10."), out
        assert address.endswith(f".{g + 1}"), out  # node g
    assert "shared memory: True" not in out, out
    _check(tmp_path, 2, nprocs, 12, True)


# Over TCP in every run; through shared memory (the same code, published dequantized) extended.
@pytest.mark.parametrize("shm", ["0", pytest.param("1", marks=pytest.mark.extended)])
def test_compressed_gradients_between_groups_give_every_group_the_same_bytes(
    tmp_path: Path, shm: str
) -> None:
    """compression=CompressionConfig(bits=4): over TCP (MPX_FT_SHM=0: as between hosts) each
    group's gradients travel quantized; through shared memory each publishes its
    dequantized self. Either way every group sums the same values: the final weights are
    the same bytes in every group, off the uncompressed replay by the quantizer's error
    (bounded as in test_two_groups_compressed_data_parallel_inside_each_group: 0.25),
    and not equal to it (the gradients were quantized). Group 1 is killed and rejoins."""
    pytest.importorskip("mpx.quantize")
    out = _run(
        tmp_path, 2, 1, "1:0:3:backward:0", 10, 5, extra={"FT_COMPRESS": "4", "MPX_FT_SHM": shm}
    )
    assert "killed backward" in out
    assert (f"group 0 rank 0 shared memory: {shm == '1'}") in out, out
    _check(tmp_path, 2, 1, 10, True, atol=0.25)
