"""Several "nodes" on one machine: network namespaces joined by a bridge.

For testing what crosses a network without a cluster. Each virtual node is a
Linux network namespace with its own address; a bridge in the caller's
namespace joins their veth pairs; MPICH's Hydra starts its proxies inside
them through a stand-in for ``ssh`` that runs ``ip netns exec``::

    root namespace                      namespace mpx<id>n1    namespace mpx<id>n2
    mpxrun -> mpiexec (-iface bridge)   hydra proxy -> ranks   hydra proxy -> ranks
          bridge 10.X.Y.254 ─────veth── eth0 10.X.Y.1          eth0 10.X.Y.2 ──┐
                  └──────────────────────────────────────────────veth──────────┘

MPI sees one node per namespace (ranks of one namespace share memory, ranks of
different ones talk TCP over the veth links), which is how
``mpxrun --virtual-nodes 2 -n 4`` tests the hierarchical collectives. Needs
root (CAP_NET_ADMIN) and iproute2's ``ip``; everything is removed on exit.
On a real cluster, the same job is ``mpxrun --hostfile hosts -n 4``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from types import TracebackType

from mpx.launch.errors import LaunchEnvironmentError, UsageError

__all__ = ["MAX_NODES", "VirtualCluster"]

# The nodes take addresses .1 to .MAX_NODES of one /24 subnet (the bridge has .254).
MAX_NODES = 200
_SERIALS = itertools.count()  # the clusters this process made


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise LaunchEnvironmentError(
            f"'ip {' '.join(args)}' failed: {result.stderr.strip()} (virtual nodes need root "
            "and iproute2; run on a real cluster with --hostfile instead)"
        )


class VirtualCluster:
    """``nodes`` network namespaces on a private bridge; a context manager.

    Example::

        with VirtualCluster(2) as cluster:
            args = cluster.mpich_arguments(ranks_per_node=2)   # for mpiexec
            subprocess.run(["mpiexec", *args, "-n", "4", "python", "job.py"])
    """

    def __init__(self, nodes: int) -> None:
        if nodes < 1 or nodes > MAX_NODES:
            raise UsageError(f"--virtual-nodes must be between 1 and {MAX_NODES}, got {nodes}")
        if shutil.which("ip") is None:
            raise LaunchEnvironmentError(
                "--virtual-nodes needs iproute2's 'ip' command (apt install iproute2)"
            )
        if os.geteuid() != 0:
            raise LaunchEnvironmentError(
                "--virtual-nodes needs root (network namespaces); use --hostfile on a cluster"
            )
        self.nodes = nodes
        # Interface names are at most 15 characters ("mpx" + id + "v200"): an id of 8.
        # The pid tells processes apart, the serial one process's clusters: the
        # kernel removes a deleted namespace's veth in the background, so the same
        # names again right after close() failed ("RTNETLINK answers: File exists").
        serial = next(_SERIALS)
        self.id = f"{os.getpid() % 100000:05d}{serial % 1000:03d}"
        third = (os.getpid() + serial) % 250
        self.subnet = f"10.213.{third}"
        self.bridge = f"mpx{self.id}br"
        self.namespaces = [f"mpx{self.id}n{i + 1}" for i in range(nodes)]
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(nodes)]
        self._created: list[str] = []
        self._dir = tempfile.mkdtemp(prefix="mpx-vcluster-")
        self.shim = os.path.join(self._dir, "netns-ssh")

    @staticmethod
    def supported() -> bool:
        """Whether this machine lets us make network namespaces (root, iproute2)."""
        if shutil.which("ip") is None or os.geteuid() != 0:
            return False
        name = f"mpxprobe{os.getpid()}"
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        return made.returncode == 0

    def __enter__(self) -> VirtualCluster:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(self.bridge)
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            _ip("netns", "add", ns)
            self._created.append(ns)
            veth = f"mpx{self.id}v{i + 1}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        cases = "\n".join(
            f"  {address}) ns={ns} ;;"
            for ns, address in zip(self.namespaces, self.addresses, strict=True)
        )
        # Hydra calls "<launcher-exec> [options] host command...".
        with open(self.shim, "w") as f:
            f.write(
                "#!/bin/sh\n"
                "# ssh stand-in: run the command inside the host's network namespace\n"
                'while [ "${1#-}" != "$1" ]; do shift; done\n'
                'host="$1"; shift\n'
                'case "$host" in\n'
                f"{cases}\n"
                '  *) echo "netns-ssh: unknown host $host" >&2; exit 255 ;;\n'
                "esac\n"
                'exec ip netns exec "$ns" sh -c "$*"\n'
            )
        os.chmod(self.shim, stat.S_IRWXU)

    def hostfile(
        self, ranks_per_node: int | Sequence[int], nodes: Sequence[int] | None = None
    ) -> str:
        """A hostfile (``address:slots`` per line) of the virtual nodes, as on a cluster.

        ``ranks_per_node``: the slots of every node, or of each node in turn;
        ``nodes``: the indices of the nodes it names (default all: a replica group
        runs on some of them, see :mod:`mpx.launch.recovery.placement`).
        """
        chosen = list(range(self.nodes)) if nodes is None else list(nodes)
        if not chosen or any(not 0 <= node < self.nodes for node in chosen):
            raise UsageError(f"nodes={chosen} are not nodes of this {self.nodes}-node cluster")
        if isinstance(ranks_per_node, int):
            ranks_per_node = [ranks_per_node] * len(chosen)
        if len(ranks_per_node) != len(chosen):
            raise UsageError(
                f"ranks_per_node gives {len(ranks_per_node)} counts for {len(chosen)} nodes: "
                "pass one count per node, or one int for all"
            )
        suffix = "" if nodes is None else "-" + "-".join(map(str, chosen))
        path = os.path.join(self._dir, f"hosts{suffix}")
        with open(path, "w") as f:
            f.writelines(
                f"{self.addresses[node]}:{slots}\n"
                for node, slots in zip(chosen, ranks_per_node, strict=True)
            )
        return path

    def mpich_arguments(
        self, ranks_per_node: int | Sequence[int], nodes: Sequence[int] | None = None
    ) -> list[str]:
        """Hydra options that place ``ranks_per_node`` ranks on each virtual node
        (of ``nodes``, default all).

        Hydra fills the nodes in turn: with a list (``[2, 1, 1]`` for 4 ranks
        on 3 nodes) every node gets a rank, where ``2`` each would leave the
        last one empty.
        """
        return [
            "-launcher",
            "ssh",
            "-launcher-exec",
            self.shim,
            "-iface",
            self.bridge,
            "-f",
            self.hostfile(ranks_per_node, nodes),
        ]

    @property
    def bridge_address(self) -> str:
        """This (the root) namespace's address on the bridge: every node reaches it."""
        return f"{self.subnet}.254"

    def close(self) -> None:
        """Removes the namespaces (their veth ends go with them) and the bridge."""
        for name in reversed(self._created):
            if name == self.bridge:
                subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._created.clear()
        shutil.rmtree(self._dir, ignore_errors=True)
