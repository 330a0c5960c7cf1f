"""Request normalisation and validation (SGLang's GenerateReqInput.normalize_batch_and_arguments,
TokenizerManager._validate_one_request and SamplingParams.verify), as plain functions; the
sampling and token-id rules are meshlm.common.sampling_rules, shared with the scheduler.

A GenerateRequest becomes one `SubRequest` per output: prompt p, sample j -> index p*n + j, rid
`<rid>` when there is exactly one output, else `<rid>_<index>` (docs/ring.md "Identities").
Every problem raises `InvalidRequest`, whose message names the field and the limit; the size
limits of every message (meshlm.tokenizer.limits) are checked before any prompt is tokenized.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshlm.common import sampling_rules
from meshlm.tokenizer import limits
from meshlm.tokenizer.chat import ChatInputError, message_dict, template_variables
from meshlm.tokenizer.hf_tokenizer import ChatTemplateError, HFTokenizer
from meshlm.tokenizer.limits import InvalidRequest as InvalidRequest  # raised by every function here
from meshlm.tokenizer.limits import as_invalid_request
from meshlm.v1 import common_pb2, scheduler_pb2, tokenizer_pb2


@dataclass
class PromptInput:
    """One tokenized prompt."""

    index: int
    text: str
    input_ids: list[int]


@dataclass
class SubRequest:
    """One output of a GenerateRequest: what goes to a scheduler and how it maps back."""

    index: int  # prompt_index * n + sample_index
    prompt_index: int
    rid: str  # public id (MetaInfo.id); also the wire rid of the first attempt
    req: scheduler_pb2.TokenizedGenerateReqInput


@dataclass
class NormalizedGenerate:
    rid: str
    n: int
    prompts: list[PromptInput]
    subs: list[SubRequest]
    # One max_new_tokens=0 request per prompt (n>1 only), to warm the radix cache.
    warmups: list[SubRequest] = field(default_factory=list)


def new_rid() -> str:
    return uuid.uuid4().hex


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequest(message)


def tokenize_prompt(
    tok: HFTokenizer,
    prompt: tokenizer_pb2.Prompt,
    where: str,
    vocab_size: int,
    add_special_tokens: bool = True,
) -> tuple[str, list[int]]:
    """(input_text, input_ids) of one Prompt; `where` names it in errors (e.g. "prompts[2]")."""
    limits.check_prompt(prompt, where)
    kind = prompt.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(f"{where}: set exactly one of text, input_ids, messages")
    if kind == "text":
        _need(len(prompt.text) > 0, f"{where}.text is empty; a prompt needs at least 1 character")
        ids = tok.encode(prompt.text, add_special_tokens=add_special_tokens)
        _need(len(ids) > 0, f"{where}.text tokenizes to 0 tokens; a prompt needs at least 1 token")
        return prompt.text, ids
    if kind == "input_ids":
        ids = list(prompt.input_ids.ids)
        _need(len(ids) > 0, f"{where}.input_ids is empty; a prompt needs at least 1 token")
        check_token_ids(ids, f"{where}.input_ids", vocab_size)
        return "", ids
    msgs = prompt.messages
    _need(len(msgs.messages) > 0, f"{where}.messages is empty; a chat needs at least 1 message")
    for i, m in enumerate(msgs.messages):
        _need(
            bool(m.role),
            f"{where}.messages[{i}].role is empty; expected system, user, assistant or tool",
        )
    cont = msgs.continue_final_message
    add_gen = msgs.add_generation_prompt if msgs.HasField("add_generation_prompt") else not cont
    _need(
        not (cont and add_gen),
        f"{where}: continue_final_message and add_generation_prompt are not compatible (set one)",
    )
    _need(
        not cont or msgs.messages[-1].role == "assistant",
        f"{where}: continue_final_message needs an assistant message last",
    )
    try:
        text, ids = tok.chat_ids(
            [message_dict(m) for m in msgs.messages],
            add_generation_prompt=add_gen,
            continue_final_message=cont,
            **template_variables(msgs, where),
        )
    except ChatInputError as e:
        raise InvalidRequest(str(e)) from None
    except ChatTemplateError as e:
        raise InvalidRequest(f"{where}.messages: {e}") from e
    _need(len(ids) > 0, f"{where}.messages render to 0 tokens")
    return text, ids


def check_token_ids(ids: Sequence[int], where: str, vocab_size: int) -> None:
    """Every id in [0, vocab_size) (meshlm.common.sampling_rules); `where` names the list."""
    with as_invalid_request():
        sampling_rules.check_token_ids(ids, where, vocab_size)


def verify_sampling_params(sp: common_pb2.SamplingParams, vocab_size: int) -> None:
    """SGLang's SamplingParams.verify on the fields the request set: the rules of
    meshlm.common.sampling_rules, vocabulary checks included (the scheduler applies the same)."""
    values: dict[str, Any] = {fd.name: value for fd, value in sp.ListFields()}
    for name in ("stop", "stop_token_ids"):
        if name in values:
            values[name] = list(values[name])
    if "logit_bias" in values:
        values["logit_bias"] = dict(values["logit_bias"])
    with as_invalid_request():
        sampling_rules.check_sampling_params(values, vocab_size)


def normalize_generate(
    request: tokenizer_pb2.GenerateRequest,
    tok: HFTokenizer,
    *,
    origin: str,
    vocab_size: int,
    max_input_len: int = 0,
    warmup: bool = True,
    trace: common_pb2.TraceContext | None = None,
    created_time: float | None = None,
    rid: str | None = None,
) -> NormalizedGenerate:
    """Validate and tokenize a GenerateRequest; build one TokenizedGenerateReqInput per output.

    max_input_len: longest prompt the model accepts (0 = unknown; the scheduler checks).
    """
    limits.check_generate(request)
    _need(len(request.prompts) > 0, "prompts is empty; send at least 1 prompt")
    sp = request.sampling_params
    verify_sampling_params(sp, vocab_size)
    n = sp.n if sp.HasField("n") else 1
    _need(
        request.top_logprobs_num >= 0,
        f"top_logprobs_num must be >= 0, got {request.top_logprobs_num}",
    )
    _need(
        request.top_logprobs_num <= vocab_size,
        f"top_logprobs_num must be <= the vocabulary size {vocab_size}, got {request.top_logprobs_num}",
    )
    check_token_ids(request.token_ids_logprob, "token_ids_logprob", vocab_size)
    if request.HasField("logprob_start_len"):
        _need(
            request.logprob_start_len >= -1,
            f"logprob_start_len must be >= -1 (-1 = output tokens only), got {request.logprob_start_len}",
        )
    if request.session_id:
        _need(n == 1, f"sampling_params.n must be 1 in a session, got {n}")
        _need(
            len(request.prompts) == 1,
            f"a session request takes 1 prompt, got {len(request.prompts)}",
        )
    elif request.session_rid:
        raise InvalidRequest("session_rid needs session_id")

    rid = rid or request.rid or new_rid()
    created = time.time() if created_time is None else created_time
    prompts: list[PromptInput] = []
    for p, prompt in enumerate(request.prompts):
        text, ids = tokenize_prompt(tok, prompt, f"prompts[{p}]", vocab_size)
        if max_input_len and not request.session_id:
            _need(
                len(ids) <= max_input_len,
                f"prompts[{p}] has {len(ids)} tokens, longer than the model's context length allows "
                f"({max_input_len} input tokens at most)",
            )
        if request.return_logprob and request.HasField("logprob_start_len") and not request.session_id:
            _need(
                request.logprob_start_len < len(ids),
                f"logprob_start_len ({request.logprob_start_len}) must be < the number of prompt tokens "
                f"({len(ids)}) of prompts[{p}]",
            )
        prompts.append(PromptInput(p, text, ids))

    total = len(prompts) * n
    subs: list[SubRequest] = []
    for prompt in prompts:
        for j in range(n):
            index = prompt.index * n + j
            sub_rid = rid if total == 1 else f"{rid}_{index}"
            subs.append(
                SubRequest(
                    index,
                    prompt.index,
                    sub_rid,
                    _tokenized(request, prompt, sub_rid, origin, trace, created),
                )
            )
    warmups: list[SubRequest] = []
    if n > 1 and warmup:
        for prompt in prompts:
            wrid = f"{rid}_warmup_{prompt.index}"
            req = _tokenized(request, prompt, wrid, origin, trace, created)
            req.sampling_params.Clear()
            req.sampling_params.max_new_tokens = 0
            req.return_logprob = False
            req.logprob_start_len = -1
            req.top_logprobs_num = 0
            del req.token_ids_logprob[:]
            req.has_token_ids_logprob = False
            warmups.append(SubRequest(-1, prompt.index, wrid, req))
    return NormalizedGenerate(rid, n, prompts, subs, warmups)


def _tokenized(
    request: tokenizer_pb2.GenerateRequest,
    prompt: PromptInput,
    rid: str,
    origin: str,
    trace: common_pb2.TraceContext | None,
    created: float,
) -> scheduler_pb2.TokenizedGenerateReqInput:
    req = scheduler_pb2.TokenizedGenerateReqInput(
        rid=rid,
        origin=origin,
        input_text=prompt.text,
        input_ids=prompt.input_ids,
        return_logprob=request.return_logprob,
        logprob_start_len=request.logprob_start_len if request.HasField("logprob_start_len") else -1,
        top_logprobs_num=request.top_logprobs_num,
        token_ids_logprob=request.token_ids_logprob,
        has_token_ids_logprob=len(request.token_ids_logprob) > 0,
        # Always streamed inside the ring: the tokenizer buffers for non-stream callers, and the
        # deltas drive the inactivity deadline, TTFT/ITL metrics and the retry-if-nothing-yet rule.
        stream=True,
        session_id=request.session_id,
        session_rid=request.session_rid,
        created_time=created,
    )
    req.sampling_params.CopyFrom(request.sampling_params)
    # The fan-out happened here: each copy is one sample.
    req.sampling_params.ClearField("n")
    if trace is not None:
        req.trace.CopyFrom(trace)
    return req


def normalize_embed(
    request: tokenizer_pb2.EmbedRequest,
    tok: HFTokenizer,
    *,
    origin: str,
    vocab_size: int,
    max_input_len: int = 0,
    created_time: float | None = None,
    trace: common_pb2.TraceContext | None = None,
    rid: str | None = None,
) -> tuple[str, list[tuple[int, str, scheduler_pb2.TokenizedEmbeddingReqInput]]]:
    """(rid, [(index, sub rid, TokenizedEmbeddingReqInput)]) of an EmbedRequest."""
    limits.check_embed(request)
    _need(len(request.prompts) > 0, "prompts is empty; send at least 1 prompt")
    rid = rid or request.rid or new_rid()
    created = time.time() if created_time is None else created_time
    out = []
    for p, prompt in enumerate(request.prompts):
        text, ids = tokenize_prompt(tok, prompt, f"prompts[{p}]", vocab_size)
        if max_input_len:
            _need(
                len(ids) <= max_input_len,
                f"prompts[{p}] has {len(ids)} tokens, longer than the model's context length allows "
                f"({max_input_len} input tokens at most)",
            )
        sub_rid = rid if len(request.prompts) == 1 else f"{rid}_{p}"
        req = scheduler_pb2.TokenizedEmbeddingReqInput(
            rid=sub_rid, origin=origin, input_text=text, input_ids=ids, created_time=created
        )
        if trace is not None:
            req.trace.CopyFrom(trace)
        out.append((p, sub_rid, req))
    return rid, out


class DeltaTracker:
    """What one request has received, to drop or clip overlapping deltas (docs/ring.md: a
    detokenizer fail-over may resend text and ids the tokenizer already has)."""

    __slots__ = ("chars", "ids", "input_logprobs_seen")

    def __init__(self) -> None:
        self.chars = 0
        self.ids = 0
        self.input_logprobs_seen = False

    def clip_text(self, text: str, offset: int) -> str:
        """The part of `text` (starting at char `offset` of the output) not received yet."""
        end = offset + len(text)
        if end <= self.chars:
            return ""
        new = text[self.chars - offset :] if offset < self.chars else text
        self.chars = end
        return new

    def clip_ids(self, ids: Sequence[int], offset: int) -> tuple[list[int], int]:
        """(new ids, how many leading ids were dropped as already received)."""
        end = offset + len(ids)
        if end <= self.ids:
            return [], len(ids)
        skip = max(0, self.ids - offset)
        self.ids = end
        return list(ids[skip:]), skip
