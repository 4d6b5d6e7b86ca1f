"""``mpxrun --replica-groups R``: R jobs that fail and restart alone, what each rank is told,
where the groups run, and what the job's exit code is."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpx.launch import cli
from mpx.launch.cli import EXIT_USAGE, main
from mpx.launch.errors import UsageError
from mpx.launch.launchers import Launcher
from mpx.launch.rank import new_key
from mpx.launch.recovery import check_usage, place_groups, ranks_per_node, run_groups
from mpx.launch.supervision import Job

PROGRAM = textwrap.dedent(
    """
    import hashlib, os, sys, time
    group, attempt = os.environ["MPX_REPLICA_GROUP"], os.environ["MPX_RESTART_COUNT"]
    secret = os.environ["MPX_JOB_SECRET"]  # printed as a digest only
    print(f"start group={group} of={os.environ['MPX_REPLICA_GROUPS']} attempt={attempt} "
          f"lighthouse={os.environ['MPX_LIGHTHOUSE']} job={os.environ['MPX_JOB_ID']} "
          f"secret={len(secret)}:{hashlib.sha256(secret.encode()).hexdigest()[:12]}", flush=True)
    if group == "1" and attempt == "0":
        sys.exit(3)          # group 1 fails once; group 0 must not be restarted for it
    time.sleep(float(sys.argv[1]) if group == "0" else 0)
    """
)


def _mpxrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    mpxrun = Path(sys.executable).parent / "mpxrun"
    return subprocess.run(
        [str(mpxrun), *args, "--timeout", "100", "--", sys.executable, str(script), "3"],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


def test_a_failed_group_restarts_alone(tmp_path: Path) -> None:
    done = _mpxrun(tmp_path, "--replica-groups", "2", "--max-restarts", "1")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    starts = sorted(line for line in done.stdout.splitlines() if line.startswith("start"))
    assert [s.split(" lighthouse")[0] for s in starts] == [
        "start group=0 of=2 attempt=0",
        "start group=1 of=2 attempt=0",
        "start group=1 of=2 attempt=1",
    ], out
    # One lighthouse and one secret (64 hex digits) for all; each group its own job id.
    assert len({s.split("lighthouse=")[1].split()[0] for s in starts}) == 1
    assert len({s.split("job=")[1].split()[0] for s in starts[:2]}) == 2
    assert {s.split("secret=")[1].split(":")[0] for s in starts} == {"64"}
    assert len({s.split("secret=")[1] for s in starts}) == 1
    assert (
        "replica group 1: rank 0 exited with code 3; its ranks were stopped, the other "
        "groups go on. Restart 1 of 1" in out
    )


def test_a_group_out_of_restarts_fails_the_job(tmp_path: Path) -> None:
    done = _mpxrun(tmp_path, "--replica-groups", "2")
    assert done.returncode == 3, done.stderr
    assert "replica group 1 failed for good: rank 0 exited with code 3" in done.stderr


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bad_group_count_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--replica-groups", value, "--", "true"])
    assert exit_info.value.code == EXIT_USAGE
    assert "--replica-groups" in capsys.readouterr().err


def test_a_launcher_for_this_host_only_is_refused_for_other_hosts() -> None:
    """MPICH's gforker starts ranks here only: groups on other nodes need another."""
    with pytest.raises(UsageError, match="needs a launcher that reaches them"):
        check_usage(forker=True, local=False)
    check_usage(forker=True, local=True)
    check_usage(forker=False, local=False)


@pytest.mark.parametrize(
    ("groups", "nodes", "placed"),
    [
        (1, 1, [[0]]),
        (2, 2, [[0], [1]]),
        (2, 5, [[0, 1, 2], [3, 4]]),
        (3, 4, [[0, 1], [2], [3]]),
        (3, 2, [[0], [1], [0]]),
        (4, 1, [[0], [0], [0], [0]]),
    ],
)
def test_each_group_gets_nodes_of_its_own_where_there_are_enough(
    groups: int, nodes: int, placed: list[list[int]]
) -> None:
    assert place_groups(groups, nodes) == placed
    used = [n for group in placed for n in group]
    assert sorted(set(used)) == list(range(nodes))  # every node is used


def test_ranks_spread_evenly_over_a_groups_nodes() -> None:
    assert ranks_per_node(4, 3) == [2, 1, 1]
    assert ranks_per_node(2, 2) == [1, 1]
    with pytest.raises(UsageError, match="-n 1 gives each replica group fewer ranks than its 2"):
        ranks_per_node(1, 2)


def _args(hostfile: str, groups: int, nprocs: int) -> argparse.Namespace:
    return argparse.Namespace(
        replica_groups=groups, nprocs=nprocs, hostfile=hostfile, bind="none", tag_output=False
    )


def test_a_hostfile_gives_each_group_a_hostfile_of_its_nodes(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.11:4\n127.0.0.12:4\n127.0.0.13:4\n")  # three "nodes"
    supervised = [sys.executable, "-m", "mpx.launch.rank", "--", "prog"]
    with contextlib.ExitStack() as stack:
        commands, masters, listen, advertise = cli._place_groups(
            _args(str(hosts), 3, 2),
            Launcher("mpich", "/usr/bin/mpiexec"),
            ["/usr/bin/mpiexec", "-n", "2", *supervised],
            (supervised, []),
            None,
            False,
            stack,
        )
        files = [Path(c[c.index("-f") + 1]).read_text() for c in commands]
    assert files == ["127.0.0.11:2\n", "127.0.0.12:2\n", "127.0.0.13:2\n"]
    assert masters == ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
    assert all(c[-len(supervised) :] == supervised and c[1:3] == ["-n", "2"] for c in commands)
    assert listen == "0.0.0.0"  # reached from the other nodes; every connection is proven
    assert advertise == "127.0.0.1"  # this host's address towards the first node


def _one_rank(body: str) -> Job:
    """A group of one rank running ``body`` under the rank supervisor, as mpxrun's."""
    key = new_key()
    command = [sys.executable, "-m", "mpx.launch.rank", "--", sys.executable, "-c", body]
    return Job(command, env=dict(os.environ, MPX_STATUS_KEY=key), status_key=key, nprocs=1)


@pytest.mark.parametrize(("ending", "code"), [("killed", 0), ("error", 3)])
def test_a_group_killed_after_another_finished_does_not_fail_the_job(
    ending: str, code: int
) -> None:
    """Group 0 exits 0 (finished training); group 1 then ends: SIGKILLed, it is not
    restarted and the job exits 0; failing with its program's error, it fails the job."""
    attempts: list[tuple[int, int]] = []
    end = "os.kill(os.getpid(), signal.SIGKILL)" if ending == "killed" else "sys.exit(3)"

    def job(group: int, attempt: int) -> Job:
        attempts.append((group, attempt))
        if group == 0:
            return _one_rank("pass")
        return _one_rank(f"import os, signal, sys, time; time.sleep(2); {end}")

    assert run_groups(job, 2, timeout=60.0, max_restarts=2) == code
    assert sorted(attempts) == [(0, 0), (1, 0)]  # not restarted


def test_no_group_is_restarted_once_the_state_is_lost() -> None:
    attempts: list[int] = []

    def job(group: int, attempt: int) -> Job:
        attempts.append(attempt)
        return _one_rank("import sys; sys.exit(1)")

    code = run_groups(job, 1, 60.0, max_restarts=3, cannot_go_on=lambda: "the state is lost")
    assert code == 1
    assert attempts == [0]


def test_groups_that_cannot_average_together_stop_the_job_without_restarts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Group 1 fails once the lighthouse refused its gradients: it is not restarted, and
    group 0 (which would wait for it, then train alone) is stopped: the job fails now."""
    attempts: list[tuple[int, int]] = []

    def job(group: int, attempt: int) -> Job:
        attempts.append((group, attempt))
        return _one_rank(
            "import time; time.sleep(120)" if group == 0 else "import sys; sys.exit(4)"
        )

    wrong = "group 1 rank 0 averages 12 elements, but group 0 rank 0 averages 10"
    start = time.monotonic()
    code = run_groups(job, 2, 200.0, max_restarts=3, misconfigured=lambda: wrong)
    assert time.monotonic() - start < 60  # group 0 was stopped, not waited for
    assert code != 0
    assert sorted(attempts) == [(0, 0), (1, 0)]  # no restart
    err = capsys.readouterr().err
    assert f"no group is restarted and the others are stopped: {wrong}" in err, err


def test_a_group_srun_places_gets_no_rendezvous_address() -> None:
    """Outside an allocation each group's srun picks its nodes: no MPX_MASTER_ADDR (an
    enclosing job's is dropped), its ranks take their step's first node."""
    from mpx.launch.recovery.replica_groups import group_environment

    outer = {"MPX_MASTER_ADDR": "login1", "PATH": "/bin"}
    env = group_environment(outer, 1, 2, "10.0.0.1:5000", "ab" * 32, master="")
    assert "MPX_MASTER_ADDR" not in env
    assert (env["MPX_REPLICA_GROUP"], env["PATH"]) == ("1", "/bin")
    named = group_environment(outer, 1, 2, "10.0.0.1:5000", "ab" * 32, master="node3")
    assert named["MPX_MASTER_ADDR"] == "node3"
