"""Every schedule's timeline, drawn from the executor's own trace (a Gantt per schedule).

``python plot_timelines.py [--stages p] [--out FILE]`` starts itself under
``mpxrun -n p`` (2 by default). In one job, for each schedule of
:data:`CASES`, a model of layers that *sleep* one unit per forward, input
gradient and weight gradient (so every action takes the same time however
loaded the machine is: a sleeping rank leaves its core to the others) runs
one warm-up step and one traced step of ``2p`` micro-batches. Rank 0 gathers
every rank's ``(action, start, end)`` from :attr:`Pipeline.trace`, draws one
panel per schedule -- a row per rank, a box per action, coloured by kind
(F forward, B full backward, I input gradient, W weight gradient), labelled
with its micro-batch, lighter for a rank's second virtual stage -- and prints
the measured bubble beside :func:`mpx.pipeline.bubble_fraction`'s theory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

UNIT = 0.05  # seconds per F, I and W
CASES: list[tuple[str, int | None]] = [
    ("gpipe", None),
    ("1f1b", None),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("interleaved_zb", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]
COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
ROOT = Path(__file__).resolve().parents[3]


def _traces(
    p: int,
) -> list[tuple[str, int | None, float, list[list[tuple[str, int, int, float, float]]]]]:
    """Per case: its theory bubble and every rank's ``(kind, mb, stage, start, end)``."""
    import torch
    from torch import nn

    from mpx.collectives import world
    from mpx.pipeline import Pipeline, bubble_fraction

    class SleepyGrad(torch.autograd.Function):
        """Identity whose backward sleeps one unit."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(UNIT)
            return grad

    class Sleeper(nn.Module):
        """``y = x + w``: F, I and W sleep one unit each (separate autograd nodes)."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(UNIT)
            out: torch.Tensor = SleepyGrad.apply(x) + SleepyGrad.apply(self.w)  # type: ignore[no-untyped-call]
            return out

    comm = world()
    found = []
    for schedule, v in CASES:
        chunks, stages = 2 * p, p * (v or 1)
        model = nn.Sequential(*(Sleeper() for _ in range(stages)))
        pipe = Pipeline(model, [1] * stages, chunks=chunks, schedule=schedule, stages_per_rank=v)
        x = torch.zeros(chunks, 1, dtype=torch.float64, requires_grad=True)
        y = torch.zeros(chunks, 1, dtype=torch.float64)
        pipe.step(x, y, nn.functional.mse_loss)  # warm-up: first-call costs
        pipe.step(x, y, nn.functional.mse_loss)
        mine = [(a.kind, a.mb, a.stage, s, e) for a, s, e in pipe.trace if a.kind in COLOURS]
        rows = comm.allgather_object(mine)
        found.append((schedule, v, bubble_fraction(schedule, p, chunks, v), rows))
    return found


def _draw(found: list[Any], p: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from mpx.pipeline.runtime.executor import measured_bubble

    fig, axes = plt.subplots(len(found), 1, figsize=(11, 1.1 + 0.55 * p * len(found)))
    for ax, (schedule, v, theory, rows) in zip(axes, found, strict=True):
        begin = min(s for row in rows for _, _, _, s, _ in row)
        measured = measured_bubble([[(k, s, e) for k, _, _, s, e in row] for row in rows])
        for rank, row in enumerate(rows):
            for kind, mb, stage, start, end in row:
                left, width = (start - begin) / UNIT, (end - start) / UNIT
                # Virtual stages p..2p-1 are every rank's second chunk (looped or V).
                shade = 0.55 if stage >= p else 1.0
                ax.barh(
                    rank,
                    width,
                    left=left,
                    height=0.8,
                    color=COLOURS[kind],
                    alpha=shade,
                    edgecolor="black",
                    linewidth=0.4,
                )
                if width > 0.6:
                    ax.text(left + width / 2, rank, str(mb), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.invert_yaxis()
        chunks = f", {v} stages per rank" if v else ""
        ax.set_title(
            f"{schedule}{chunks}: bubble {measured:.3f} measured, {theory:.3f} in theory",
            fontsize=9,
            loc="left",
        )
    axes[-1].set_xlabel("time (units: one forward, input gradient or weight gradient)")
    fig.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()]
        + [Patch(color="grey", alpha=0.55, label="(lighter: a rank's 2nd stage)")],
        loc="upper right",
        ncol=4,
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def measure(p: int, out: Path) -> None:
    from mpx.collectives import world
    from mpx.pipeline.runtime.executor import measured_bubble

    found = _traces(p)
    if world().rank != 0:
        return
    print(f"| schedule ({p} ranks, m = {2 * p}) | bubble, theory | bubble, measured |")
    print("|---|---|---|")
    for schedule, v, theory, rows in found:
        measured = measured_bubble([[(k, s, e) for k, _, _, s, e in row] for row in rows])
        name = f"{schedule}, v={v}" if v else schedule
        print(f"| {name} | {theory:.3f} | {measured:.3f} |")
    _draw(found, p, out)
    print(f"\nwrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=2, help="ranks (2 or more)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "figures" / "pipeline_timelines.png"
    )
    args = parser.parse_args()
    if args.stages < 2:
        parser.error(f"--stages {args.stages}: a timeline needs 2 or more ranks")
    if args.inner:
        measure(args.stages, args.out)
        return
    mpxrun = shutil.which("mpxrun") or os.path.join(os.path.dirname(sys.executable), "mpxrun")
    command = [
        mpxrun,
        "-n",
        str(args.stages),
        "--timeout",
        "600",
        "--",
        sys.executable,
        __file__,
        "--inner",
        "--stages",
        str(args.stages),
        "--out",
        str(args.out.resolve()),
    ]
    raise SystemExit(subprocess.run(command, check=False).returncode)


if __name__ == "__main__":
    main()
