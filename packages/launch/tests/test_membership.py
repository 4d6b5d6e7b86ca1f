"""The lighthouse's membership and commit rules (mpx.launch.recovery.membership), and its wire."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import pytest

from mpx.launch import NONCE_BYTES, JobKey, new_nonce
from mpx.launch.recovery import Lighthouse, Membership, Quorum
from mpx.launch.recovery.lighthouse import MAX_LINE
from mpx.launch.recovery.membership import BEAT_SLACK, STEP_SLACK


def _two(expected: int = 2) -> Membership:
    m = Membership(expected=expected, join_timeout=30.0, heartbeat_timeout=0.5, now=0.0)
    m.hello(0, 0, 1, "a", ["h", 1], now=0.0)
    m.hello(1, 0, 1, "b", ["h", 2], now=0.0)
    return m


def _first_quorum(step: int = 0) -> tuple[Membership, Quorum]:
    """Both groups of _two() ask at `step` and get their first quorum, not yet voted on."""
    m = _two()
    m.request(0, "a", step)
    m.request(1, "b", step)
    q = m.form(now=0.0)
    assert q is not None
    return m, q


def test_first_quorum_waits_for_every_group_and_syncs_from_the_lowest() -> None:
    m = _two()
    m.request(1, "b", 0)
    assert m.form(now=1.0) is None  # group 0 has not asked
    m.request(0, "a", 0)
    q = m.form(now=1.0)
    assert q is not None
    # At the first quorum every group is a member: the one behind loads, then trains.
    assert (q.id, q.step, q.members, q.joining, q.donors) == (1, 0, [0, 1], [], {1: 0})


def test_first_quorum_forms_without_a_missing_group_after_join_timeout() -> None:
    m = _two()
    m.request(0, "a", 0)
    assert m.form(now=29.0) is None
    q = m.form(now=31.0)
    assert q is not None
    assert q.members == [0]


def test_commit_needs_every_members_vote() -> None:
    m, q = _first_quorum()
    assert m.vote(0, "a", q.id, True) is None
    assert m.vote(1, "b", q.id, True) is True
    assert m.outcome(q.id) is True


def test_one_no_vote_aborts_at_once() -> None:
    m, q = _first_quorum()
    assert m.vote(1, "b", q.id, False) is False
    assert m.vote(0, "a", q.id, True) is False  # an ok after the abort changes nothing
    assert m.last_aborted == q.id


def test_death_before_voting_aborts_and_the_survivor_goes_on_alone() -> None:
    m, q = _first_quorum()
    m.vote(0, "a", q.id, True)
    m.lost(1, "b")  # its connection closed
    assert q.outcome is False
    assert m.alive() == {0: "a"}
    m.request(0, "a", 0)
    q2 = m.form(now=0.1)
    assert q2 is not None
    assert (q2.members, q2.step) == ([0], 0)


def test_death_after_voting_ok_keeps_the_commit() -> None:
    m, q = _first_quorum(step=3)
    m.vote(1, "b", q.id, True)
    m.lost(1, "b")
    assert m.vote(0, "a", q.id, True) is True


def test_silent_group_is_counted_out_and_comes_back_when_it_beats_again() -> None:
    """Silent past its deadline: out of the quorums, not dead; its next beat brings it
    back, and it is admitted at the next boundary with a donor, as a restart would be."""
    m, q = _first_quorum()
    m.vote(0, "a", q.id, True)
    m.beat(0, 0, "a", now=0.4)
    assert m.expire(now=0.6) == [1]  # group 1's last beat was at 0.0
    assert q.outcome is False  # it had not voted: the step is discarded
    assert m.alive() == {0: "a"}
    assert m.counted_out(1, "b")
    assert m.request(1, "b", 0) is False  # not a member while counted out
    m.request(0, "a", 0)
    q2 = m.form(now=0.6)
    assert q2 is not None
    assert q2.members == [0]
    m.vote(0, "a", q2.id, True)
    assert m.beat(1, 0, "b", now=0.7) is True  # alive again, same incarnation
    assert m.alive() == {0: "a", 1: "b"}
    assert not m.counted_out(1, "b")
    m.request(1, "b", 0)
    m.request(0, "a", 1)
    q3 = m.form(now=0.8)
    assert q3 is not None
    assert (q3.step, q3.members, q3.joining, q3.donors) == (1, [0], [1], {1: 0})


def test_the_deadline_stretches_with_the_groups_own_beats_and_steps() -> None:
    """A loaded machine spreads a live group's beats: its deadline grows with them
    (BEAT_SLACK gaps), and with its steps (STEP_SLACK), never past the hang timeout."""
    m = Membership(expected=1, join_timeout=30.0, heartbeat_timeout=0.5, now=0.0, hang_timeout=20.0)
    m.hello(0, 0, 1, "a", ["h", 1], now=0.0)
    assert m.deadline(0) == 0.5
    for t in (0.1, 0.2, 0.3, 1.3):  # one beat a second late
        m.beat(0, 0, "a", now=t)
    assert m.deadline(0) == pytest.approx(BEAT_SLACK * 1.0)
    assert m.expire(now=1.3 + BEAT_SLACK * 1.0 - 0.1) == []
    assert m.expire(now=1.3 + BEAT_SLACK * 1.0 + 0.1) == [0]
    m2 = Membership(expected=1, join_timeout=30.0, heartbeat_timeout=0.5, now=0.0)
    m2.hello(0, 0, 1, "a", ["h", 1], now=0.0)
    m2.request(0, "a", 0, now=0.0)
    m2.request(0, "a", 1, now=3.0)  # a 3 s step
    assert m2.deadline(0) == pytest.approx(STEP_SLACK * 3.0)
    m3 = Membership(expected=1, join_timeout=30.0, heartbeat_timeout=0.5, now=0.0, hang_timeout=2.0)
    m3.hello(0, 0, 1, "a", ["h", 1], now=0.0)
    m3.request(0, "a", 0, now=0.0)
    m3.request(0, "a", 1, now=3.0)
    assert m3.deadline(0) == 2.0  # capped: a counted-out group must still be seen hung


def test_a_counted_out_group_silent_for_the_hang_timeout_is_hung() -> None:
    m = Membership(expected=2, join_timeout=30.0, heartbeat_timeout=0.5, now=0.0, hang_timeout=5.0)
    m.hello(0, 0, 1, "a", ["h", 1], now=0.0)
    m.hello(1, 0, 1, "b", ["h", 2], now=0.0)
    assert m.expire(now=1.0) == [0, 1]
    assert m.beat(0, 0, "a", now=1.2) is True  # group 0 is back
    assert m.hung(now=4.0) == []
    assert m.hung(now=5.5) == [1]  # group 1 silent since 0.0
    assert m.hung(now=6.0) == []  # once
    assert m.beat(1, 0, "b", now=6.0) is False  # hung is dead: mpxrun restarts it
    assert m.alive() == {0: "a"}


def _committed_then_all_gone(steps: int) -> Membership:
    """Two groups commit steps 0..steps-1 together, then both die."""
    m = _two()
    for step in range(steps):
        m.request(0, "a", step)
        m.request(1, "b", step)
        q = m.form(now=0.0)
        assert q is not None
        m.vote(0, "a", q.id, True)
        m.vote(1, "b", q.id, True)
    m.lost(0, "a")
    m.lost(1, "b")
    return m


def test_a_job_never_goes_back_to_fresh_weights() -> None:
    """Every group that held the state is gone; both restart at step 0 (no checkpoint):
    no quorum forms, the state is lost, each request is told so."""
    m = _committed_then_all_gone(5)
    assert m.committed == 5
    m.hello(0, 0, 1, "a2", ["h", 3], now=1.0)
    m.request(0, "a2", 0)
    assert m.form(now=1.0) is None  # it waits for the other group: it may have a checkpoint
    assert m.state_lost is None
    m.hello(1, 0, 1, "b2", ["h", 4], now=1.0)
    m.request(1, "b2", 0)
    assert m.form(now=1.1) is None
    assert m.state_lost == 5


def test_the_state_lost_is_decided_after_join_timeout_when_a_group_never_comes_back() -> None:
    m = _committed_then_all_gone(3)
    m.hello(0, 0, 1, "a2", ["h", 3], now=1.0)
    m.request(0, "a2", 0)
    assert m.form(now=1.0) is None
    assert m.form(now=30.0) is None
    assert m.state_lost is None
    assert m.form(now=31.5) is None
    assert m.state_lost == 3


def test_a_group_resumed_from_a_checkpoint_leads_when_no_one_holds_the_state() -> None:
    """Group 1 restarted from its checkpoint of step 3, group 0 from nothing: they go on
    from step 3, group 0 loading group 1's state; steps 3 and 4 are done again."""
    m = _committed_then_all_gone(5)
    m.hello(0, 0, 1, "a2", ["h", 3], now=1.0)
    m.hello(1, 0, 1, "b2", ["h", 4], now=1.0)
    m.request(0, "a2", 0)
    m.request(1, "b2", 3)
    q = m.form(now=1.0)
    assert q is not None
    assert (q.step, q.members, q.joining, q.donors) == (3, [1], [0], {0: 1})
    assert m.went_back == (3, 5)
    assert m.state_lost is None
    m.vote(0, "a2", q.id, True)
    m.vote(1, "b2", q.id, True)
    assert m.committed == 4


def test_no_state_is_lost_while_a_counted_out_group_may_come_back_with_it() -> None:
    m, q = _first_quorum(step=4)
    m.vote(0, "a", q.id, True)
    m.vote(1, "b", q.id, True)  # committed: the state is step 5's
    m.expire(now=0.6)  # both silent: counted out, both may come back
    m.hello(0, 0, 1, "a2", ["h", 3], now=0.7)  # group 0 restarted, from nothing
    m.request(0, "a2", 0)
    assert m.form(now=0.7) is None
    assert m.state_lost is None
    assert m.beat(1, 0, "b", now=0.8) is True  # group 1 was only slow
    m.request(1, "b", 5)
    q2 = m.form(now=0.8)
    assert q2 is not None
    assert (q2.step, q2.members, q2.joining, q2.donors) == (5, [1], [0], {0: 1})


def _group_1_restarted_and_asking() -> Membership:
    """Group 1 died in the first step; group 0 committed step 0 alone; group 1's restart
    (incarnation "b2") asks at step 0 while group 0 is in its step 1."""
    m, _ = _first_quorum()
    m.lost(1, "b")
    m.request(0, "a", 0)
    q2 = m.form(now=0.0)
    assert q2 is not None
    m.vote(0, "a", q2.id, True)
    m.hello(1, 0, 1, "b2", ["h", 3], now=1.0)  # the restart, a new incarnation
    m.request(1, "b2", 0)
    return m


def test_restarted_group_is_admitted_at_a_boundary_with_a_donor() -> None:
    m = _group_1_restarted_and_asking()
    assert m.form(now=1.0) is None  # group 0 is mid-step: no admission before it asks
    m.request(0, "a", 1)
    q3 = m.form(now=1.0)
    assert q3 is not None
    # It joins the step: group 0 trains it, group 1 receives it (see the module's rules).
    assert (q3.step, q3.members, q3.joining, q3.donors) == (1, [0], [1], {1: 0})
    assert q3.view(0)["recipients"] == [1]
    assert q3.view(1)["joining"] == [1]
    assert q3.addresses[1] == [["h", 3]]
    assert q3.incarnations[1] == "b2"


def test_a_joining_groups_vote_and_death_decide_nothing_for_the_members() -> None:
    """A group that joins a step is not waited for, its not-ok vote aborts nothing, its
    death aborts nothing; the next quorum waits for it to ask, and takes it in as a
    member if it asks at the next step (it had its part of the step)."""
    m = _group_1_restarted_and_asking()
    m.request(0, "a", 1)
    q3 = m.form(now=1.0)
    assert q3 is not None
    assert q3.joining == [1]
    assert m.vote(1, "b2", q3.id, False) is None  # its own miss: undecided still
    assert m.vote(0, "a", q3.id, True) is True  # the members alone decide
    m.request(0, "a", 2)
    assert m.form(now=1.1) is None  # the joining group has not asked yet
    m.request(1, "b2", 2)
    q4 = m.form(now=1.1)
    assert q4 is not None
    assert (q4.step, q4.members, q4.joining) == (2, [0, 1], [])
    # A joining group's death does not abort the step it joins.
    m.vote(0, "a", q4.id, True)
    m.vote(1, "b2", q4.id, True)
    m.lost(1, "b2")
    m.hello(1, 0, 1, "b3", ["h", 5], now=1.3)
    m.request(1, "b3", 0)
    m.request(0, "a", 3)
    q5 = m.form(now=1.3)
    assert q5 is not None
    assert (q5.members, q5.joining) == ([0], [1])
    m.lost(1, "b3")
    assert q5.outcome is None
    assert m.vote(0, "a", q5.id, True) is True


def test_old_incarnation_cannot_vote_or_ask() -> None:
    m = _two()
    m.hello(1, 0, 1, "b2", ["h", 3], now=0.0)  # restarted before its death was seen
    assert m.alive() == {0: "a", 1: "b2"}
    assert m.request(1, "b", 0) is False
    m.request(0, "a", 0)
    m.request(1, "b2", 0)
    q = m.form(now=0.0)
    assert q is not None
    assert m.vote(1, "b", q.id, True) is False


def test_a_group_back_after_the_others_left_is_told_so() -> None:
    m, _ = _first_quorum()
    m.lost(1, "b")
    m.leave(0, "a", 20)
    m.hello(1, 0, 1, "b2", ["h", 3], now=1.0)
    assert m.finished(1, 0) == 20
    assert m.finished(1, 20) is None


def _ask(file: Any, message: dict[str, Any]) -> dict[str, Any]:
    file.write(json.dumps(message).encode() + b"\n")
    file.flush()
    reply: dict[str, Any] = json.loads(file.readline())
    return reply


def _connect(lh: Lighthouse) -> tuple[socket.socket, Any, bytes]:
    """A connection to ``lh`` and the challenge it opened with."""
    host, port = lh.address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=20)
    file = conn.makefile("rwb")
    challenge = bytes.fromhex(json.loads(file.readline())["challenge"])
    assert len(challenge) == NONCE_BYTES
    return conn, file, challenge


def _hello(file: Any, challenge: bytes, key: JobKey, group: int, **fields: Any) -> dict[str, Any]:
    """A hello proven with ``key``; the lighthouse's reply."""
    mine = new_nonce()
    hello = {"op": "hello", "group": group, "rank": 0, "size": 1, "incarnation": str(group)}
    hello["gradients"] = {"numel": 4, "dtype": "torch.float32", "compression": None}
    hello |= {"address": ["h", group + 1], "nonce": mine.hex()}
    hello |= {"proof": key.prove("client", challenge, mine).hex(), **fields}
    reply = _ask(file, hello)
    assert key.verify("server", challenge, mine, bytes.fromhex(reply["proof"]))
    return reply


def _said_hello(lh: Lighthouse, groups: int) -> tuple[list[socket.socket], list[Any]]:
    """Connections of ``groups`` groups of one rank each, their hellos answered."""
    conns, files = [], []
    for g in range(groups):
        conn, file, challenge = _connect(lh)
        assert _hello(file, challenge, lh.key, g)["ok"]
        conns.append(conn)
        files.append(file)
    return conns, files


def test_lighthouse_sees_a_closed_connection_at_once() -> None:
    """Over TCP: two groups commit a step; one's socket closes; the other's vote
    on the next quorum is answered, alone, without waiting for a heartbeat timeout."""
    with Lighthouse(expected=2, heartbeat_timeout=60.0) as lh:
        conns, files = _said_hello(lh, 2)
        replies: list[dict[str, Any]] = [{}, {}]

        def quorum(g: int) -> None:
            replies[g] = _ask(files[g], {"op": "quorum", "step": 0})

        threads = [threading.Thread(target=quorum, args=(g,)) for g in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert [r["quorum"]["members"] for r in replies] == [[0, 1], [0, 1]]
        files[1].close()  # group 1 dies before voting (the file holds the socket too)
        conns[1].close()
        assert _ask(files[0], {"op": "vote", "quorum": 1, "ok": True}) == {"outcome": False}
        beat = _ask(files[0], {"op": "beat"})
        assert beat["alive"] == {"0": "0"}
        assert beat["last_aborted"] == 1
        again = _ask(files[0], {"op": "quorum", "step": 0})
        assert again["quorum"]["members"] == [0]
        files[0].close()
        conns[0].close()


def _refused(lh: Lighthouse, send: bytes) -> None:
    """``send`` on a fresh connection ends it unanswered, and no group joins."""
    conn, file, _ = _connect(lh)
    with conn:
        conn.sendall(send)
        assert file.readline() == b""  # closed, nothing said
    assert lh.membership.groups == {}


@pytest.mark.parametrize("op", ["beat", "quorum"])
def test_lighthouse_refuses_requests_before_hello(op: str) -> None:
    events: list[str] = []
    with Lighthouse(expected=1, log=events.append) as lh:
        _refused(lh, json.dumps({"op": op, "step": 0}).encode() + b"\n")
    assert any(f"{op!r} before hello" in e and "refused" in e for e in events), events


def test_lighthouse_refuses_what_no_member_of_the_job_sends() -> None:
    """Issue 58's attacks by a local process without the job's secret: a hello without
    a proof, with another key's proof, or as a group beyond R (even proven); a line
    longer than MAX_LINE; a line that is not a JSON object. Each connection is closed
    unanswered and logged; the membership is untouched and a real member still joins."""
    events: list[str] = []
    with Lighthouse(expected=2, heartbeat_timeout=60.0, log=events.append) as lh:
        hello = {"op": "hello", "group": 0, "rank": 0, "size": 1, "incarnation": "x",
                 "address": ["h", 1]}  # fmt: skip
        _refused(lh, json.dumps(hello).encode() + b"\n")
        _refused(lh, b"[1, 2]\n")
        _refused(lh, b"7\n")
        _refused(lh, b"{not json\n")
        _refused(lh, b"x" * (MAX_LINE + 10))
        for group, key in ((0, JobKey.new()), (9, lh.key), (-1, lh.key), (True, lh.key)):
            conn, file, challenge = _connect(lh)
            with conn:
                mine = new_nonce()
                proof = key.prove("client", challenge, mine).hex()
                file.write(json.dumps({**hello, "group": group, "nonce": mine.hex(),
                                       "proof": proof}).encode() + b"\n")  # fmt: skip
                file.flush()
                assert file.readline() == b""
            assert lh.membership.groups == {}
        # A proof replayed from another connection proves nothing on this one.
        conn, file, challenge = _connect(lh)
        mine = new_nonce()
        replayed = {
            **hello,
            "nonce": mine.hex(),
            "proof": lh.key.prove("client", challenge, mine).hex(),
        }
        conn.close()
        _refused(lh, json.dumps(replayed).encode() + b"\n")
        conns, _ = _said_hello(lh, 2)  # the real members still join
        assert sorted(lh.membership.groups) == [0, 1]
        for c in conns:
            c.close()
    refusals = [e for e in events if "refused a connection" in e]
    assert len(refusals) == 10, events
    assert any("no proof of the job's secret" in e for e in refusals)
    assert any("group=9" in e for e in refusals)
    assert any(f"more than {MAX_LINE} bytes" in e for e in refusals)


def test_a_vote_with_next_brings_the_next_quorum_at_the_step_the_voter_gives() -> None:
    """Over TCP: a vote with "next": s also asks for the next quorum at step s (+ 1 if the
    step committed), answered with the outcome once every member voted: one round trip a
    step. A group whose join failed gives its old step, so the next quorum has it load
    a donor's state rather than count it at the live step."""
    with Lighthouse(expected=2, heartbeat_timeout=60.0) as lh:
        conns, files = _said_hello(lh, 2)
        replies: list[dict[str, Any]] = [{}, {}]

        def both(messages: list[dict[str, Any]]) -> None:
            def one(g: int) -> None:
                replies[g] = _ask(files[g], messages[g])

            threads = [threading.Thread(target=one, args=(g,)) for g in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=20)

        both([{"op": "quorum", "step": 5}, {"op": "quorum", "step": 5}])
        assert [r["quorum"]["quorum"] for r in replies] == [1, 1]
        both([{"op": "vote", "quorum": 1, "ok": ok, "next": 5} for ok in (True, True)])
        assert [r["outcome"] for r in replies] == [True, True]
        assert [(r["quorum"]["quorum"], r["quorum"]["step"]) for r in replies] == [(2, 6)] * 2
        assert [r["quorum"]["donor"] for r in replies] == [None, None]
        # Group 1's join failed at quorum 2: it is still at step 2 and votes no.
        both(
            [{"op": "vote", "quorum": 2, "ok": ok, "next": s} for ok, s in ((True, 6), (False, 2))]
        )
        assert [r["outcome"] for r in replies] == [False, False]
        assert [(r["quorum"]["quorum"], r["quorum"]["step"]) for r in replies] == [(3, 6)] * 2
        assert [r["quorum"]["donor"] for r in replies] == [None, 0]
        # Without "next" a vote's reply is the outcome alone.
        both([{"op": "vote", "quorum": 3, "ok": True} for _ in range(2)])
        assert replies == [{"outcome": True}, {"outcome": True}]
        for f, c in zip(files, conns, strict=True):
            f.close()
            c.close()


def test_a_group_is_listed_alive_once_every_rank_said_hello() -> None:
    m = Membership(expected=1, join_timeout=30.0, heartbeat_timeout=0.5, now=0.0)
    m.hello(0, 0, 2, "a", ["h", 1], now=0.0)
    assert m.alive() == {}  # rank 1 still starting: a peer waiting for group 0 waits on
    m.hello(0, 1, 2, "a", ["h", 2], now=0.1)
    assert m.alive() == {0: "a"}


@pytest.mark.parametrize("dies", [False, True])
def test_waiting_voters_get_the_next_quorum_from_the_deciding_vote_or_a_death(dies: bool) -> None:
    """Over TCP, three groups: groups 0 and 1 vote with "next" and wait; the step is
    decided by group 2's vote (the deciding thread asks for the waiting voters too) or
    by group 2's death (the first waiting thread to wake asks for both). Either way both
    waiting voters get the same next quorum, and the lighthouse keeps nothing of it."""
    with Lighthouse(expected=3, heartbeat_timeout=60.0) as lh:
        conns, files = _said_hello(lh, 3)
        replies: list[dict[str, Any]] = [{}, {}, {}]

        def one(g: int, message: dict[str, Any]) -> None:
            replies[g] = _ask(files[g], message)

        threads = [
            threading.Thread(target=one, args=(g, {"op": "quorum", "step": 4})) for g in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert [r["quorum"]["quorum"] for r in replies] == [1, 1, 1]
        vote = {"op": "vote", "quorum": 1, "ok": True, "next": 4}
        waiting = [threading.Thread(target=one, args=(g, vote)) for g in (0, 1)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 20
        while len(lh._then.get(1, {})) < 2:  # both wait on their votes
            assert time.monotonic() < deadline, "the votes never arrived"
            time.sleep(0.01)
        if dies:
            files[2].close()
            conns[2].close()
        else:
            one(2, vote)
        for t in waiting:
            t.join(timeout=20)
        members, step = ([0, 1], 4) if dies else ([0, 1, 2], 5)
        for g in (0, 1) if dies else (0, 1, 2):
            assert replies[g]["outcome"] is not dies
            assert (replies[g]["quorum"]["quorum"], replies[g]["quorum"]["step"]) == (2, step)
            assert replies[g]["quorum"]["members"] == members
        assert lh._then == {}
        for f, c in zip(files, conns, strict=True):
            f.close()
            c.close()
