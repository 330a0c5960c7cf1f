"""Multi-turn sessions (SGLang's session_controller), owned by the scheduler loop thread.

A session keeps the history of its requests as a tree (each turn continues an earlier one).
A generate request with `session_id` gets as its prompt the turn it continues — its prompt
plus its outputs — followed by the request's own ids, so the radix cache serves the shared
prefix of every later turn:

    turn k+1 input = turn_k.origin_input_ids + turn_k.output_ids + new input_ids

`session_rid` names the turn to continue; None continues the session's last admitted turn (or
starts fresh in an empty session). The continued turn must have finished. Errors follow
DESIGN.md: unknown session -> 404, bad turn or over capacity -> 400.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from meshlm.scheduler.managers.io_struct import (
    CloseSessionOutput,
    CloseSessionReq,
    OpenSessionOutput,
    OpenSessionReq,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)

SessionError = tuple[str, int]  # (message, HTTP-style status)


@dataclass
class SessionReqNode:
    req: Req
    parent: SessionReqNode | None = None
    children: list[SessionReqNode] = field(default_factory=list)


@dataclass
class Session:
    session_id: str
    capacity: int  # most tokens one turn's request (prompt + outputs) may hold
    req_nodes: dict[str, SessionReqNode] = field(default_factory=dict)
    last_rid: str | None = None  # the latest admitted turn

    def history(self) -> list[str]:
        """Request ids of the session in admission order."""
        return list(self.req_nodes)


class SessionController:
    def __init__(self, max_req_len: int, tokenizer: Tokenizer | None = None) -> None:
        self.max_req_len = max_req_len
        self.sessions: dict[str, Session] = {}
        # SGLang drops a leading BOS from a continuing turn's ids. Only do so when the tokenizer
        # adds BOS by itself: some chat models (SmolLM2) use <|im_start|> as bos_token, and
        # every chat turn starts with it.
        self.trim_bos_id: int | None = None
        bos = getattr(tokenizer, "bos_token_id", None)
        if tokenizer is not None and bos is not None:
            try:
                ids = list(tokenizer("a").input_ids)
            except Exception:
                ids = []
            if ids and ids[0] == bos:
                self.trim_bos_id = bos

    # ---- control ------------------------------------------------------------------------
    def open(self, msg: OpenSessionReq) -> OpenSessionOutput:
        sid = msg.session_id or uuid.uuid4().hex
        if sid in self.sessions:
            return OpenSessionOutput(sid, False, f"session id {sid!r} already exists", msg.call_id)
        cap = msg.capacity_of_str_len
        if cap < 0:
            return OpenSessionOutput(sid, False, f"capacity_of_str_len must be >= 0, got {cap}", msg.call_id)
        cap = self.max_req_len if cap == 0 else min(cap, self.max_req_len)
        self.sessions[sid] = Session(sid, cap)
        logger.info("opened session %s (capacity %d tokens)", sid, cap)
        return OpenSessionOutput(sid, True, "", msg.call_id)

    def close(self, msg: CloseSessionReq) -> CloseSessionOutput:
        """Forget the session. Its running requests keep running; their KV stays in the radix
        cache as usual (evictable once they finish)."""
        if self.sessions.pop(msg.session_id, None) is None:
            return CloseSessionOutput(
                msg.session_id, False, f"session id {msg.session_id!r} does not exist", msg.call_id
            )
        logger.info("closed session %s", msg.session_id)
        return CloseSessionOutput(msg.session_id, True, "", msg.call_id)

    # ---- generate hooks -----------------------------------------------------------------
    def resolve_input(self, recv: TokenizedGenerateReqInput) -> tuple[list[int], SessionError | None]:
        """The turn's full input ids, or (recv.input_ids, (message, status)) when it cannot run."""
        assert recv.session_id is not None
        session = self.sessions.get(recv.session_id)
        if session is None:
            return recv.input_ids, (f"Invalid request: session id {recv.session_id} does not exist", 404)
        prev_rid = recv.session_rid or session.last_rid
        if prev_rid is None:
            return list(recv.input_ids), None  # first turn of the session
        node = session.req_nodes.get(prev_rid)
        if node is None:
            return recv.input_ids, (
                f"Invalid request session id: request {prev_rid!r} is not in session {recv.session_id}",
                400,
            )
        prev = node.req
        if not prev.finished():
            message = f"Invalid request session id: request {prev_rid!r} of session {recv.session_id} has not finished"
            return recv.input_ids, (message, 400)
        new_ids = list(recv.input_ids)
        if new_ids and self.trim_bos_id is not None and new_ids[0] == self.trim_bos_id:
            new_ids = new_ids[1:]
        max_new = prev.sampling_params.max_new_tokens
        outputs = prev.output_ids if max_new is None else prev.output_ids[:max_new]
        return prev.origin_input_ids + outputs + new_ids, None

    def check_capacity(self, req: Req) -> str | None:
        """After validation: the turn must fit the session's capacity; max_new_tokens is clamped
        so prompt + outputs stay within it."""
        assert req.session_id is not None
        session = self.sessions[req.session_id]
        n = len(req.origin_input_ids)
        if n > session.capacity:
            return (
                f"The input of session {session.session_id} ({n} tokens) is longer than its "
                f"capacity ({session.capacity} tokens)."
            )
        sp = req.sampling_params
        room = session.capacity - n
        sp.max_new_tokens = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        return None

    def add_req(self, recv: TokenizedGenerateReqInput, req: Req) -> None:
        """Record an admitted turn in the session's history."""
        assert recv.session_id is not None
        session = self.sessions[recv.session_id]
        prev_rid = recv.session_rid or session.last_rid
        parent = session.req_nodes.get(prev_rid) if prev_rid is not None else None
        node = SessionReqNode(req, parent)
        if parent is not None:
            parent.children.append(node)
        session.req_nodes[req.rid] = node
        session.last_rid = req.rid
