"""Which replica holds a session: addresses, rendezvous picks, and moves only when it is gone."""

from __future__ import annotations

import asyncio

import pytest

from gateway.replicas import NoReplica, ReplicaSet, Route, split_addresses


class _Channel:
    def __init__(self, address: str):
        self.address = address
        self.closed = False

    async def close(self, grace=None):
        self.closed = True

    def unary_unary(self, *args, **kwargs):  # the health stub's methods: not called here
        return None

    unary_stream = unary_unary


def replica_set(target: str) -> ReplicaSet:
    return ReplicaSet(target, lambda address, server_name: _Channel(address), lambda channel: channel.address)


@pytest.mark.parametrize(
    "target, expected",
    [("a:1", (["a:1"], None)), (" a:1 , b:2 ", (["a:1", "b:2"], None)), ("dns:///verify:50052", ([], "verify:50052")),
     ("[::1]:5", (["[::1]:5"], None))],
)  # fmt: skip
def test_service_addresses(target, expected):
    assert split_addresses(target) == expected


@pytest.mark.parametrize("target", ["", "a", "a:b", "dns:///verify", "dns:///a:1,b:2", "http://a:1"])
def test_bad_service_addresses_are_refused(target):
    with pytest.raises(ValueError):
        split_addresses(target)


def test_sessions_spread_over_replicas_and_keep_theirs_until_it_is_gone():
    replicas = replica_set("a:1,b:2,c:3")
    routes = [Route(replicas, f"session-{i}") for i in range(300)]
    first = [route.current().address for route in routes]
    assert min(first.count(a) for a in ("a:1", "b:2", "c:3")) > 60  # about a third each
    assert [Route(replicas, f"session-{i}").current().address for i in range(300)] == first  # the same pick again

    replicas._add("d:4")  # a replica joins: no session moves
    assert [route.current().address for route in routes] == first
    gone = replicas.replicas.pop("b:2")
    gone.gone = True  # b leaves: only its sessions move
    moved = [route.current().address for route in routes]
    assert all(m == f for m, f in zip(moved, first) if f != "b:2")
    assert all(m != "b:2" for m in moved)


def test_an_unreachable_replica_moves_its_session_to_one_that_is_up():
    replicas = replica_set("a:1,b:2")
    route = Route(replicas, "s")
    held = route.current()
    assert route.failed() and route.current() is not held and not held.up
    other = Route(replicas, "s2")
    other.replica = route.current()
    assert not other.failed()  # the only other replica is down too: no move, the caller waits


def test_a_dns_target_follows_what_the_name_resolves_to(monkeypatch):
    replicas = replica_set("dns:///verify.example:50052")
    answers = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2"]]

    async def getaddrinfo(host, port, type=0):
        assert host == "verify.example" and port == 50052
        return [(None, None, None, "", (ip, port)) for ip in answers.pop(0)]

    async def scenario():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
        await replicas.resolve()
        assert sorted(replicas.replicas) == ["10.0.0.1:50052", "10.0.0.2:50052"]
        route = Route(replicas, "s")
        while route.current().address != "10.0.0.1:50052":
            route = Route(replicas, route.session_id + "x")
        first = route.current()
        await replicas.resolve()
        await asyncio.sleep(0)  # the channel's close (after its calls' grace) runs
        assert first.gone and first.channel.closed and sorted(replicas.replicas) == ["10.0.0.2:50052"]
        assert route.current().address == "10.0.0.2:50052"

    asyncio.run(scenario())


def test_no_replica_known_is_an_error_of_its_own():
    replicas = replica_set("a:1")
    replicas.replicas.clear()
    with pytest.raises(NoReplica):
        Route(replicas, "s").current()
