"""Live recovery: data parallel training that goes on when a replica group dies.

Run it as::

    mpxrun --replica-groups 2 -n 1 --max-restarts 1 -- python examples/live_recovery.py
    mpxrun --replica-groups 2 -n 1 --max-restarts 1 -- \\
        python examples/live_recovery.py --fail-at 30:1      # group 1 dies at step 30

Each replica group trains the same MLP on scikit-learn's digits: every step's
global batch (the same order on every group: a seeded shuffle per epoch) is
split among the live groups by ``ft.members.index(ft.group)``, and
:class:`mpx.dataparallel.FaultTolerantOptimizer` averages the gradients over
them. Its ``state`` is the loop's data position (epoch, index), so a restarted
group takes it from a peer with the weights and resumes where the others are.

``--fail-at STEP:GROUP`` SIGKILLs rank 0 of GROUP in step STEP, in its first
start only (``MPX_RESTART_COUNT`` 0): the survivors discard that step and redo
it without the dead group, mpxrun restarts the group (``--max-restarts``), and
it rejoins with the live state. Given for every group (``--fail-at 30:0
--fail-at 30:1``) no live state is left: with ``--checkpoint-dir DIR`` (each
rank saves after every committed step, and resumes from its newest at every
start) the groups go on from their checkpoints; without, the job stops,
saying why, rather than train again from fresh weights. With ``-n 2`` or more
a group is data parallel inside too
(:class:`mpx.dataparallel.DistributedOptimizer`); a rank's death then restarts
its whole group. See docs/live-recovery.md.

Rank 0 of group 0 prints a line per epoch; rank 0 of every group prints its
last line, with a checksum of its weights: the groups' checksums are equal.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import signal
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import mpx.dataparallel as dp
from mpx.launch.settings import REPLICA_GROUPS, RESTART_COUNT

__all__ = ["main", "make_model", "parse_fail_at", "wait_for_the_restarted_group"]

GLOBAL_BATCH = 64  # split among the live groups (and their ranks) at every step


def parse_fail_at(text: str) -> tuple[int, int]:
    """``STEP:GROUP`` of --fail-at, as two ints >= 0."""
    step, sep, group = text.partition(":")
    if not (sep and step.isdigit() and group.isdigit()):
        raise argparse.ArgumentTypeError(
            f"--fail-at {text!r}: expected STEP:GROUP, two integers >= 0 (e.g. 30:1)"
        )
    return int(step), int(group)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same in every group (the first step copies group 0's anyway)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def weights_checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--fail-at",
        type=parse_fail_at,
        action="append",
        default=[],
        metavar="STEP:GROUP",
        help="rank 0 of GROUP kills itself (SIGKILL) in step STEP of its first start "
        "(repeat it for several groups)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        help="save a checkpoint after every committed step there, and resume from this "
        "rank's at every start (a live peer's newer state then replaces it)",
    )
    args = parser.parse_args()
    groups = REPLICA_GROUPS.read()
    for step, group in args.fail_at:
        if not 0 <= group < groups:
            parser.error(f"--fail-at {step}:{group}: groups are 0..{groups - 1}")

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype(np.float32), digits.target, test_size=0.2, random_state=0
    )
    x_train_t, y_train_t = torch.from_numpy(x_train), torch.from_numpy(y_train)
    x_test_t, y_test_t = torch.from_numpy(x_test), torch.from_numpy(y_test)
    steps_per_epoch = len(x_train) // GLOBAL_BATCH
    total_steps = args.epochs * steps_per_epoch
    loss_fn = nn.functional.cross_entropy

    dp.init()  # the group's own MPI world: -n ranks
    rank, size = dp.rank(), dp.total_workers()

    @functools.lru_cache(maxsize=2)
    def order_of(epoch: int) -> torch.Tensor:
        return torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))

    def batch_at(position: dict[str, int], members: list[int]) -> tuple[torch.Tensor, ...]:
        """This rank's share of the global batch at ``position``: one slice per live group,
        cut again among the group's ranks."""
        start = position["index"] * GLOBAL_BATCH
        batch = order_of(position["epoch"])[start : start + GLOBAL_BATCH]
        share = members.index(ft.group) * size + rank
        mine = batch[share :: len(members) * size]
        return x_train_t[mine], y_train_t[mine]

    def advance(position: dict[str, int]) -> None:
        position["index"] += 1
        if position["index"] == steps_per_epoch:
            position["epoch"] += 1
            position["index"] = 0

    def test_accuracy() -> float:
        with torch.no_grad():
            return float((model(x_test_t).argmax(1) == y_test_t).float().mean())

    # docs/live-recovery.md shows this part ("The loop"): keep the two alike.
    model = make_model()
    opt: torch.optim.Optimizer  # SGD, or with -n > 1 a DistributedOptimizer over it
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if size > 1:
        opt = dp.DistributedOptimizer(opt, model)  # data parallel inside the group too
    position = {"epoch": 0, "index": 0}  # where the loop is in its data
    ft = dp.FaultTolerantOptimizer(opt, model, state=position)
    first_start = RESTART_COUNT.read() == 0
    dies_at = next((step for step, group in args.fail_at if group == ft.group), -1)
    ckpt = None
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        ckpt = os.path.join(args.checkpoint_dir, f"ckpt_group{ft.group}_rank{rank}.pt")
    if ckpt and os.path.exists(ckpt):  # restarted: resume from it
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        position.update(saved["position"])
        ft.step_count = saved["step"]  # before the first zero_grad()
        if rank == 0:
            print(f"group {ft.group}: resumed from {ckpt} at step {ft.step_count}", flush=True)
    talks = rank == 0  # every group's rank 0 reports its own events
    losses: list[float] = []

    while ft.step_count < total_steps:
        ft.zero_grad()  # joins the step; a restarted group loads the live state here
        if ft.recovered and not first_start and talks:  # (at step 0: group 0's first state)
            print(
                f"group {ft.group}: rejoined at step {ft.step_count} with a peer's live state "
                f"(epoch {position['epoch']}, batch {position['index']})",
                flush=True,
            )
        if args.fail_at and len(ft.members) < groups:
            wait_for_the_restarted_group(ft, groups)
        x, y = batch_at(position, ft.members)
        loss = loss_fn(model(x), y)
        loss.backward()
        if first_start and rank == 0 and ft.step_count == dies_at:
            print(f"group {ft.group}: --fail-at: SIGKILL in step {dies_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if ft.step():
            losses.append(loss.item())
            advance(position)
            if ckpt:
                saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                saved |= {"position": dict(position), "step": ft.step_count}
                torch.save(saved, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)  # a kill mid-save leaves the last one whole
            if position["index"] == 0 and ft.group == 0 and talks:
                print(
                    f"epoch {position['epoch']}: loss {np.mean(losses):.3f}, test accuracy "
                    f"{100 * test_accuracy():.1f}%, groups {ft.members}",
                    flush=True,
                )
                losses.clear()
        elif talks:
            print(
                f"group {ft.group}: step {ft.step_count} discarded (a group died in it); "
                "doing it again",
                flush=True,
            )
    ft.close()
    if talks:
        print(
            f"group {ft.group}: done, {ft.step_count} steps: its last batch's loss "
            f"{loss.item():.3f}, test accuracy {100 * test_accuracy():.1f}%, weights sha256 "
            f"{weights_checksum(model)} (every group prints the same)",
            flush=True,
        )


def wait_for_the_restarted_group(ft: dp.FaultTolerantOptimizer, groups: int) -> None:
    """Only with --fail-at: the survivors wait for the killed group to come back.

    This run is short: it would end before the restarted group has imported torch
    (seconds), and a group that comes back after the others finished has no live
    state to rejoin. A real job trains on without waiting.
    """
    deadline = time.monotonic() + 120
    while len(ft.live_groups()) < groups and time.monotonic() < deadline:
        time.sleep(0.05)
    # Listed alive once it has built its optimizer; a member at a step boundary
    # after its first zero_grad: step slowly until then.
    time.sleep(0.05)


if __name__ == "__main__":
    main()
