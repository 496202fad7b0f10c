"""Whether a port is free, checked before anything slow starts: a busy port should cost one
line at once, not a traceback after the models have loaded."""

from __future__ import annotations

import errno
import socket
import sys


def in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port (bound as the servers bind: SO_REUSEADDR, so a
    connection of a stopped server still in TIME_WAIT does not count)."""
    try:
        host = host.strip("[]")  # an IPv6 address as URLs write it
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # the server reports the address itself
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            return error.errno == errno.EADDRINUSE  # others (no such address, a privileged port): the server says
    return False


def busy_port_message(program: str, host: str, port: int, flag: str) -> str | None:
    """The one line that says port is taken (None where it is free)."""
    if port and in_use(host, port):
        return f"{program}: port {port} ({flag}) is in use on {host}: stop what listens there or pick another {flag}"
    return None


def first_busy_port(program: str, ports: list[tuple[str, int, str]]) -> str | None:
    """The one line for the first of ports ((host, port, flag), port 0 being none) that is
    given twice or taken; None where all are free."""
    seen: dict[int, str] = {}
    for host, port, flag in ports:
        if not port:
            continue
        if port in seen:
            return f"{program}: port {port} is given twice ({seen[port]} and {flag}); pick another {flag}"
        seen[port] = flag
        message = busy_port_message(program, host, port, flag)
        if message:
            return message
    return None


def gateway_url(url: str, program: str) -> str | None:
    """A gateway's base URL as the tools use it (a trailing / or /v1 dropped: the tools add
    /v1/...), once something answers HTTP there; None, after one line that says so, where
    nothing does."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    try:
        httpx.get(f"{base}/health", timeout=5)
    except httpx.HTTPError as error:
        print(
            f"{program}: no gateway answers at {base} ({type(error).__name__}); start one with `specserve up` "
            "or pass --url of a running one",
            file=sys.stderr,
        )
        return None
    return base
