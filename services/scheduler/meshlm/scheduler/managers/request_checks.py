"""RequestValidator: the checks a request passes before it is queued (SGLang's
handle_generate_request checks). Each error names the field and the limit; a request that
passes has max_new_tokens clamped to what the context and the KV pool can hold.

Used for new requests (InputHandler) and for requests a prefill scheduler hands over
(DecodeAdmission), so both are held to the same rules.
"""

from __future__ import annotations

from meshlm.scheduler.managers.io_struct import TokenizedGenerateReqInput
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.tokenizer_protocol import Tokenizer
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.sampling.sampling_params import SamplingParams


class RequestValidator:
    def __init__(self, model_config: ModelConfig, tokenizer: Tokenizer | None, max_req_len: int) -> None:
        """max_req_len: the most tokens (prompt + outputs) one request may hold."""
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_req_len = max_req_len
        self.eos_token_ids = frozenset(model_config.eos_token_ids)

    def new_req(self, recv: TokenizedGenerateReqInput, input_ids: list[int]) -> Req:
        """A Req for recv whose prompt is input_ids (a session turn's prompt differs from recv's);
        a migrated request (recv.resumed) starts with the outputs it already has."""
        req = Req(
            recv.rid,
            input_ids,
            recv.sampling_params,
            eos_token_ids=self.eos_token_ids,
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len,
            top_logprobs_num=recv.top_logprobs_num,
            token_ids_logprob=recv.token_ids_logprob,
            stream=recv.stream,
            origin_input_text=recv.input_text,
            session_id=recv.session_id,
        )
        if recv.resumed is not None:
            req.resume(recv.resumed)
        return req

    def new_embedding_req(self, rid: str, input_ids: list[int], input_text: str | None) -> Req:
        return Req(rid, input_ids, SamplingParams(max_new_tokens=0), is_embedding=True, origin_input_text=input_text)

    def too_long(self, n: int) -> str:
        """The error for an input of n > max_req_len tokens; names the input length, the
        model's context length and the most input tokens a request may hold."""
        return (
            f"The input ({n} tokens) is longer than the model's context length "
            f"({self.model_config.context_len} tokens; a request may hold at most {self.max_req_len} input tokens)."
        )

    def validate(self, req: Req) -> str | None:
        """None when req may run (its sampling params normalized, max_new_tokens clamped),
        else the error naming the field and its limit."""
        n = len(req.origin_input_ids)
        sp = req.sampling_params
        vocab = self.model_config.vocab_size
        if n == 0:
            return "input_ids must not be empty"
        if n > self.max_req_len:
            return self.too_long(n)
        if any(t < 0 or t >= vocab for t in req.origin_input_ids):
            return f"input_ids must be token ids in [0, {vocab})"
        try:
            sp.verify(vocab)
            sp.normalize(self.tokenizer)
        except ValueError as e:
            return str(e)
        if req.top_logprobs_num < 0:
            return f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}"
        for t in req.token_ids_logprob or ():
            if not 0 <= t < vocab:
                return f"token_ids_logprob must be in [0, {vocab}), got {t}"
        if req.return_logprob:
            if req.logprob_start_len == -1:
                req.logprob_start_len = n - 1
            if not 0 <= req.logprob_start_len < n:
                return f"logprob_start_len must be in [0, {n}) (the input length) or -1, got {req.logprob_start_len}"
        # Clamp max_new_tokens to what the context and the KV pool can hold.
        room = self.max_req_len - n
        sp.max_new_tokens = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        if sp.min_new_tokens > sp.max_new_tokens:
            sp.min_new_tokens = sp.max_new_tokens
        return self._check_resumed(req, sp.max_new_tokens) if req.resumed_tokens else None

    def _check_resumed(self, req: Req, max_new_tokens: int) -> str | None:
        """A migrated request's earlier outputs: valid ids, fewer than max_new_tokens, one
        logprob entry each when it wants logprobs, and no session."""
        k, vocab = req.resumed_tokens, self.model_config.vocab_size
        if req.session_id is not None:
            return "resumed (request migration) cannot continue a session turn"
        if any(t < 0 or t >= vocab for t in req.output_ids):
            return f"resumed.output_ids must be token ids in [0, {vocab})"
        if k >= max_new_tokens:
            return f"resumed.output_ids holds {k} tokens; it must hold fewer than max_new_tokens ({max_new_tokens})"
        if req.return_logprob and len(req.output_token_logprobs) != k:
            got = len(req.output_token_logprobs)
            return f"resumed.logprobs must hold one output_token_logprobs entry per resumed output id ({k}), got {got}"
        return None

    def validate_embedding(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "input must not be empty"
        if n > self.max_req_len:
            return self.too_long(n)
        return None
