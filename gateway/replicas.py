"""The replicas behind a service address, and which one holds each session.

A service address is one `host:port`, a comma-separated list of them, or a `dns:///name:port`
target whose name resolves to one address per replica (a headless Kubernetes Service). A
session's calls must all reach the replica that holds its cache: each session is pinned to
one replica, chosen by rendezvous hashing of its id over the replicas up when it starts, and
moves only when its replica goes away (its address no longer resolves, or a call finds it
unreachable), to be prefilled again on another.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
# A replica whose call failed as unreachable is passed over by new picks for this long.
DOWN_FOR_S = 5.0
# A replica that left the name keeps its channel open this long for calls in flight (a
# Kubernetes pod's termination grace period, docs/deploy.md).
LEAVING_GRACE_S = 60.0
HEALTH_TIMEOUT_S = 0.5  # each replica's health check (all at once): /health answers within a probe's 1 s


def split_addresses(target: str) -> tuple[list[str], str | None]:
    """(fixed addresses, None) for `host:port[,host:port...]`; ([], "name:port") for a
    `dns:///name:port` target. Raises ValueError for anything else."""
    target = target.strip()
    if target.startswith(DNS_SCHEME):
        name = target[len(DNS_SCHEME) :]
        host, _, port = name.rpartition(":")
        if not host or not port.isdigit() or "," in name:
            raise ValueError(f"a DNS target is dns:///name:port, got {target!r}")
        return [], name
    addresses = [a.strip() for a in target.split(",") if a.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or "://" in address:
            raise ValueError(
                f"a service address is host:port (or a comma-separated list, or dns:///name:port), got {address!r}"
            )
    if not addresses:
        raise ValueError("a service address is needed")
    return addresses, None


@dataclass(eq=False)
class Replica:
    """One replica: its address, channel and stub (made by the set's make_stub)."""

    address: str
    channel: object
    stub: object
    health: health_pb2_grpc.HealthStub
    down_until: float = 0.0
    gone: bool = False  # no longer among the addresses the target resolves to

    @property
    def up(self) -> bool:
        return not self.gone and time.monotonic() >= self.down_until


@dataclass(eq=False)
class ReplicaSet:
    """The replicas of one service. open_channel(address, server_name) makes a channel;
    make_stub(channel) the service's stub."""

    target: str
    open_channel: Callable[[str, str | None], object]
    make_stub: Callable[[object], object]
    resolve_every_s: float = 5.0
    replicas: dict[str, Replica] = field(default_factory=dict)
    _dns_name: str | None = None
    _refresh: asyncio.Task | None = None
    _closing: set = field(default_factory=set)  # channels of departed replicas, closing

    def __post_init__(self) -> None:
        addresses, self._dns_name = split_addresses(self.target)
        for address in addresses:
            self._add(address)

    async def start(self) -> None:
        """Resolves a DNS target once, then every resolve_every_s in the background."""
        if self._dns_name is not None:
            await self.resolve()
            self._refresh = asyncio.ensure_future(self._keep_resolving())

    def _add(self, address: str) -> None:
        server_name = self._dns_name.rpartition(":")[0] if self._dns_name else None
        channel = self.open_channel(address, server_name)
        self.replicas[address] = Replica(address, channel, self.make_stub(channel), health_pb2_grpc.HealthStub(channel))

    async def resolve(self) -> None:
        host, _, port = self._dns_name.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as error:
            log.warning("resolving %s failed (%s); keeping %d replicas", self._dns_name, error, len(self.replicas))
            return
        found = {_join(info[4][0], int(port)) for info in infos}
        for address in found - self.replicas.keys():
            log.info("replica %s of %s joined", address, self._dns_name)
            self._add(address)
        for address, replica in list(self.replicas.items()):
            replica.gone = address not in found
            if replica.gone:
                log.info("replica %s of %s left", address, self._dns_name)
                del self.replicas[address]
                # Calls in flight get a pod's grace period to end (its sessions move on a
                # failure); new ones go elsewhere.
                closing = asyncio.ensure_future(replica.channel.close(grace=LEAVING_GRACE_S))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)

    async def _keep_resolving(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_every_s)
            try:
                await self.resolve()
            except Exception:  # noqa: BLE001 - resolving goes on; the replicas known stay
                log.exception("resolving %s failed", self._dns_name)

    def __len__(self) -> int:
        return len(self.replicas)

    def pick(self, session_id: str, avoid: Replica | None = None) -> Replica | None:
        """The replica for a new session (or one moving off avoid): the highest rendezvous
        score among those up, else among all but avoid; None where there is none."""
        candidates = [r for r in self.replicas.values() if r is not avoid]
        up = [r for r in candidates if r.up]
        pool = up or candidates
        if not pool:
            return None
        return max(pool, key=lambda r: _score(session_id, r.address))

    def mark_down(self, replica: Replica) -> None:
        replica.down_until = time.monotonic() + DOWN_FOR_S

    async def health(self) -> dict[str, bool]:
        """Each replica's address and whether its health service says SERVING."""

        async def check(replica: Replica) -> bool:
            try:
                reply = await replica.health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - unreachable, timed out, or its channel closed
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        replicas = list(self.replicas.values())
        states = await asyncio.gather(*(check(r) for r in replicas))
        return {r.address: state for r, state in zip(replicas, states)}

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        for replica in self.replicas.values():
            await replica.channel.close()


class NoReplica(Exception):
    """No replica of a service is known (a DNS target that resolves to nothing yet)."""


class Route:
    """One session's replica of a service: picked on first use, kept until it goes away."""

    def __init__(self, replicas: ReplicaSet, session_id: str):
        self.replicas = replicas
        self.session_id = session_id
        self.replica: Replica | None = None

    def current(self) -> Replica:
        if self.replica is None or self.replica.gone:
            self.replica = self.replicas.pick(self.session_id)
        if self.replica is None:
            raise NoReplica(f"no replica of {self.replicas.target} is known")
        return self.replica

    def failed(self) -> Replica | None:
        """The session's replica was unreachable: marks it down and moves the session to
        another replica that is up, where there is one (which prefills it again); the replica
        it left (which may still hold its cache), None where it did not move."""
        old = self.replica
        if old is None:
            return None
        self.replicas.mark_down(old)
        new = self.replicas.pick(self.session_id, avoid=old)
        if new is None or not new.up:
            return None
        log.warning("replica %s unreachable; session %s moves to %s", old.address, self.session_id, new.address)
        self.replica = new
        return old


def _score(session_id: str, address: str) -> int:
    digest = hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
