"""TLS for the gRPC links: a service with a certificate serves only TLS (no plaintext port),
and with a client CA it demands client certificates signed by it (mutual TLS). File paths
come from configuration only (Kubernetes mounts them from Secrets), never from a request."""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read the {what} {path!r}: {error.strerror}") from None


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials | None:
    if not cert and not key and not client_ca:
        return None
    if not (cert and key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    pair = (_read(key, "TLS key"), _read(cert, "TLS certificate"))
    roots = _read(client_ca, "client CA") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=roots is not None)


def channel_credentials(ca: str, cert: str, key: str) -> grpc.ChannelCredentials | None:
    if not ca and not cert and not key:
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both tls_cert and tls_key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA certificate") if ca else None,
        private_key=_read(key, "TLS key") if key else None,
        certificate_chain=_read(cert, "TLS certificate") if cert else None,
    )


def channel_options(server_name: str) -> list[tuple[str, str]]:
    """Checks the services' certificates against server_name instead of the dialled host."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []
