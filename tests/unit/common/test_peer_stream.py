"""meshlm.common.channels and peer_stream: the one backoff policy, the one resolve_all, the
Dialer's TLS names, and the reconnect lifecycle (connect -> serve -> down -> back off -> re-pick,
clean close) and PeerSet's follow-the-address-list, against a real grpc.aio server."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshlm.common.addresses import resolve_all
from meshlm.common.channels import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, Backoff, Dialer
from meshlm.common.peer_stream import PeerSet, PeerStream


# ---- Backoff -------------------------------------------------------------------------------
def test_backoff_grows_to_its_cap_and_resets():
    backoff = Backoff(initial=0.1, cap=0.5, jitter=0.0)
    assert [round(backoff.next_delay(), 3) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next_delay() == pytest.approx(0.1)


def test_backoff_jitter_is_bounded_and_seeded():
    def delays(seed: int) -> list[float]:
        b = Backoff(initial=1.0, cap=1.0, jitter=0.2, rng=random.Random(seed))
        return [b.next_delay() for _ in range(50)]

    assert delays(7) == delays(7)
    assert all(0.8 <= d <= 1.2 for d in delays(7))
    assert len(set(delays(7))) > 1


def test_backoff_sleeps_through_the_injected_clock():
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    backoff = Backoff(initial=0.05, cap=0.1, jitter=0.0, sleep=sleep)

    async def run() -> None:
        for _ in range(3):
            await backoff.sleep()

    asyncio.run(run())
    assert slept == pytest.approx([0.05, 0.1, 0.1])


@pytest.mark.parametrize("kwargs", [{"initial": 0.0}, {"initial": 2.0, "cap": 1.0}, {"factor": 0.5}, {"jitter": 1.0}])
def test_backoff_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match="backoff needs"):
        Backoff(**kwargs)


# ---- resolve_all / Dialer ------------------------------------------------------------------
RESOLVED = {
    "sched.ns:50051": ["10.0.0.2:50051", "10.0.0.1:50051"],
    "dual.ns:1": ["10.0.0.9:1", "[fd00::9]:1"],
    "v6.ns:2": ["[fd00::1]:2"],
}


async def fake_resolve(address: str) -> list[str]:
    return sorted(RESOLVED.get(address, [address]))


def test_resolve_all_keeps_list_order_drops_repeats_and_dual_stack_v6():
    names: dict[str, str] = {}
    addrs = ["sched.ns:50051", "127.0.0.1:7", "dual.ns:1", "v6.ns:2", "sched.ns:50051"]
    out = asyncio.run(resolve_all(addrs, names, fake_resolve))
    assert out == ["10.0.0.1:50051", "10.0.0.2:50051", "127.0.0.1:7", "10.0.0.9:1", "[fd00::1]:2"]
    assert names == {
        "10.0.0.1:50051": "sched.ns",
        "10.0.0.2:50051": "sched.ns",
        "10.0.0.9:1": "dual.ns",
        "[fd00::1]:2": "v6.ns",
    }


def test_dialer_remembers_the_name_each_endpoint_came_from():
    dialer = Dialer(resolver=fake_resolve)
    asyncio.run(dialer.resolve(["sched.ns:50051", "127.0.0.1:7"]))
    assert dialer.server_name("10.0.0.2:50051") == "sched.ns"
    assert dialer.server_name("127.0.0.1:7") is None


def test_one_message_limit_both_ways():
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.max_send_message_length"] == MAX_MESSAGE_BYTES
    assert options["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES


# ---- PeerStream / PeerSet against a real server --------------------------------------------
class HealthWatch(PeerStream):
    """A minimal PeerStream: a grpc.health.v1 Watch stream, up at its first reply."""

    def __init__(self, endpoint: str | None, dialer: Dialer, candidates: list[str] = ()) -> None:
        super().__init__(
            "test-peer",
            "health",
            dialer,
            endpoint=endpoint,
            backoff=Backoff(initial=0.01, cap=0.05, rng=random.Random(0)),
        )
        self.candidates = list(candidates)
        self.downs: list[tuple[str, bool]] = []
        self.picks = 0

    async def next_endpoint(self) -> str | None:
        if self.endpoint is not None:
            return self.endpoint
        self.picks += 1
        return self.candidates[(self.picks - 1) % len(self.candidates)]

    async def serve(self, channel: grpc.aio.Channel, endpoint: str) -> None:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        async for _ in call:
            self.mark_up()

    def on_down(self, reason: str, was_up: bool) -> None:
        self.downs.append((reason, was_up))


async def start_server() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def wait_until(condition, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_stream_reconnects_after_its_peer_restarts_and_closes_cleanly():
    async def run() -> None:
        server, address = await start_server()
        port = int(address.rpartition(":")[2])
        peer = HealthWatch(address, Dialer())
        peer.start()
        assert await peer.wait_up(10.0)
        await server.stop(None)
        await wait_until(lambda: not peer.connected)
        assert peer.downs[0][1] is True  # the lost stream had been up
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        assert await peer.wait_up(10.0)  # backed off, dialed again, up again
        await peer.close()
        assert not peer.connected and peer.downs[-1] == ("closed", True)
        await server.stop(None)

    asyncio.run(run())


def test_stream_fails_over_to_the_next_endpoint():
    async def run() -> None:
        server, address = await start_server()
        dead = "127.0.0.1:1"
        peer = HealthWatch(None, Dialer(), candidates=[dead, address])
        peer.connect_timeout_s = 0.5
        peer.start()
        assert await peer.wait_up(10.0)
        assert peer.address == address and peer.downs[0][1] is False  # the dead one never came up
        await peer.close()
        await server.stop(None)

    asyncio.run(run())


def test_peer_set_follows_the_address_list():
    async def run() -> None:
        s1, a1 = await start_server()
        s2, a2 = await start_server()
        dialer = Dialer()
        changes: list[list[str]] = []
        peers: PeerSet[HealthWatch] = PeerSet(
            [a1, a2],
            dialer,
            lambda ep: HealthWatch(ep, dialer),
            "health",
            on_change=lambda ps: changes.append([p.endpoint for p in ps]),
        )
        await peers.refresh()
        assert [p.endpoint for p in peers.peers] == [a1, a2] and changes == [[a1, a2]]
        assert await peers.wait_any_up(10.0)
        gone = peers.by_address(a2)
        peers.addresses = [a1]
        await peers.refresh()
        assert [p.endpoint for p in peers.peers] == [a1] and gone is not None and gone.closed
        await peers.close()
        assert not peers.up()
        await s1.stop(None)
        await s2.stop(None)

    asyncio.run(run())
