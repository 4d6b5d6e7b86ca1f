"""Live recovery against another local user (issue 58): a process of ``nobody`` on the
host of a running ``mpxrun --replica-groups 2`` job tries what such a user could:

* read a rank's environment (``/proc/PID/environ``: the job's secret is there);
* map a rank's shared gradient segment (``/proc/PID/fd/FD``, as a peer group does);
* say hello to the lighthouse as group 0 with a new incarnation (it used to kill the
  real group 0 and spend one of its restarts), proving a guessed secret;
* link to group 0's peer port with a hello that proves nothing.

Each is refused; the job trains on and ends well, no group restarted. Needs root (to
start the other user's process) and a Python that user can run (the system's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

NOBODY = 65534

JOB = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from torch import nn
    import mpx.dataparallel as dp

    out = sys.argv[1]
    group = int(os.environ["MPX_REPLICA_GROUP"])
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    ft = dp.FaultTolerantOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    step = 0
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{out}/stop") and time.monotonic() < deadline:
        ft.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        ft.step()
        if step == 2:  # the segment is shared by now: say where everything is
            where = ft._grads.segment.describe() or {}
            info = {"pid": os.getpid(), "fd": where.get("fd", -1),
                    "lighthouse": os.environ["MPX_LIGHTHOUSE"],
                    "link": list(ft._links.address)}
            with open(f"{out}/who_{group}.json.tmp", "w") as f:
                json.dump(info, f)
            os.replace(f"{out}/who_{group}.json.tmp", f"{out}/who_{group}.json")
        step += 1
        time.sleep(0.01)
    print(f"group {group} done at step {ft.step_count}, restart {os.environ['MPX_RESTART_COUNT']}",
          flush=True)
    """
)

# Runs as nobody, standard library only.
ATTACK = textwrap.dedent(
    """
    import json, os, secrets, socket, struct, sys
    info, nonce_bytes = json.loads(sys.argv[1]), int(sys.argv[2])
    result = {}
    try:
        open(f"/proc/{info['pid']}/environ", "rb").read()
        result["environ"] = "read"
    except PermissionError:
        result["environ"] = "denied"
    try:
        os.close(os.open(f"/proc/{info['pid']}/fd/{info['fd']}", os.O_RDWR))
        result["shm"] = "opened"
    except PermissionError:
        result["shm"] = "denied"
    host, port = info["lighthouse"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as conn:
        f = conn.makefile("rwb")
        json.loads(f.readline())["challenge"]
        hello = {"op": "hello", "group": 0, "rank": 0, "size": 1, "incarnation": "other-user",
                 "address": ["127.0.0.1", 9], "nonce": secrets.token_hex(nonce_bytes),
                 "proof": secrets.token_hex(32)}
        f.write(json.dumps(hello).encode() + b"\\n")
        f.flush()
        result["lighthouse"] = "answered" if f.readline() else "closed"
    with socket.create_connection(tuple(info["link"]), timeout=20) as conn:
        frame = struct.Struct("!4sqiQ")
        conn.recv(frame.size + nonce_bytes, socket.MSG_WAITALL)
        body = json.dumps({"group": 1, "incarnation": "x", "nonce": "00" * nonce_bytes,
                           "proof": "00" * 32}).encode()
        conn.sendall(frame.pack(b"MPXF", 1, 1, len(body)) + body)
        result["link"] = "answered" if conn.recv(1) else "closed"
    print(json.dumps(result))
    """
)


def _python_for_nobody() -> str | None:
    """A Python outside root's home (nobody cannot enter /root)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")):
        if candidate and not candidate.startswith("/root") and os.access(candidate, os.X_OK):
            probe = subprocess.run(
                [candidate, "-c", "pass"],
                preexec_fn=_become_nobody,
                capture_output=True,
                timeout=30,
                check=False,
            )
            if probe.returncode == 0:
                return candidate
    return None


def _become_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start another user's process")
def test_another_local_user_cannot_join_read_or_kill_a_replica_group(tmp_path: Path) -> None:
    from mpx.launch import NONCE_BYTES

    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python that the user nobody can run (outside /root)")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    mpxrun = Path(sys.executable).parent / "mpxrun"
    env = {**os.environ, "MPX_FT_HEARTBEAT_TIMEOUT": "20"}
    job = subprocess.Popen(
        [
            *(str(mpxrun), "--replica-groups", "2", "-n", "1", "--max-restarts", "1"),
            *("--timeout", "200", "--", sys.executable, str(script), str(tmp_path)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "who_0.json").exists() and time.monotonic() < deadline:
            assert job.poll() is None, job.communicate()[0]
            time.sleep(0.1)
        info = json.loads((tmp_path / "who_0.json").read_text())
        assert info["fd"] >= 0, info  # the gradients are in a shared segment
        attack = subprocess.run(
            [python, "-c", ATTACK, json.dumps(info), str(NONCE_BYTES)],
            preexec_fn=_become_nobody,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert attack.returncode == 0, attack.stderr
        result = json.loads(attack.stdout)
        assert result == {
            "environ": "denied",
            "shm": "denied",
            "lighthouse": "closed",
            "link": "closed",
        }, result
    finally:
        (tmp_path / "stop").touch()
        out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert "lighthouse: refused a connection from" in out, out
    assert "group 0 refused a link from" in out, out
    assert "group 0 done at step" in out, out
    assert "group 1 done at step" in out, out
    assert "restart 1" not in out, out  # group 0 was not killed by the impostor
