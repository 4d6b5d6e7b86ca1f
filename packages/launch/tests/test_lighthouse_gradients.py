"""The lighthouse's check that every group averages the same gradients: each hello
describes what its rank averages, and a rank whose description differs from the same
rank's in another group is refused with a reason (a malformed description, unanswered)."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from mpx.launch import JobKey, new_nonce
from mpx.launch.recovery import Lighthouse

PLAIN = {"numel": 10, "dtype": "torch.float32", "compression": None}
FOUR_BITS = {"bits": 4, "bucket_size": 512, "stochastic": True}


def _hello(
    lh: Lighthouse, group: int, rank: int, size: int, gradients: Any, key: JobKey | None = None
) -> tuple[socket.socket, Any, dict[str, Any] | None]:
    """A hello of ``group``'s ``rank`` describing ``gradients``, proven with ``key`` (default
    the job's): the connection, its file and the reply (None: closed unanswered)."""
    key = key if key is not None else lh.key
    host, port = lh.address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=20)
    file = conn.makefile("rwb")
    challenge = bytes.fromhex(json.loads(file.readline())["challenge"])
    mine = new_nonce()
    hello = {"op": "hello", "group": group, "rank": rank, "size": size, "incarnation": str(group),
             "address": ["h", 1 + rank], "gradients": gradients, "nonce": mine.hex(),
             "proof": key.prove("client", challenge, mine).hex()}  # fmt: skip
    file.write(json.dumps(hello).encode() + b"\n")
    file.flush()
    line = file.readline()
    if not line:
        return conn, file, None
    reply: dict[str, Any] = json.loads(line)
    assert key.verify("server", challenge, mine, bytes.fromhex(reply["proof"]))
    return conn, file, reply


@pytest.mark.parametrize(
    ("theirs", "named"),
    [
        ({**PLAIN, "numel": 12}, "12 trainable elements"),
        ({**PLAIN, "dtype": "torch.bfloat16"}, "dtype torch.bfloat16"),
        ({**PLAIN, "compression": FOUR_BITS}, "bits=4, bucket_size=512, stochastic=True"),
    ],
)
def test_a_group_whose_gradients_differ_is_refused_with_both_named(
    theirs: dict[str, Any], named: str
) -> None:
    """Group 1's hello differs from group 0's: answered with an error naming both
    descriptions, both groups and the fix; closed; logged; group 1 is no member, and
    mpxrun is told the job is misconfigured. Group 0 stays a member."""
    events: list[str] = []
    with Lighthouse(expected=2, heartbeat_timeout=60.0, log=events.append) as lh:
        conn0, file0, ok = _hello(lh, 0, 0, 1, PLAIN)
        assert ok is not None
        assert ok["ok"]
        assert lh.misconfigured() is None
        conn1, file1, refused = _hello(lh, 1, 0, 1, theirs)
        assert refused is not None
        assert "ok" not in refused
        why = refused["error"]
        assert named in why, why
        assert "10 trainable elements of dtype torch.float32" in why, why
        assert "group 1 rank 0" in why, why
        assert "group 0 rank 0" in why, why
        assert "same model and pass the same compression=" in why, why
        assert file1.readline() == b""  # closed after the answer
        assert sorted(lh.membership.groups) == [0]
        wrong = lh.misconfigured()
        assert wrong is not None
        assert "group 1's gradients differ from group 0's at rank 0" in wrong
        # Group 0 is still served.
        file0.write(b'{"op": "beat"}\n')
        file0.flush()
        assert json.loads(file0.readline())["member"] is True
        for c in (conn0, conn1):
            c.close()
    assert any("refused a connection" in e and why in e for e in events), events


def test_each_rank_is_compared_with_the_same_rank_of_the_other_groups() -> None:
    """A group's ranks may average different parts of a model: rank 1 differs from rank 0
    and that is no mismatch; group 1's rank 1 differing from group 0's rank 1 is."""
    rank1 = {**PLAIN, "numel": 30}
    with Lighthouse(expected=2, heartbeat_timeout=60.0) as lh:
        conns = []
        for group, rank, described in ((0, 0, PLAIN), (0, 1, rank1), (1, 0, PLAIN)):
            conn, _, reply = _hello(lh, group, rank, 2, described)
            assert reply is not None
            assert reply["ok"], (group, rank, reply)
            conns.append(conn)
        conn, _, reply = _hello(lh, 1, 1, 2, PLAIN)
        conns.append(conn)
        assert reply is not None
        assert "group 1 rank 1" in reply["error"], reply
        assert "group 0 rank 1 averages 30 trainable elements" in reply["error"], reply
        for c in conns:
            c.close()


@pytest.mark.parametrize(
    "gradients",
    [
        None,
        "10",
        [10, "torch.float32", None],
        {"numel": 10, "dtype": "torch.float32"},
        {**PLAIN, "extra": 1},
        {**PLAIN, "numel": -1},
        {**PLAIN, "numel": True},
        {**PLAIN, "numel": 1 << 70},
        {**PLAIN, "dtype": 32},
        {**PLAIN, "dtype": "x" * 33},
        {**PLAIN, "dtype": "float32; rm"},
        {**PLAIN, "compression": 4},
        {**PLAIN, "compression": {"bits": 4, "bucket_size": 512}},
        {**PLAIN, "compression": {**FOUR_BITS, "seed": 1}},
        {**PLAIN, "compression": {**FOUR_BITS, "bits": 0}},
        {**PLAIN, "compression": {**FOUR_BITS, "bucket_size": "512"}},
        {**PLAIN, "compression": {**FOUR_BITS, "stochastic": 1}},
    ],
)
def test_a_malformed_description_is_refused_unanswered(gradients: Any) -> None:
    """A proven hello whose gradients' description is not what a member sends is closed
    unanswered and logged, as any malformed hello; it sets no reference either."""
    events: list[str] = []
    with Lighthouse(expected=2, heartbeat_timeout=60.0, log=events.append) as lh:
        conn, _, reply = _hello(lh, 0, 0, 1, gradients)
        conn.close()
        assert reply is None
        assert lh.membership.groups == {}
        assert lh.misconfigured() is None
        conn, _, reply = _hello(lh, 1, 0, 1, PLAIN)  # the first well-formed one is kept
        conn.close()
        assert reply is not None
        assert reply["ok"], reply
    assert any("refused a connection" in e and "gradients" in e for e in events), events


def test_a_hello_without_the_jobs_key_is_refused_before_its_description_counts() -> None:
    """A stranger's hello sets no reference the members would then be compared with."""
    with Lighthouse(expected=2, heartbeat_timeout=60.0) as lh:
        conn, _, reply = _hello(lh, 0, 0, 1, {**PLAIN, "numel": 99}, key=JobKey.new())
        conn.close()
        assert reply is None
        conn, _, reply = _hello(lh, 1, 0, 1, PLAIN)
        conn.close()
        assert reply is not None
        assert reply["ok"], reply
