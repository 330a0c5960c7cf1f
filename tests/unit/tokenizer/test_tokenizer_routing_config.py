"""Routing policies, session ids naming their scheduler, and TokenizerConfig flags/env."""

from __future__ import annotations

import argparse

import pytest

from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.routing import Router, session_scheduler
from meshlm.v1 import common_pb2


def test_round_robin_cycles_in_order_and_skips_gaps():
    r = Router("round_robin")

    def no_load(i: int) -> None:
        return None

    assert [r.choose([0, 1, 2], no_load) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    # scheduler 2 disconnected: the cycle continues over the rest
    assert [r.choose([0, 1], no_load) for _ in range(3)] == [1, 0, 1]


def test_shortest_queue_picks_lowest_queue_plus_running():
    loads = {
        0: common_pb2.SchedulerLoad(num_queue_reqs=3, num_running_reqs=1),  # 4
        1: common_pb2.SchedulerLoad(num_queue_reqs=0, num_running_reqs=2),  # 2
        2: common_pb2.SchedulerLoad(num_queue_reqs=1, num_running_reqs=2),  # 3
    }
    r = Router("shortest_queue")
    assert r.choose([0, 1, 2], loads.get) == 1
    # what this replica sent since the last report counts too: 1 now has 2+1, ties go to the lower index
    assert r.choose([0, 1, 2], loads.get) == 1  # 3 vs 2's 3 -> index 1
    assert r.choose([0, 1, 2], loads.get) == 2  # 1 at 4, 2 at 3
    r.on_load(1)  # a fresh report from 1 replaces the local estimate
    r.on_load(2)
    assert r.choose([0, 1, 2], loads.get) == 1
    # a scheduler that has not reported yet counts as empty
    assert Router("shortest_queue").choose([0, 5], {0: loads[0]}.get) == 5


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing_policy must be one of"):
        Router("random")


def test_session_ids_name_their_scheduler():
    assert session_scheduler("s2-abc", 3) == 2
    assert session_scheduler("s3-abc", 3) is None  # names a scheduler that is not there
    custom = session_scheduler("my-session", 4)
    assert custom == session_scheduler("my-session", 4) and 0 <= custom < 4  # stable across replicas
    assert session_scheduler("anything", 0) is None


def test_config_flags_env_and_validation(monkeypatch):
    monkeypatch.setenv("MESHLM_TOKENIZER_SCHEDULER_ADDRS", "s0:1, s1:2")
    monkeypatch.setenv("MESHLM_TOKENIZER_REQUEST_TIMEOUT_S", "12.5")
    monkeypatch.setenv("MESHLM_TOKENIZER_PARALLEL_SAMPLE_WARMUP", "false")
    parser = argparse.ArgumentParser()
    TokenizerConfig.add_cli_args(parser)
    cfg = TokenizerConfig.from_cli_args(
        parser.parse_args(
            [
                "--routing-policy",
                "shortest_queue",
                "--port",
                "0",
                "--detokenizer-addrs",
                "d:3",
                "--metrics-port",
                "9100",
            ]
        )
    )
    assert cfg.scheduler_addrs == ("s0:1", "s1:2")  # env
    assert cfg.detokenizer_addrs == ("d:3",)  # flag
    assert cfg.request_timeout_s == 12.5 and cfg.parallel_sample_warmup is False
    assert cfg.routing_policy == "shortest_queue" and cfg.port == 0 and cfg.metrics_port == 9100
    assert cfg.tokenizer_id  # generated <hostname>-<pid>-<random>
    assert '"routing_policy": "shortest_queue"' in cfg.to_json()
    assert TokenizerConfig.from_env({"MESHLM_TOKENIZER_MAX_QUEUED_REQUESTS": "7"}).max_queued_requests == 7
    with pytest.raises(ValueError, match="routing_policy must be one of"):
        TokenizerConfig(routing_policy="nope")
    with pytest.raises(ValueError, match="address must be host:port"):
        TokenizerConfig(scheduler_addrs=("nohost",))
    with pytest.raises(ValueError, match="max_queued_requests must be >= 1"):
        TokenizerConfig(max_queued_requests=0)
