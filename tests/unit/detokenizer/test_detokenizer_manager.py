"""DetokenizerManager without gRPC: routing by origin, holding, re-subscribing, logprob text,
embeddings, errors, spans and metrics."""

from __future__ import annotations

import asyncio
import logging

import pytest
from tests.spans import capture_spans

from meshlm.detokenizer.decoder import TokenizerDecoder
from meshlm.detokenizer.manager import DetokenizerManager
from meshlm.detokenizer.metrics import DetokenizerMetrics
from meshlm.v1 import common_pb2, scheduler_pb2

STOP = common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_LENGTH, length=3)


@pytest.fixture(scope="module")
def decoder(smollm_path: str) -> TokenizerDecoder:
    return TokenizerDecoder.from_path(smollm_path)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(entries: list[tuple], **extra) -> scheduler_pb2.BatchTokenIDOut:
    """entries: (rid, origin, ids, token_offset, seeded, finished)."""
    b = scheduler_pb2.BatchTokenIDOut(scheduler_id="s0")
    for rid, origin, ids, offset, seeded, finished in entries:
        d = b.deltas.add(
            rid=rid,
            origin=origin,
            output_ids=ids,
            token_offset=offset,
            completion_tokens=offset + len(ids),
            prompt_tokens=7,
        )
        if seeded:
            d.seed.CopyFrom(
                scheduler_pb2.DecodeSeed(
                    skip_special_tokens=True,
                    spaces_between_special_tokens=True,
                    want_logprob_text=extra.get("want_logprob_text", False),
                )
            )
        if finished:
            d.finish_reason.CopyFrom(STOP)
        if "traceparent" in extra:
            d.trace.traceparent = extra["traceparent"]
    return b


def texts(msg) -> list[str]:
    return [d.text for d in msg.strs.deltas]


def rids(msg) -> list[str]:
    return [d.rid for d in msg.strs.deltas]


def ids_of(decoder: TokenizerDecoder, text: str) -> list[int]:
    return decoder.tokenizer.encode(text, add_special_tokens=False).ids


def drain_queue(sub) -> list:
    return sub.take_pending()


def test_outputs_are_routed_per_origin_one_message_per_step(decoder) -> None:
    m = DetokenizerManager(decoder)
    s1, s2 = m.subscribe("t1"), m.subscribe("t2")
    a, b, c = ids_of(decoder, " alpha"), ids_of(decoder, " beta"), ids_of(decoder, " gamma")
    m.handle_tokens(
        step(
            [
                ("a", "t1", a, 0, True, True),
                ("b", "t2", b, 0, True, True),
                ("c", "t1", c, 0, True, True),
            ]
        )
    )
    [m1], [m2] = drain_queue(s1), drain_queue(s2)
    assert rids(m1) == ["a", "c"] and texts(m1) == [" alpha", " gamma"]
    assert rids(m2) == ["b"] and texts(m2) == [" beta"]
    assert [d.prompt_tokens for d in m1.strs.deltas] == [7, 7]
    assert [d.text_offset for d in m1.strs.deltas] == [0, 0]
    assert [d.completion_tokens for d in m1.strs.deltas] == [len(a), len(c)]
    assert m1.strs.deltas[0].finish_reason.type == common_pb2.FINISH_TYPE_LENGTH
    assert list(m1.strs.deltas[1].output_ids) == c and m1.strs.deltas[1].token_offset == 0
    assert len(m.detokenizer) == 0  # finished requests leave no state


def test_held_outputs_reach_a_late_subscriber_or_are_dropped(decoder, caplog) -> None:
    clock = Clock()
    m = DetokenizerManager(decoder, undelivered_hold_s=10.0, clock=clock)
    m.handle_tokens(step([("early", "late", ids_of(decoder, " hi"), 0, True, True)]))
    clock.now += 9.0
    assert m.sweep() == 0
    [msg] = drain_queue(m.subscribe("late"))
    assert rids(msg) == ["early"]
    m.handle_tokens(step([("gone", "nobody", ids_of(decoder, " hi"), 0, True, True)]))
    clock.now += 10.5
    with caplog.at_level(logging.WARNING):
        assert m.sweep() == 1
    assert "gone" in caplog.text and "nobody" in caplog.text
    assert drain_queue(m.subscribe("nobody")) == []


def test_resubscribe_moves_pending_and_ends_the_old_stream(decoder) -> None:
    m = DetokenizerManager(decoder)
    old = m.subscribe("t1")
    m.handle_tokens(step([("a", "t1", ids_of(decoder, " one"), 0, True, False)]))
    new = m.subscribe("t1")
    assert old.queue.get_nowait() is None
    [msg] = drain_queue(new)
    assert texts(msg) == [" one"]
    m.unsubscribe(old)  # the stale stream going away does not remove the new one
    assert m.has_subscriber("t1")
    m.handle_tokens(step([("a", "t1", ids_of(decoder, " two"), 1, False, False)]))
    m.unsubscribe(new)  # unsent outputs are held for the next subscriber
    [held] = drain_queue(m.subscribe("t1"))
    assert texts(held) == [" two"] and held.strs.deltas[0].text_offset == 4


def test_stream_ends_on_drain_after_queued_outputs() -> None:
    async def run() -> list:
        m = DetokenizerManager(decoder=None)  # type: ignore[arg-type]
        got: list = []

        async def consume() -> None:
            async for msg in m.stream("t1"):
                got.append(msg)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        emb = scheduler_pb2.BatchEmbeddingOut()
        emb.results.add(rid="e", origin="t1", embedding=[0.5])
        m.handle_embeddings(emb)
        await asyncio.wait_for(m.drain(), 2)
        await asyncio.wait_for(task, 2)
        assert not m.has_subscriber("t1")
        return got

    [msg] = asyncio.run(run())
    assert list(msg.embeddings.results[0].embedding) == [0.5]


def test_embeddings_split_by_origin(decoder) -> None:
    m = DetokenizerManager(decoder)
    s1, s2 = m.subscribe("t1"), m.subscribe("t2")
    emb = scheduler_pb2.BatchEmbeddingOut(scheduler_id="s0")
    for rid, origin, v, n in (("e1", "t1", 1.0, 3), ("e2", "t2", 2.0, 4), ("e3", "t1", 3.0, 5)):
        emb.results.add(rid=rid, origin=origin, embedding=[v, -v], prompt_tokens=n)
    m.handle_embeddings(emb)
    [m1], [m2] = drain_queue(s1), drain_queue(s2)
    assert [r.rid for r in m1.embeddings.results] == ["e1", "e3"] and [
        list(r.embedding) for r in m1.embeddings.results
    ] == [[1.0, -1.0], [3.0, -3.0]]
    assert [(r.rid, r.prompt_tokens) for r in m2.embeddings.results] == [("e2", 4)]
    assert m1.embeddings.scheduler_id == "s0"


def test_logprob_text_only_when_asked(decoder) -> None:
    m = DetokenizerManager(decoder)
    sub = m.subscribe("t1")
    ids = ids_of(decoder, "Hello world")
    for want in (True, False):
        b = step([("r", "t1", ids, 0, True, True)], want_logprob_text=want)
        lp = b.deltas[0].logprobs
        for i in ids:
            lp.output_token_logprobs.add(logprob=-0.5, token_id=i, has_logprob=True)
        lp.output_top_logprobs.add().entries.add(logprob=-0.1, token_id=ids[1])
        m.handle_tokens(b)
        [msg] = drain_queue(sub)
        got = msg.strs.deltas[0].logprobs
        texts = [e.text for e in got.output_token_logprobs] + [got.output_top_logprobs[0].entries[0].text]
        assert texts == (["Hello", " world", " world"] if want else ["", "", ""])


def test_lost_state_finishes_with_an_error(decoder) -> None:
    m = DetokenizerManager(decoder)
    sub = m.subscribe("t1")
    m.handle_tokens(step([("x", "t1", ids_of(decoder, " late"), 5, False, False)]))
    [msg] = drain_queue(sub)
    reason = msg.strs.deltas[0].finish_reason
    assert reason.type == common_pb2.FINISH_TYPE_ABORT and reason.status_code == 500 and "x" in reason.message
    m.handle_tokens(step([("x", "t1", ids_of(decoder, " more"), 6, False, False)]))
    assert drain_queue(sub) == []  # reported once


def test_detokenize_span_is_child_of_request_trace_and_metrics(decoder) -> None:
    exporter = capture_spans()
    metrics = DetokenizerMetrics()
    m = DetokenizerManager(decoder, metrics=metrics)
    m.subscribe("t1")
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ids = ids_of(decoder, "Hello world")
    m.handle_tokens(step([("r", "t1", ids[:1], 0, True, False)], traceparent=tp))
    assert exporter.get_finished_spans() == ()
    reg = metrics.metrics.registry
    assert reg.get_sample_value("meshlm:num_active_requests") == 1
    m.handle_tokens(step([("r", "t1", ids[1:], 1, False, True)], traceparent=tp))
    [span] = [s for s in exporter.get_finished_spans() if s.name == "detokenize"]
    assert format(span.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert span.attributes["meshlm.rid"] == "r" and span.attributes["meshlm.output_tokens"] == 2
    assert reg.get_sample_value("meshlm:batches_total") == 2
    assert reg.get_sample_value("meshlm:num_active_requests") == 0
