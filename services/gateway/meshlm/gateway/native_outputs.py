"""SGLang-native response bodies: an output as {text, output_ids, meta_info[, index]} with
logprobs as [logprob, token_id, text] triples, and proto messages as plain dicts."""

from __future__ import annotations

from typing import Any

from meshlm.gateway.native_protocol import GenerateReqInput
from meshlm.gateway.outputs import Output, input_logprob_values
from meshlm.v1 import common_pb2


def _repeated(field: Any) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.28; `label` before
    return bool(is_repeated) if is_repeated is not None else field.label == field.LABEL_REPEATED


def proto_dict(message: Any) -> dict[str, Any]:
    """A shallow-recursive dict of a proto message (int64 stay ints, repeated become lists)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            value = [proto_dict(v) for v in value] if _repeated(field) else proto_dict(value)
        elif _repeated(field):
            value = list(value)
        out[field.name] = value
    return out


def _tuples(entries: list[common_pb2.TokenLogprob], values: list[float | None] | None, text: bool) -> list:
    values = values if values is not None else [e.logprob for e in entries]
    return [[values[i], e.token_id, (e.text if text else None)] for i, e in enumerate(entries)]


def _tops(positions: list[common_pb2.TopLogprobs], text: bool) -> list:
    return [_tuples(list(p.entries), None, text) if len(p.entries) else None for p in positions]


def native_output(out: Output, body: GenerateReqInput, with_index: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.id,
        "finish_reason": out.sglang_finish_reason(),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "num_retractions": out.retractions,
        "e2e_latency": out.e2e_latency,
    }
    if body.return_logprob:
        lp, text = out.logprobs, body.return_text_in_logprobs
        meta["input_token_logprobs"] = _tuples(
            lp["input_token_logprobs"], input_logprob_values(lp["input_token_logprobs"]), text
        )
        meta["output_token_logprobs"] = _tuples(lp["output_token_logprobs"], None, text)
        if body.top_logprobs_num:
            meta["input_top_logprobs"] = _tops(lp["input_top_logprobs"], text)
            meta["output_top_logprobs"] = _tops(lp["output_top_logprobs"], text)
        if body.token_ids_logprob:
            meta["input_token_ids_logprobs"] = _tops(lp["input_token_ids_logprobs"], text)
            meta["output_token_ids_logprobs"] = _tops(lp["output_token_ids_logprobs"], text)
    result: dict[str, Any] = {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta}
    if with_index:
        result["index"] = out.index
    return result
