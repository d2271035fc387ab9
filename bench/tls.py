"""TLS to the upstream on loopback (``--tls``): production upstreams are ``wss://``, so the bench
can put the emulator behind TLS with a private CA (trustme, the ``test`` extra) and make the
sidecar and the floor relays trust it, each the way it would trust a real gateway's CA.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LoopbackCA"]


@dataclass(frozen=True, slots=True)
class LoopbackCA:
    """A throwaway CA and a certificate for 127.0.0.1, written to PEM files in ``folder``.

    ``ca_file`` is what the clients trust (the sidecar's ``egress.ca_file``, the floors' and the
    bench client's context); ``cert_file`` / ``key_file`` are the emulator's ``--tls-cert`` /
    ``--tls-key``.
    """

    ca_file: Path
    cert_file: Path
    key_file: Path

    @classmethod
    def create(cls, folder: Path) -> LoopbackCA:
        try:
            import trustme
        except ImportError:  # pragma: no cover - the bench's TLS needs the test extra
            raise SystemExit("bench --tls needs trustme: pip install -e '.[test]'") from None
        folder.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        out = cls(folder / "ca.pem", folder / "server.pem", folder / "server.key")
        ca.cert_pem.write_to_path(str(out.ca_file))
        cert.private_key_pem.write_to_path(str(out.key_file))
        with out.cert_file.open("wb") as chain:
            for blob in cert.cert_chain_pems:
                chain.write(blob.bytes())
        return out

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this CA (and verifies the host name)."""
        return ssl.create_default_context(cafile=str(self.ca_file))
