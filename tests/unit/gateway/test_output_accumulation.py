"""Output accumulates a choice's deltas: the text in order however reads and adds interleave,
the ids, and the counts the last message carries."""

from __future__ import annotations

from meshlm.gateway.outputs import Output
from meshlm.v1 import tokenizer_pb2


def _delta(
    text: str, ids: list[int], finished: bool = False, completion_tokens: int = 0
) -> tokenizer_pb2.GenerateResponse:
    r = tokenizer_pb2.GenerateResponse(index=0, text=text, output_ids=ids, finished=finished)
    r.meta_info.completion_tokens = completion_tokens
    return r


def test_text_is_the_deltas_in_order_across_reads() -> None:
    out = Output(0)
    assert out.text == ""
    deltas = ["Hel", "", "lo", ", wörld", " 🙂", "!"]
    seen = ""
    for i, d in enumerate(deltas):
        out.add(_delta(d, [i]))
        seen += d
        if i % 2:  # a read between adds joins what is there; later deltas still follow it
            assert out.text == seen
    assert out.text == "Hello, wörld 🙂!"
    assert out.text == seen
    assert out.output_ids == list(range(len(deltas)))
    assert out.messages == len(deltas)


def test_long_stream_text_and_counts() -> None:
    out = Output(0)
    n = 5000
    for i in range(n):
        out.add(_delta(f"t{i % 10}", [i], finished=i == n - 1, completion_tokens=i + 1))
    assert out.text == "".join(f"t{i % 10}" for i in range(n))
    assert out.completion_tokens == n
    assert out.finished
