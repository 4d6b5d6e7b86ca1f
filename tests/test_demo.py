"""The main job (``nox -s demo``) in every mode, as a user runs it: under mpxrun, 2 ranks.

The default mode (data parallel, 4-bit gradients) must reach the accuracy the
README promises; the other modes train a few epochs and must agree across
ranks and produce the plot.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "train_digits.py"
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
SUMMARY = re.compile(r"final test accuracy ([\d.]+)%.*loss spread across ranks ([\d.e+-]+)")


def _job(
    tmp_path: Path, env: dict[str, str], *args: str, ranks: int = 2, mpxrun: tuple[str, ...] = ()
) -> str:
    """The demo's stdout and stderr, under mpxrun in ``tmp_path``; it must succeed."""
    proc = subprocess.run(
        [
            MPXRUN,
            "-n",
            str(ranks),
            "--timeout",
            "400",
            *mpxrun,
            "--",
            sys.executable,
            str(DEMO),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=450,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _run(
    tmp_path: Path, env: dict[str, str], *args: str, ranks: int = 2, mpxrun: tuple[str, ...] = ()
) -> tuple[float, float, str]:
    """(test accuracy, loss spread across ranks, output) of a demo run."""
    out = _job(tmp_path, env, *args, ranks=ranks, mpxrun=mpxrun)
    found = SUMMARY.search(out)
    assert found, out[-2000:]
    return float(found[1]) / 100, float(found[2]), out


def test_default_job_trains_to_95_percent(tmp_path: Path, user_environment: dict[str, str]) -> None:
    accuracy, spread, out = _run(tmp_path, user_environment)
    assert "data parallel, 4-bit gradients" in out
    assert out.count("] epoch ") == 20  # one progress line per epoch, on rank 0 only
    assert accuracy >= 0.95
    assert spread == 0.0
    assert (tmp_path / "digits_dp.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "digits_dp.json").read_text())
    assert abs(summary["test_accuracy"] - accuracy) < 1e-3  # printed with one decimal
    assert summary["bytes_communicated"] > 0
    assert len(summary["loss"]) == 20


@pytest.mark.parametrize(
    "args",
    [
        ["--mode", "ddp"],
        ["--mode", "pipeline", "--schedule", "gpipe"],
        # Another schedule of the pipeline mode: --mode gpt runs async in tests already.
        pytest.param(["--mode", "pipeline", "--schedule", "async"], marks=pytest.mark.extended),
        ["--mode", "mgrit"],
        ["--mode", "2d"],
    ],
    ids=lambda a: "-".join(x.lstrip("-") for x in a[1::2]),
)
def test_other_modes_train(
    tmp_path: Path, user_environment: dict[str, str], args: list[str]
) -> None:
    accuracy, spread, out = _run(tmp_path, user_environment, *args, "--epochs", "4")
    assert accuracy > 0.5  # learning, after 4 epochs
    assert spread == 0.0
    assert (tmp_path / f"digits_{args[1]}.png").exists()
    assert json.loads((tmp_path / f"digits_{args[1]}.json").read_text())["mode"] == args[1]
    if args[1] == "2d":
        # 2 ranks are 2 stages of one replica: no data parallelism to name.
        assert "mpx demo: pipeline, 2 stages, 1f1b; 2 rank(s)" in out
        assert "data parallel" not in out


@pytest.mark.parametrize(
    ("mode", "batch"),
    [("dp", 63), pytest.param("2d", 60, marks=pytest.mark.extended)],
    ids=["dp-3-ranks", "2d-3-ranks"],
)
def test_three_ranks_run_with_the_default_batch_size(
    tmp_path: Path, user_environment: dict[str, str], mode: str, batch: int
) -> None:
    """``MPX_DEMO_RANKS=3 nox -s demo``: 64 samples do not split over 3 ranks, the default does.

    2d at 3 ranks is 1 stage x 3 replicas of 4 micro-batches each: a multiple of 12.
    """
    _, spread, out = _run(tmp_path, user_environment, "--mode", mode, "--epochs", "1", ranks=3)
    assert f"3 rank(s); 1 epochs; global batch {batch}" in out
    assert spread == 0.0


def test_gpt_mode_learns(tmp_path: Path, user_environment: dict[str, str]) -> None:
    """``--mode gpt``: the small GPT of examples/train_gpt.py, 2 stages, async.

    Bounds from a 4-rank run (2 stages x 2 replicas): 4 epochs took the loss
    from 3.46 to 2.41 nats/char and the held-out next-character accuracy to 45 %;
    a model that learned only the characters' frequencies stays near 3.2 and
    below 20 % (the space).
    """
    accuracy, spread, out = _run(
        tmp_path, user_environment, "--mode", "gpt", "--schedule", "async", "--epochs", "4"
    )
    assert accuracy > 0.3
    assert spread == 0.0
    # Named after itself (no digits in it), titled by what runs: 2 stages x 1 replica.
    assert "mpx demo: GPT on the standard library, pipeline, 2 stages, async; 2 rank(s)" in out
    assert "data parallel" not in out
    assert not list(tmp_path.glob("digits_*"))
    summary = json.loads((tmp_path / "gpt_stdlib.json").read_text())
    assert summary["loss"][-1] < min(2.8, summary["loss"][0])
    # Its plot says what a language model measures, not the digits' loss and test accuracy.
    assert summary["plot_labels"]["loss"] == "training loss (nats/char)"
    assert summary["plot_labels"]["accuracy"] == "next-character accuracy (%)"
    assert (tmp_path / "gpt_stdlib.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="dp-4bit"),
        pytest.param(
            ["--mode", "gpt", "--schedule", "async"], id="gpt-async", marks=pytest.mark.extended
        ),
        pytest.param(
            ["--mode", "pipeline", "--schedule", "async"],
            id="pipeline-async",
            marks=pytest.mark.extended,
        ),
    ],
)
def test_a_rank_killed_mid_run_restarts_from_the_checkpoint_to_the_same_result(
    tmp_path: Path, user_environment: dict[str, str], args: list[str]
) -> None:
    summaries = []
    for name, fail_at in (("straight", ""), ("restarted", "3:1")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        env = dict(user_environment, MPX_DEMO_FAIL_AT=fail_at)
        _, _, out = _run(run_dir, env, *args, "--epochs", "4", "--checkpoint-dir", "ckpt",
                         mpxrun=("--max-restarts", "1"))  # fmt: skip
        (summary,) = run_dir.glob("*.json")  # digits_<mode>.json or gpt_stdlib.json
        summaries.append(json.loads(summary.read_text()))
    assert "MPX_DEMO_FAIL_AT=3:1: rank 1 kills itself at the start of epoch 3" in out
    assert "mpxrun: rank 1 was killed by SIGKILL; all ranks were stopped. Restart 1 of 1" in out
    assert "resumed from ckpt/ckpt-e000002-b000000000.pt at epoch 3" in out
    # Every epoch's loss and accuracy, the two before the restart restored from the checkpoint.
    straight, restarted = summaries
    assert len(restarted["loss"]) == 4
    assert restarted["loss"] == straight["loss"]
    assert restarted["accuracy"] == straight["accuracy"]


def test_a_stale_checkpoint_directory_is_reported_and_never_zeroes_the_summary(
    tmp_path: Path, user_environment: dict[str, str]
) -> None:
    """A second run with ckpt/ left over: said, and the finished run's summary kept."""
    checkpointed = ("--checkpoint-dir", "ckpt", "--epochs", "1")
    _run(tmp_path, user_environment, *checkpointed)
    summary = (tmp_path / "digits_dp.json").read_text()
    assert json.loads(summary)["bytes_communicated"] > 0
    # Again, as pasted: the checkpoint holds the finished run, nothing is left to train.
    out = _job(tmp_path, dict(user_environment, MPX_DEMO_FAIL_AT="1:1"), *checkpointed,
               mpxrun=("--max-restarts", "1"))  # fmt: skip
    assert "mpx demo: nothing to train: ckpt is a finished run (1 of --epochs 1 done)" in out
    assert "rm -r ckpt" in out
    assert "summary:" not in out
    assert "kills itself" not in out
    assert (tmp_path / "digits_dp.json").read_text() == summary  # not overwritten with zeros
    # Continued with more epochs: said, and the failure asked for epoch 1 is not injected.
    out = _job(tmp_path, dict(user_environment, MPX_DEMO_FAIL_AT="1:1"), "--checkpoint-dir",
               "ckpt", "--epochs", "2", mpxrun=("--max-restarts", "1"))  # fmt: skip
    assert "ckpt holds an earlier run's checkpoints (newest: ckpt/ckpt-e000001" in out
    assert "resumed from ckpt/ckpt-e000001-b000000000.pt at epoch 2" in out
    assert "MPX_DEMO_FAIL_AT=1:1: no failure injected" in out
    continued = json.loads((tmp_path / "digits_dp.json").read_text())
    assert len(continued["loss"]) == 2
    assert continued["first_epoch_run"] == 2
    assert continued["bytes_communicated"] > 0


def _readme_restart_example() -> tuple[str, list[str]]:
    """The README's restart example (bash) and the output it shows."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"```bash\n(\. \.nox/demo/bin/activate.*?)```\n```\n(.*?)```", readme,
                      re.DOTALL)  # fmt: skip
    assert found, "README.md: the restart example (starting '. .nox/demo/bin/activate') is gone"
    return found[1], found[2].splitlines()


def _seconds_masked(text: str) -> str:
    return re.sub(r"\b\d+(\.\d+)? s\b", "N s", text)


def test_the_readme_restart_example_runs_as_pasted_over_a_leftover_checkpoint(
    tmp_path: Path, user_environment: dict[str, str]
) -> None:
    """After ``nox -s demo``, from the repository's root, a second time (ckpt/ left over).

    ``.nox/demo`` is this test's environment: its activate script puts this
    Python's mpxrun and python first on PATH, as nox's venv does.
    """
    script, shown = _readme_restart_example()
    bin_dir = tmp_path / ".nox" / "demo" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    # What a first run of the example leaves: its checkpoints (unreadable here).
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "ckpt-e000020-b000000000.pt").write_bytes(b"an earlier run's")
    proc = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True,
                          timeout=450, check=False, cwd=tmp_path, env=user_environment)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for line in shown:
        # The seconds vary from run to run.
        assert _seconds_masked(line) in _seconds_masked(out), f"README shows {line!r}:\n{out}"
    summary = json.loads((tmp_path / "digits_dp.json").read_text())
    assert summary["first_epoch_run"] == 3  # the restarted attempt's
    assert len(summary["loss"]) == 20


def test_what_the_demo_writes_is_ignored_by_git() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = ["digits_dp.png", "digits_dp.json", "digits_2d.json", "gpt_stdlib.png",
               "gpt_stdlib.json", "ckpt/ckpt-e000002-b000000000.pt"]  # fmt: skip
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT,
                             capture_output=True, text=True, check=False)  # fmt: skip
    assert sorted(ignored.stdout.split()) == sorted(written)
