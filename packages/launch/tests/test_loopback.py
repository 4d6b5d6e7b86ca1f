"""A job whose ranks all run on this host listens on loopback only."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mpx.launch.cli import _job_environment
from mpx.launch.launchers import Launcher

MPXRUN = os.path.join(os.path.dirname(sys.executable), "mpxrun")

# Each rank initialises MPI (its transports open their listening sockets),
# says so, and waits for the test to let it go.
PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    comm.Barrier()
    out = sys.argv[1]
    with open(os.path.join(out, f"ready.{comm.Get_rank()}"), "w") as fh:
        fh.write(str(os.getpid()))
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.05)
    comm.Barrier()
    """
)


def _listening_sockets() -> dict[int, str]:
    """inode -> address of every listening TCP socket of this network namespace."""
    found = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path) as fh:
            rows = fh.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            # The kernel prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found[int(fields[9])] = socket.inet_ntop(family, words)
    return found


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


@pytest.mark.parametrize(("nprocs", "bind"), [(2, "none"), (3, "none"), (2, "core")])
def test_a_single_host_job_listens_on_loopback_only(tmp_path: Path, nprocs: int, bind: str) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.Popen(
        [MPXRUN, "-n", str(nprocs), "--bind", bind, "--timeout", "120", str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 100
        while len(list(tmp_path.glob("ready.*"))) < nprocs and proc.poll() is None:
            assert time.monotonic() < deadline, "the ranks never got ready"
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        pids = _tree(proc.pid)
        ranks = {int(p.read_text()) for p in tmp_path.glob("ready.*")}
        assert ranks <= set(pids)  # the scan covers mpxrun, the launcher and every rank
        listening = _listening_sockets()
        # Every process of the job: mpxrun, the launcher (gforker opens no
        # port, where Hydra's control port listens on every interface), the
        # rank supervisors and the ranks with their MPI transports.
        exposed = sorted(
            (pid, listening[inode])
            for pid in pids
            for inode in _socket_inodes(pid)
            if inode in listening and not ipaddress.ip_address(listening[inode]).is_loopback
        )
        assert exposed == [], f"listening beyond loopback (pid, address): {exposed}"
    finally:
        (tmp_path / "go").touch()
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


def test_transports_are_pinned_to_loopback_only_for_single_host_jobs() -> None:
    mpich = Launcher("mpich", "mpiexec")
    assert mpich.environment(2, oversubscribed=False, local=True)["UCX_NET_DEVICES"] == "lo"
    assert mpich.environment(2, oversubscribed=False, local=True)["FI_TCP_IFACE"] == "lo"
    ompi = Launcher("openmpi", "mpirun").environment(2, oversubscribed=False, local=True)
    assert ompi["OMPI_MCA_btl_tcp_if_include"] == "lo"
    assert ompi["OMPI_MCA_oob_tcp_if_include"] == "lo"
    for launcher in (mpich, Launcher("openmpi", "mpirun")):
        remote = launcher.environment(2, oversubscribed=False, local=False)
        assert not {k for k, v in remote.items() if v == "lo"}, remote


def test_a_multi_node_job_keeps_the_users_interface(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1\nnode2\n")
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    monkeypatch.delenv("FI_TCP_IFACE", raising=False)
    env = _job_environment(Launcher("mpich", "mpiexec"), 4, str(hostfile), "none")
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert "FI_TCP_IFACE" not in env
    # And a user's choice wins on a single host too.
    env = _job_environment(Launcher("mpich", "mpiexec"), 2, None, "none")
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert env["FI_TCP_IFACE"] == "lo"


def test_gforker_starts_single_host_mpich_jobs() -> None:
    from mpx.launch import find_launcher

    launcher = find_launcher("mpich")
    local = launcher.on_this_host()
    assert local.forker
    assert Path(local.path).name == "mpiexec.gforker"
    assert local.on_this_host() is local
    gforker = Launcher("mpich", "mpiexec.gforker", forker=True)
    # gforker neither tags output whole nor binds: the rank supervisors do
    # (MPX_TAG_OUTPUT, MPX_BIND), and the output bypasses gforker.
    assert gforker.command(2, ["prog"], tag_output=True) == [gforker.path, "-n", "2", "prog"]
    assert gforker.command(2, ["prog"], bind="core") == [gforker.path, "-n", "2", "prog"]
    with pytest.raises(ValueError, match="--hostfile needs Hydra"):
        gforker.command(2, ["prog"], hostfile="hosts")
    assert Launcher("openmpi", "mpirun").on_this_host() == Launcher("openmpi", "mpirun")


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_output_that_is_not_ascii_arrives_whole(nprocs: int) -> None:
    """Under gforker, print("a – b") arrived as "a" and the rank died of a broken pipe."""
    text = "a – b × c é"
    done = subprocess.run(
        [
            MPXRUN,
            "-n",
            str(nprocs),
            "--timeout",
            "120",
            "--",
            sys.executable,
            "-c",
            f"print({text!r})",
        ],
        capture_output=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.decode().splitlines() == [text] * nprocs


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_tagged_output_and_errors_that_are_not_ascii_arrive_whole(
    nprocs: int, fresh_job_environment: Callable[..., dict[str, str]]
) -> None:
    program = (
        "import os, sys; r = os.environ['RANK']; print('é', r); print('✓', r, file=sys.stderr)"
    )
    mpxrun = [MPXRUN, "-n", str(nprocs), "--tag-output", "--timeout", "120", "--"]
    done = subprocess.run(
        [*mpxrun, sys.executable, "-c", program],
        env=fresh_job_environment(),  # RANK left by an earlier test would be kept as the user's
        capture_output=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert sorted(done.stdout.decode().splitlines()) == [f"[{r}] é {r}" for r in range(nprocs)]
    err = done.stderr.decode().splitlines()
    assert sorted(line for line in err if "✓" in line) == [f"[{r}] ✓ {r}" for r in range(nprocs)]
