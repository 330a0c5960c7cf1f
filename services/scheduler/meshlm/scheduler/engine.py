"""Engine: the scheduler loop in a background thread, driven in-process through its port.

Used by the scheduler service, the tests and the benchmarks. Requests go in as
TokenizedGenerateReqInput; each BatchTokenIDOut's TokenDeltas come back on the loop thread and
are routed to their request's asyncio queue (as are EmbeddingOuts, and a RequestError when the
loop crashes). Text is produced here by the detokenizer service's incremental decode
(meshlm.detokenizer.incremental, with the Engine's Hugging Face tokenizer): the same surround
window over the prompt's tail, held-back incomplete UTF-8 character and stop trimming as the
ring, and O(new tokens) a step, where decoding the whole output every step cost O(output) (an
8192-token stream spent ~4.6 s of CPU decoding).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from meshlm.common.finish import FinishReason
from meshlm.detokenizer import incremental
from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    CloseSessionOutput,
    CloseSessionReq,
    EmbeddingOut,
    FlushCacheOutput,
    FlushCacheReq,
    GetLoadReq,
    LoadReport,
    OpenSessionOutput,
    OpenSessionReq,
    PrefilledReq,
    TokenDelta,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.model_loader.tokenizer import hf_tokenizer
from meshlm.scheduler.runtime import SchedulerRuntime
from meshlm.scheduler.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request ended with an error (bad input: 400, overload: 503, abort: 499, ...)."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code

    @staticmethod
    def of_abort(reason: FinishReason) -> RequestError:
        return RequestError(reason.message, reason.status_code)


# What a request's queue receives: its deltas (or its embedding), or the error that ends it.
ReqEvent = TokenDelta | EmbeddingOut | RequestError


class _TokenizerText:
    """incremental.TextDecoder over a Hugging Face tokenizer (its own decode options)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> list[str]:
        return list(
            self.tokenizer.batch_decode(
                [list(ids) for ids in sequences],
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
        )

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]


@dataclass
class _ReqState:
    """One request's caller side. `detokenizer`: its decode state (one request, created at its
    first delta); `num_output_ids`: output ids received so far (the next delta's token offset);
    `sent_chars`: characters yielded so far (a final delta that trims a stop string already
    partly yielded cannot take them back, as a streamed SSE event cannot)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[ReqEvent]
    sampling_params: SamplingParams
    detokenizer: incremental.IncrementalDetokenizer | None = None
    num_output_ids: int = 0
    sent_chars: int = 0


class Engine:
    """In-process engine. Construct once; call generate/encode from any asyncio loop, or the
    *_sync helpers from plain code. `shutdown()` stops the loop thread.

    Prefill/decode disaggregation in one process: an Engine with
    disaggregation_mode="prefill" hands each prefilled request to `decode_engine` (an Engine
    with disaggregation_mode="decode"), whose outputs reach the caller of this Engine."""

    def __init__(
        self, config: SchedulerConfig | None = None, *, decode_engine: Engine | None = None, **overrides: Any
    ) -> None:
        config = (config or SchedulerConfig()).replace(**overrides) if overrides else (config or SchedulerConfig())
        if (config.disaggregation_mode == "prefill") != (decode_engine is not None):
            raise ValueError("decode_engine is required with disaggregation_mode='prefill', and only then")
        self._decode = decode_engine
        self._states: dict[str, _ReqState] = {}
        self._controls: dict[int, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._crashed: str | None = None  # set (under _lock) once the loop died
        self.runtime = SchedulerRuntime(config, self._on_output, self._on_control)
        self.model_config = self.runtime.model_config
        self.tokenizer = hf_tokenizer(self.runtime.tokenizer)  # chat templates, decode options
        self._text_decoder = _TokenizerText(self.tokenizer)
        self.config = self.runtime.config
        self.port = self.runtime.port
        self.scheduler = self.runtime.scheduler
        self.runtime.start(on_crash=self._on_crash)

    def _on_crash(self, exc: BaseException) -> None:
        with self._lock:
            self._crashed = f"scheduler loop crashed: {exc!r}"
            states = list(self._states.items())
            controls = list(self._controls.values())
            self._controls.clear()
        for _rid, st in states:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, RequestError("scheduler loop crashed", 500))
        for fut in controls:
            fut.set_exception(RequestError("scheduler loop crashed", 500))

    # ---- loop-thread callbacks ------------------------------------------------------------
    def _on_output(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenIDOut):
            for delta in msg.deltas:
                self._deliver(delta.rid, delta)
        elif isinstance(msg, BatchEmbeddingOut):
            for result in msg.results:
                self._deliver(result.rid, result)
        elif isinstance(msg, PrefilledReq):
            self._hand_over(msg)

    def _hand_over(self, msg: PrefilledReq) -> None:
        """Prefill role: the decode engine continues the request and delivers its outputs to
        this caller's queue. A request whose caller already left is dropped here."""
        assert self._decode is not None
        with self._lock:
            st = self._states.get(msg.req.rid)
        if st is None:
            return
        crashed = self._decode._adopt(msg.req.rid, st)
        if crashed is not None:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, RequestError(crashed, 500))
            return
        self._decode.port.put(msg)

    def _adopt(self, rid: str, st: _ReqState) -> str | None:
        """Deliver rid's outputs to another engine's caller (PD handover); the crash message
        instead when this engine's loop is dead."""
        with self._lock:
            if self._crashed is None:
                self._states[rid] = st
            return self._crashed

    def _deliver(self, rid: str, item: ReqEvent) -> None:
        with self._lock:
            st = self._states.get(rid)
        if st is not None:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, item)

    def _on_control(self, msg: Any) -> None:
        with self._lock:
            fut = self._controls.pop(getattr(msg, "call_id", 0), None)
        if fut is not None:
            fut.set_result(msg)

    # ---- public API -----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _register(self, rid: str | None, sp: SamplingParams) -> tuple[str, _ReqState]:
        rid = rid or uuid.uuid4().hex
        st = _ReqState(asyncio.get_running_loop(), asyncio.Queue(), sp)
        with self._lock:
            if self._crashed is not None:  # nothing would ever answer it
                raise RequestError(self._crashed, 500)
            if rid in self._states:
                raise RequestError(f"duplicate request id {rid!r}")
            self._states[rid] = st
        return rid, st

    def _unregister(self, rid: str) -> None:
        with self._lock:
            self._states.pop(rid, None)
        if self._decode is not None:
            self._decode._unregister(rid)

    async def generate_stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        rid: str | None = None,
        stream: bool = True,
        session_id: str | None = None,
        session_rid: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield deltas {"text", "output_ids", "meta_info", "finished"}; the last has finished=True.

        Raises RequestError when the scheduler rejects or aborts the request. Cancelling the
        consumer (e.g. the caller went away) aborts the request and frees its KV."""
        if (prompt is None) == (input_ids is None):
            raise RequestError("exactly one of prompt (text) and input_ids must be given")
        if isinstance(sampling_params, SamplingParams):
            sp = sampling_params
        else:
            try:
                sp = SamplingParams.from_dict(dict(sampling_params or {}))
            except (TypeError, ValueError) as e:
                raise RequestError(str(e)) from None
        ids = list(input_ids) if input_ids is not None else self.tokenize(prompt or "")
        rid, st = self._register(rid, sp)
        self.port.put(
            TokenizedGenerateReqInput(
                rid=rid,
                input_ids=ids,
                sampling_params=sp,
                input_text=prompt,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                token_ids_logprob=token_ids_logprob,
                stream=stream,
                session_id=session_id,
                session_rid=session_rid,
            )
        )
        finished = False
        try:
            while not finished:
                item = await st.queue.get()
                if isinstance(item, RequestError):
                    raise item
                assert isinstance(item, TokenDelta)
                out = self._output(rid, st, item)
                finished = out["finished"]
                yield out
        finally:
            self._unregister(rid)
            if not finished:
                self.abort(rid)

    def _output(self, rid: str, st: _ReqState, delta: TokenDelta) -> dict[str, Any]:
        """One delta as the caller sees it: new text (incremental decode), ids, meta_info."""
        reason = delta.finish_reason
        if reason is not None and reason.is_abort:
            raise RequestError.of_abort(reason)
        new_ids = delta.output_ids
        text = self._text_of(rid, st, delta)
        st.num_output_ids += len(new_ids)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason.to_json() if reason is not None else None,
            "prompt_tokens": delta.prompt_tokens,
            "completion_tokens": delta.completion_tokens,
            "cached_tokens": delta.cached_tokens,
        }
        lp = delta.logprobs
        if lp is not None and (lp.input_token_logprobs or lp.output_token_logprobs):
            meta["input_token_logprobs"] = list(zip(lp.input_token_logprobs, lp.input_token_ids))
            meta["output_token_logprobs"] = list(zip(lp.output_token_logprobs, new_ids))
            meta["input_top_logprobs"] = lp.input_top_logprobs
            meta["output_top_logprobs"] = lp.output_top_logprobs
            meta["input_token_ids_logprobs"] = lp.input_token_ids_logprobs
            meta["output_token_ids_logprobs"] = lp.output_token_ids_logprobs
        return {"text": text, "output_ids": list(new_ids), "meta_info": meta, "finished": reason is not None}

    def _text_of(self, rid: str, st: _ReqState, delta: TokenDelta) -> str:
        """The new text of a delta (st.num_output_ids: the ids before it)."""
        reason, sp = delta.finish_reason, st.sampling_params
        seed = None
        if st.detokenizer is None:  # the first delta: its prompt tail opens the surround window
            st.detokenizer = incremental.IncrementalDetokenizer(self._text_decoder, max_states=1)
            seed = incremental.Seed(
                prompt_tail_ids=tuple(delta.prompt_tail_ids),
                skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
                no_stop_trim=sp.no_stop_trim,
            )
        (out,) = st.detokenizer.step(
            [
                incremental.TokenDelta(
                    rid=rid,
                    ids=delta.output_ids,
                    token_offset=st.num_output_ids,
                    seed=seed,
                    finished=reason is not None,
                    matched_token=reason.matched_token if reason is not None else None,
                    matched_str=reason.matched_str if reason is not None else None,
                )
            ]
        )
        assert out is not None, "a request's decode state fails only once, with an error"
        if out.error is not None:
            raise RequestError(out.error, 500)
        # out.text starts at character out.text_offset; what the caller already has is skipped
        skip = st.sent_chars - out.text_offset
        text = out.text[skip:] if skip > 0 else out.text
        st.sent_chars = max(st.sent_chars, out.text_offset + len(out.text))
        return text

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
        """Run one request to the end: {"text", "output_ids", "meta_info"} with logprob lists
        accumulated over all deltas."""
        text, ids = "", []
        meta: dict[str, Any] = {}
        lists = (
            "input_token_logprobs",
            "output_token_logprobs",
            "input_top_logprobs",
            "output_top_logprobs",
            "input_token_ids_logprobs",
            "output_token_ids_logprobs",
        )
        kwargs.setdefault("stream", False)
        async for d in self.generate_stream(prompt, **kwargs):
            text += d["text"]
            ids += d["output_ids"]
            for k, v in d["meta_info"].items():
                if k in lists:
                    meta.setdefault(k, []).extend(v)
                else:
                    meta[k] = v
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def encode(
        self, prompt: str | None = None, *, input_ids: Sequence[int] | None = None, rid: str | None = None
    ) -> dict[str, Any]:
        if (prompt is None) == (input_ids is None):
            raise RequestError("exactly one of prompt (text) and input_ids must be given")
        ids = list(input_ids) if input_ids is not None else self.tokenize(prompt or "")
        rid, st = self._register(rid, SamplingParams(max_new_tokens=0))
        self.port.put(TokenizedEmbeddingReqInput(rid=rid, input_ids=ids, input_text=prompt))
        try:
            item = await st.queue.get()
        finally:
            self._unregister(rid)
        if isinstance(item, RequestError):
            raise item
        if item.finish_reason is not None and item.finish_reason.is_abort:  # a rejection is a TokenDelta
            raise RequestError.of_abort(item.finish_reason)
        assert isinstance(item, EmbeddingOut)
        return {"embedding": item.embedding, "meta_info": {"id": rid, "prompt_tokens": item.prompt_tokens}}

    # ---- control --------------------------------------------------------------------------
    def _control(self, msg: Any, timeout: float = 30.0) -> Any:
        """Send a control message and wait for the loop's reply (matched by call_id)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._crashed is not None:
                raise RequestError(self._crashed, 500)
            msg.call_id = next(self._ids)
            self._controls[msg.call_id] = fut
        self.port.put(msg)
        try:
            return fut.result(timeout=timeout)
        finally:
            with self._lock:
                self._controls.pop(msg.call_id, None)

    def flush_cache(self) -> FlushCacheOutput:
        return self._control(FlushCacheReq())

    def get_load(self) -> LoadReport:
        return self._control(GetLoadReq())

    def open_session(self, capacity_of_str_len: int = 0, session_id: str | None = None) -> OpenSessionOutput:
        """Open a multi-turn session; pass its id as generate(session_id=...)."""
        return self._control(OpenSessionReq(capacity_of_str_len, session_id))

    def close_session(self, session_id: str) -> CloseSessionOutput:
        return self._control(CloseSessionReq(session_id))

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.port.put(AbortReq(rid=rid, abort_all=abort_all))
        if self._decode is not None:
            self._decode.abort(rid, abort_all)

    # ---- sync helpers ---------------------------------------------------------------------
    def generate_batch_sync(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Submit every request at once (continuous batching) and wait for all results.
        Each item holds generate()'s keyword arguments (prompt or input_ids, ...)."""

        async def run() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(self.generate(**r) for r in requests)))

        return asyncio.run(run())

    def generate_sync(self, prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
        return self.generate_batch_sync([{"prompt": prompt, **kwargs}])[0]

    def encode_sync(self, prompts: Sequence[str]) -> list[list[float]]:
        async def run() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(self.encode(p) for p in prompts)))

        return [r["embedding"] for r in asyncio.run(run())]

    def shutdown(self) -> None:
        self.runtime.stop(timeout=10)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
