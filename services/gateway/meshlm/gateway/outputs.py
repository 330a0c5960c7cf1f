"""Per-output accumulation of GenerateResponse messages, finish reasons, and SSE framing.

The tokenizer streams deltas (text, ids, logprobs) per output `index` (= prompt_index * n + j), or
one whole message per output when not streaming; `Output.add` handles both the same way.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi.responses import StreamingResponse

from meshlm.gateway.errors import APIError, error_body
from meshlm.v1 import common_pb2, tokenizer_pb2

LOGPROB_FIELDS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
)
_FINISH_NAMES = {
    common_pb2.FINISH_TYPE_STOP: "stop",
    common_pb2.FINISH_TYPE_LENGTH: "length",
    common_pb2.FINISH_TYPE_ABORT: "abort",
}


def abort_error(finish: common_pb2.FinishReason) -> APIError:
    status = finish.status_code if finish.status_code >= 400 else 500
    return APIError(status, finish.message or "the request was aborted")


def is_abort(response: Optional[tokenizer_pb2.GenerateResponse]) -> bool:
    return (
        response is not None
        and response.finished
        and response.meta_info.finish_reason.type == common_pb2.FINISH_TYPE_ABORT
    )


class Output:
    """Everything received so far for one output index."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = ""
        self.text = ""
        self.output_ids: list[int] = []
        self.finished = False
        self.finish: Optional[common_pb2.FinishReason] = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.retractions = 0
        self.e2e_latency = 0.0
        self.messages = 0
        self.logprobs: dict[str, list[Any]] = {name: [] for name in LOGPROB_FIELDS}

    def add(self, response: tokenizer_pb2.GenerateResponse) -> None:
        meta = response.meta_info
        self.messages += 1
        self.text += response.text
        self.output_ids.extend(response.output_ids)
        self.id = meta.id or self.id
        self.prompt_tokens = meta.prompt_tokens or self.prompt_tokens
        self.completion_tokens = meta.completion_tokens or max(self.completion_tokens, len(self.output_ids))
        self.cached_tokens = meta.cached_tokens or self.cached_tokens
        self.retractions = meta.retractions or self.retractions
        self.e2e_latency = meta.e2e_latency or self.e2e_latency
        if meta.HasField("logprobs"):
            for name in LOGPROB_FIELDS:
                self.logprobs[name].extend(getattr(meta.logprobs, name))
        if response.finished:
            self.finished = True
            self.finish = meta.finish_reason

    @property
    def aborted(self) -> bool:
        return self.finish is not None and self.finish.type == common_pb2.FINISH_TYPE_ABORT

    def openai_finish_reason(self) -> Optional[str]:
        """stop | length (None while running; an abort is an error, not a finish reason)."""
        if not self.finished or self.finish is None:
            return None
        return "length" if self.finish.type == common_pb2.FINISH_TYPE_LENGTH else "stop"

    def matched_stop(self) -> Optional[Union[int, str]]:
        if self.finish is None:
            return None
        which = self.finish.WhichOneof("matched")
        return getattr(self.finish, which) if which else None

    def sglang_finish_reason(self) -> Optional[dict[str, Any]]:
        """SGLang's finish_reason dict: {"type": "stop", "matched": ...} | {"type": "length", "length": N} |
        {"type": "abort", "message", "status_code"}; None while running."""
        if not self.finished or self.finish is None:
            return None
        f = self.finish
        kind = _FINISH_NAMES.get(f.type, "stop")
        if kind == "length":
            return {"type": "length", "length": f.length or self.completion_tokens}
        if kind == "abort":
            return {"type": "abort", "message": f.message, "status_code": f.status_code or None}
        return {"type": "stop", "matched": self.matched_stop()}


def input_logprob_values(entries: list[common_pb2.TokenLogprob]) -> list[Optional[float]]:
    """Prompt logprobs; the first prompt token has none (SGLang's None)."""
    flagged = any(e.has_logprob for e in entries)
    return [
        (e.logprob if e.has_logprob else None) if flagged else (None if i == 0 else e.logprob)
        for i, e in enumerate(entries)
    ]


def sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(status: int, message: str) -> str:
    return sse(error_body(status, message))


class SSEResponse(StreamingResponse):
    """An SSE stream that runs `on_close` however the response ends (finished, client gone, server
    shutting down), even if the body never started, so the gRPC call behind it is always cancelled."""

    def __init__(self, body: AsyncIterator[str], on_close: Optional[Callable[[], None]] = None) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


def sse_response(body: AsyncIterator[str], on_close: Optional[Callable[[], None]] = None) -> SSEResponse:
    return SSEResponse(body, on_close)
