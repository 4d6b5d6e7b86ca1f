"""Proof that a connection comes from this job: a challenge-response on a per-job secret.

``mpxrun --replica-groups`` makes a secret and hands it to its ranks alone, in
their environment (``MPX_JOB_SECRET``; a process's environment is readable by
its own user and root only). Every connection to the lighthouse, and every link
between two replica groups, starts with both ends proving they hold it, without
sending it::

    server -> client   nonce_s                                   (16 random bytes)
    client -> server   nonce_c, HMAC-SHA256(key, "client" nonce_s nonce_c)
    server -> client   HMAC-SHA256(key, "server" nonce_s nonce_c)

Each proof covers both ends' fresh nonces and its own role, so a recorded one
proves nothing on another connection, and a server's proof cannot be sent back
as a client's. A peer that cannot prove it is refused before anything it says
is acted on. The wire format around the three messages is the caller's (JSON
lines to the lighthouse, frames between groups): this module holds the key and
the proofs.

Example::

    key = JobKey.new()                         # mpxrun; key.hex goes to the ranks
    key = JobKey.from_environment()            # a rank
    nonce_s, nonce_c = new_nonce(), new_nonce()
    proof = key.prove("client", nonce_s, nonce_c)
    assert key.verify("client", nonce_s, nonce_c, proof)
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from mpx.launch.errors import LaunchEnvironmentError
from mpx.launch.settings import JOB_SECRET

__all__ = ["NONCE_BYTES", "PROOF_BYTES", "JobKey", "from_hex", "new_nonce"]

NONCE_BYTES = 16
"""Bytes of a challenge: each end's fresh nonce."""
PROOF_BYTES = hashlib.sha256().digest_size
"""Bytes of a proof: an HMAC-SHA256 digest."""
_KEY_BYTES = 32
_ROLES = ("client", "server")


def from_hex(value: object, size: int) -> bytes | None:
    """``value`` (a nonce or proof as it travels in JSON) as ``size`` bytes, or None
    for anything else: the wire's words are checked before they are used."""
    if not isinstance(value, str) or len(value) != 2 * size:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def new_nonce() -> bytes:
    """A fresh random challenge (:data:`NONCE_BYTES` bytes)."""
    return secrets.token_bytes(NONCE_BYTES)


class JobKey:
    """A job's secret and the proofs made with it.

    Args:
        secret: the secret as 64 hex digits (what ``MPX_JOB_SECRET`` holds).

    Raises:
        LaunchEnvironmentError: ``secret`` is not 64 hex digits.
    """

    def __init__(self, secret: str) -> None:
        if not isinstance(secret, str) or not re.fullmatch(r"[0-9a-f]{64}", secret):
            raise LaunchEnvironmentError(
                f"{JOB_SECRET.name} must be 64 hex digits (mpxrun --replica-groups makes it "
                "for its ranks); got a value of another form (not shown: it is a secret)"
            )
        self._key = bytes.fromhex(secret)

    @classmethod
    def new(cls) -> JobKey:
        """A fresh random key (``mpxrun``, once a job)."""
        return cls(secrets.token_hex(_KEY_BYTES))

    @classmethod
    def from_environment(cls) -> JobKey:
        """This rank's job key (``MPX_JOB_SECRET``).

        Raises:
            LaunchEnvironmentError: it is not set (not started by ``mpxrun
                --replica-groups``) or malformed.
        """
        secret = JOB_SECRET.get()
        if not secret:
            raise LaunchEnvironmentError(
                f"{JOB_SECRET.name} is not set: live recovery's connections prove they belong "
                "to the job with the secret mpxrun --replica-groups hands its ranks; start "
                "the job with mpxrun --replica-groups R"
            )
        return cls(secret)

    @property
    def hex(self) -> str:
        """The secret as 64 hex digits, for the ranks' environment only."""
        return self._key.hex()

    def prove(self, role: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
        """The proof ``role`` (``"client"`` or ``"server"``) sends for these two nonces."""
        if role not in _ROLES:
            raise ValueError(f"role must be 'client' or 'server', got {role!r}")
        message = role.encode() + b"\0" + bytes(server_nonce) + bytes(client_nonce)
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def verify(self, role: str, server_nonce: bytes, client_nonce: bytes, proof: object) -> bool:
        """Whether ``proof`` is ``role``'s for these nonces (in constant time). Anything
        that is not bytes of the right length, or nonces of the wrong length, is False."""
        if not isinstance(proof, bytes | bytearray) or len(proof) != PROOF_BYTES:
            return False
        if len(server_nonce) != NONCE_BYTES or len(client_nonce) != NONCE_BYTES:
            return False
        return hmac.compare_digest(self.prove(role, server_nonce, client_nonce), bytes(proof))

    def __repr__(self) -> str:
        return "JobKey(<secret>)"
