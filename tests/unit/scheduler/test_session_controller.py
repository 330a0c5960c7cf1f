"""SessionController: open/close, turn inputs (previous prompt + outputs + new ids), errors
(unknown session 404, bad or unfinished turn 400), capacity, BOS trimming."""

from __future__ import annotations

from types import SimpleNamespace

from meshlm.common.finish import FinishReason
from meshlm.scheduler.managers.io_struct import (
    CloseSessionReq,
    OpenSessionReq,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.session_controller import SessionController
from meshlm.scheduler.sampling.sampling_params import SamplingParams


def turn(
    rid: str, ids: list[int], session: str = "s", prev: str | None = None, max_new: int = 8
) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid,
        input_ids=ids,
        sampling_params=SamplingParams(max_new_tokens=max_new),
        session_id=session,
        session_rid=prev,
    )


def admit(sc: SessionController, recv: TokenizedGenerateReqInput, outputs: list[int] | None = None) -> Req:
    """What the scheduler does: resolve, build the Req, check capacity, record; optionally finish it."""
    ids, err = sc.resolve_input(recv)
    assert err is None, err
    req = Req(recv.rid, ids, recv.sampling_params, session_id=recv.session_id)
    assert sc.check_capacity(req) is None
    sc.add_req(recv, req)
    if outputs is not None:
        req.output_ids = list(outputs)
        req.finished_reason = FinishReason.at_length(len(outputs))
    return req


def test_open_close() -> None:
    sc = SessionController(max_req_len=100)
    out = sc.open(OpenSessionReq(0, "s", call_id=5))
    assert out.success and out.session_id == "s" and out.call_id == 5
    assert sc.sessions["s"].capacity == 100  # 0 = the context
    assert not sc.open(OpenSessionReq(0, "s")).success  # duplicate id
    made = sc.open(OpenSessionReq(50))
    assert made.success and made.session_id and sc.sessions[made.session_id].capacity == 50
    assert sc.open(OpenSessionReq(1000, "big")).success and sc.sessions["big"].capacity == 100
    assert not sc.open(OpenSessionReq(-1, "neg")).success
    closed = sc.close(CloseSessionReq("s", call_id=6))
    assert closed.success and closed.call_id == 6 and "s" not in sc.sessions
    assert not sc.close(CloseSessionReq("s")).success


def test_turns_chain_prompt_and_outputs() -> None:
    sc = SessionController(max_req_len=100)
    sc.open(OpenSessionReq(0, "s"))
    t1 = admit(sc, turn("t1", [1, 2, 3]), outputs=[10, 11])
    assert t1.origin_input_ids == [1, 2, 3]
    t2 = admit(sc, turn("t2", [4, 5]), outputs=[12])
    assert t2.origin_input_ids == [1, 2, 3, 10, 11, 4, 5]
    # session_rid picks the turn to continue (a branch)
    t3 = admit(sc, turn("t3", [6], prev="t1"))
    assert t3.origin_input_ids == [1, 2, 3, 10, 11, 6]
    s = sc.sessions["s"]
    assert s.history() == ["t1", "t2", "t3"] and s.last_rid == "t3"
    assert [n.req.rid for n in s.req_nodes["t1"].children] == ["t2", "t3"]


def test_errors() -> None:
    sc = SessionController(max_req_len=100)
    _, err = sc.resolve_input(turn("x", [1], session="nope"))
    assert err is not None and err[1] == 404 and "nope" in err[0]
    sc.open(OpenSessionReq(0, "s"))
    _, err = sc.resolve_input(turn("x", [1], prev="missing"))
    assert err is not None and err[1] == 400 and err[0].startswith("Invalid request session id")
    admit(sc, turn("running", [1, 2]))  # not finished
    _, err = sc.resolve_input(turn("x", [3]))
    assert err is not None and err[1] == 400 and "not finished" in err[0]


def test_capacity_limits_input_and_clamps_max_new_tokens() -> None:
    sc = SessionController(max_req_len=100)
    sc.open(OpenSessionReq(10, "s"))
    admit(sc, turn("t1", [1, 2, 3], max_new=4), outputs=[4, 5, 6, 7])
    ids, err = sc.resolve_input(turn("t2", [8, 9], max_new=50))
    assert err is None and len(ids) == 9
    req = Req("t2", ids, SamplingParams(max_new_tokens=50), session_id="s")
    assert sc.check_capacity(req) is None and req.sampling_params.max_new_tokens == 1
    ids, _ = sc.resolve_input(turn("t3", [8, 9, 10, 11]))
    too_long = Req("t3", ids, SamplingParams(), session_id="s")
    msg = sc.check_capacity(too_long)
    assert msg is not None and "capacity (10 tokens)" in msg


def test_bos_trimmed_only_when_the_tokenizer_adds_it() -> None:
    adds_bos = type("T", (), {"bos_token_id": 1, "__call__": lambda self, s: SimpleNamespace(input_ids=[1, 42])})()
    chat_bos = type("T", (), {"bos_token_id": 1, "__call__": lambda self, s: SimpleNamespace(input_ids=[42])})()
    for tok, expect in ((adds_bos, [5, 6, 9, 2]), (chat_bos, [5, 6, 9, 1, 2])):
        sc = SessionController(max_req_len=100, tokenizer=tok)
        sc.open(OpenSessionReq(0, "s"))
        admit(sc, turn("t1", [5, 6]), outputs=[9])
        ids, err = sc.resolve_input(turn("t2", [1, 2]))
        assert err is None and ids == expect
