"""Replicas prove who they are: an HMAC over every forwarded request, and a proof of
the secret before a replica is sent anything.

* **Forwards are signed.** The forwarder's ``x-upshift-forwarded`` header carries
  ``replica;<hop>;<unix time>;<nonce>;<signature>``, the signature an HMAC-SHA256, with the
  shared secret, over the method, the path (query included), the time, the nonce, the hop id
  and the SHA-256 of the body. An owner holding a secret serves a marked request only when
  the signature holds under one of its secrets, the time is within :data:`MAX_SKEW_SECONDS`
  of its clock and the nonce was not seen before (a replay); otherwise it refuses it (403)
  and counts it (``upshift_forwards_received_total{verified="false"}``).
* **Owners are proven before they are sent a byte of an app's request.** Forwards carry the
  app's key, so a process that only claims to be a replica (a Pod that took the gateway's
  label) must never receive one: before its first forward, and every
  :data:`PROOF_SECONDS`, a replica asks a peer to prove it holds the secret (``GET``
  :data:`PROOF_PATH` ``?asker=<its own URL>&prover=<the peer's URL>&challenge=<fresh nonce>``);
  a peer that cannot is skipped like one that is down. The question is signed as a forward is
  (the marker: in time, once), so a process without the secret is answered nothing (the proof
  is no signing oracle); the answer is an HMAC over both names and the nonce, and a replica
  answers only a question naming *itself* as the prover (its ``self_url``, or the address the
  question reached it at). So a process in the peer set without the secret cannot pass a
  replica's question on to an honest replica (or back to the asker) and return its answer:
  that one names another prover, and the one it would name is the rogue's.
* **Rotation without downtime.** ``cluster.secret_file`` holds one secret per line: the first
  signs and proves, every one (at most two) verifies. Roll out the new secret as the second
  line, then swap the lines, then drop the old one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from cachetools import TTLCache

from proxy.errors import ConfigError

__all__ = ["MAX_SKEW_SECONDS", "PROOF_HEADER", "PROOF_PATH", "PROOF_SECONDS", "PeerAuth"]

PROOF_PATH = "/.upshift/peer"
"""Where a replica answers a challenge (on its API and peer listeners)."""
PROOF_HEADER = "x-upshift-proof"
MAX_SKEW_SECONDS = 60.0
"""A signed forward older or newer than this (by the owner's clock) is refused."""
PROOF_SECONDS = 60.0
"""How long a peer's proof of the secret is trusted before it is asked again."""
_MAX_SECRETS = 2
_NONCES = 200_000
"""Nonces remembered (for twice the skew): more signed forwards than this per two minutes
would let the oldest be replayed within the window; far above any replica's rate."""


class PeerAuth:
    """The shared secrets of one replica (none: forwards unsigned, peers unproven)."""

    def __init__(self, secrets: tuple[bytes, ...] = ()) -> None:
        self.secrets = secrets
        self._seen: TTLCache[str, bool] = TTLCache(_NONCES, 2 * MAX_SKEW_SECONDS)

    @classmethod
    def load(cls, path: str) -> PeerAuth:
        """The secrets in ``path`` (one per line; the first signs).

        Raises:
            ConfigError: unreadable, empty, or more than two secrets.
        """
        if not path:
            return cls()
        try:
            with open(path, "rb") as fh:
                lines = [line.strip() for line in fh.read().splitlines()]
        except OSError as exc:
            raise ConfigError(f"cluster.secret_file: cannot read {path}: {exc.strerror or exc}") from None
        secrets = tuple(line for line in lines if line)
        if not secrets or len(secrets) > _MAX_SECRETS:
            raise ConfigError(f"cluster.secret_file: {path} must hold one or two secrets, one per line")
        return cls(secrets)

    @property
    def enabled(self) -> bool:
        return bool(self.secrets)

    # -- forwards ------------------------------------------------------------------------------

    @staticmethod
    def _text(method: str, path: str, stamp: str, nonce: str, hop: str, body: bytes) -> bytes:
        digest = hashlib.sha256(body).hexdigest()
        return "\n".join(("upshift-forward-v1", method, path, stamp, nonce, hop, digest)).encode()

    def marker(self, method: str, path: str, body: bytes, hop: str, now: float | None = None) -> str:
        """The ``x-upshift-forwarded`` value of a forward (signed when there is a secret)."""
        if not self.secrets:
            return f"replica;{hop};;;"
        stamp, nonce = str(int(time.time() if now is None else now)), os.urandom(12).hex()
        sig = hmac.new(self.secrets[0], self._text(method, path, stamp, nonce, hop, body), hashlib.sha256)
        return f"replica;{hop};{stamp};{nonce};{sig.hexdigest()}"

    def verify(self, marker: str, method: str, path: str, body: bytes, now: float | None = None) -> bool:
        """Whether ``marker`` signs this request under one of the secrets, in time, once."""
        parts = marker.split(";")
        if len(parts) != 5 or parts[0] != "replica" or not self.secrets:
            return False
        _, hop, stamp, nonce, sig = parts
        if not stamp.isdigit() or len(nonce) != 24 or len(sig) != 64:
            return False
        if abs((time.time() if now is None else now) - int(stamp)) > MAX_SKEW_SECONDS:
            return False
        text = self._text(method, path, stamp, nonce, hop, body)
        if not any(hmac.compare_digest(hmac.new(s, text, hashlib.sha256).hexdigest(), sig) for s in self.secrets):
            return False
        if nonce in self._seen:
            return False  # a replay of a genuine forward
        self._seen[nonce] = True
        return True

    # -- proofs --------------------------------------------------------------------------------

    @staticmethod
    def challenge() -> str:
        return os.urandom(16).hex()

    @staticmethod
    def _proof_text(asker: str, prover: str, challenge: str) -> bytes | None:
        if len(challenge) != 32 or any(c not in "0123456789abcdef" for c in challenge):
            return None
        if "\n" in asker or "\n" in prover:
            return None
        return "\n".join(("upshift-peer-v2", asker, prover, challenge)).encode()

    def prove(self, asker: str, prover: str, challenge: str) -> str:
        """The proof for ``asker`` that ``prover`` holds the secret, bound to ``challenge``
        (empty without a secret or for a malformed question)."""
        text = self._proof_text(asker, prover, challenge)
        if not self.secrets or text is None:
            return ""
        return hmac.new(self.secrets[0], text, hashlib.sha256).hexdigest()

    def check_proof(self, asker: str, prover: str, challenge: str, proof: str) -> bool:
        """Whether ``proof`` answers this question under one of the secrets."""
        text = self._proof_text(asker, prover, challenge)
        if text is None:
            return False
        return any(hmac.compare_digest(hmac.new(s, text, hashlib.sha256).hexdigest(), proof) for s in self.secrets)
