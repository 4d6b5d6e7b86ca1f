"""Virtual nodes: network namespaces that MPI sees as separate hosts (root + iproute2 only)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpx.launch import cli
from mpx.launch.errors import LaunchEnvironmentError, UsageError
from mpx.launch.virtual_cluster import VirtualCluster

MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"


needs_netns = pytest.mark.skipif(
    not VirtualCluster.supported(), reason="needs root and iproute2 (network namespaces)"
)

PROGRAM = textwrap.dedent(
    """
    import os, socket
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    # This rank's own address: the source of a route to the first node (mpxrun's
    # MPX_MASTER_ADDR), which is the node's eth0 address (or the first node itself).
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((os.environ["MPX_MASTER_ADDR"], 9))
    rows = world.gather((world.Get_rank(), node.Get_size(), probe.getsockname()[0]))
    if world.Get_rank() == 0:
        for row in rows:
            print("rank %d node_size %d address %s" % row, flush=True)
    """
)


@needs_netns
def test_four_ranks_on_two_virtual_nodes(tmp_path: Path) -> None:
    script = tmp_path / "where.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [
            MPXRUN,
            "--virtual-nodes",
            "2",
            "-n",
            "4",
            "--timeout",
            "120",
            "--",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("rank")]
    assert len(rows) == 4
    assert all(row[3] == "2" for row in rows)  # two ranks share each node
    addresses = [row[5] for row in rows]
    # Ranks 0,1 on the first namespace, 2,3 on the second: two distinct addresses.
    assert addresses[0] == addresses[1] != addresses[2] == addresses[3]
    leftovers = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    assert f"mpx{os.getpid() % 100000:05d}" not in leftovers


@needs_netns
def test_every_virtual_node_gets_a_rank(tmp_path: Path) -> None:
    # 4 ranks on 3 nodes: 2, 1, 1 (2 a node, as Hydra fills nodes in turn, left one empty).
    script = tmp_path / "where.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [
            *(MPXRUN, "--virtual-nodes", "3", "-n", "4", "--timeout", "120"),
            *("--", sys.executable, str(script)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("rank")]
    assert [row[3] for row in rows] == ["2", "2", "1", "1"]
    assert len({row[5] for row in rows}) == 3


@needs_netns
def test_uneven_slots_per_node() -> None:
    with VirtualCluster(3) as cluster:
        with open(cluster.hostfile([2, 1, 1])) as f:
            assert f.read().split() == [
                f"{a}:{n}" for a, n in zip(cluster.addresses, [2, 1, 1], strict=True)
            ]
        with pytest.raises(UsageError, match="2 counts for 3 nodes"):
            cluster.hostfile([2, 2])


@needs_netns
def test_cluster_is_removed_on_exit() -> None:
    with VirtualCluster(2) as cluster:
        names = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=False
        ).stdout
        assert all(ns in names for ns in cluster.namespaces)
        assert "-launcher-exec" in cluster.mpich_arguments(2)
        with open(cluster.hostfile(2)) as f:
            assert f.read().split() == [f"{a}:2" for a in cluster.addresses]
    names = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    assert not any(ns in names for ns in cluster.namespaces)
    links = subprocess.run(["ip", "link"], capture_output=True, text=True, check=False).stdout
    assert cluster.bridge not in links


@needs_netns
def test_clusters_made_one_after_another_in_one_process() -> None:
    """A cluster right after another in the same process: the first one's veth ends may
    outlive its exit for a moment (the kernel removes a namespace in the background),
    and the same interface names again failed with "File exists"."""
    made = []
    for nodes in (3, 2, 2):
        with VirtualCluster(nodes) as cluster:
            made.append((cluster.bridge, cluster.subnet))
    assert len(set(made)) == 3, made
    assert all(len(bridge) <= 15 for bridge, _ in made)


def test_bad_node_counts_are_refused() -> None:
    with pytest.raises(UsageError, match="between 1 and 200"):
        VirtualCluster(0)


def test_without_root_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LaunchEnvironmentError, match="needs root"):
        VirtualCluster(2)


def test_virtual_nodes_with_a_hostfile_is_bad_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("a\nb\n")
    code = cli.main(["--virtual-nodes", "2", "--hostfile", str(hosts), "-n", "2", "true"])
    assert code == cli.EXIT_USAGE
    assert "exclude each other" in capsys.readouterr().err
