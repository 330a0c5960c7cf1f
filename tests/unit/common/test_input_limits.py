"""meshlm.common.input_limits: the one set of input limits (REST models, tokenizer, sampling rules)
and meshlm.common.grpc_decode: a request that does not parse is INVALID_ARGUMENT, not UNKNOWN."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from meshlm.common import input_limits as lim
from meshlm.common.grpc_server import GrpcServer
from meshlm.common.sampling_rules import RANGES
from meshlm.v1 import tokenizer_pb2, tokenizer_pb2_grpc


def test_wire_ranges_are_the_proto_types() -> None:
    assert (lim.INT32_MIN, lim.INT32_MAX) == (-(2**31), 2**31 - 1)
    assert (lim.INT64_MIN, lim.INT64_MAX) == (-(2**63), 2**63 - 1)
    import numpy as np

    assert float(np.finfo(np.float32).max) == lim.FLOAT32_MAX
    assert np.isfinite(np.float32(lim.FLOAT32_MAX))


def test_sampling_rules_use_the_limits() -> None:
    assert RANGES["n"].high == lim.MAX_N
    for name in ("max_new_tokens", "min_new_tokens", "top_k", "stream_interval"):
        assert RANGES[name].high == lim.INT32_MAX, name
    assert (RANGES["sampling_seed"].low, RANGES["sampling_seed"].high) == (lim.INT64_MIN, lim.INT64_MAX)


def test_checks_name_the_field_and_the_limit() -> None:
    lim.check_count("prompts", [1, 2], 2)
    with pytest.raises(lim.InvalidArgument, match=r"^prompts has 3 entries; at most 2 are allowed$"):
        lim.check_count("prompts", [1, 2, 3], 2)
    with pytest.raises(lim.InvalidArgument, match=r"^rid has 4 characters; at most 3 are allowed$"):
        lim.check_chars("rid", "abcd", 3)
    with pytest.raises(lim.InvalidArgument, match=r"^top_logprobs_num must be <= the vocabulary size 5, got 6$"):
        lim.check_at_most("top_logprobs_num", 6, 5, "the vocabulary size")
    with pytest.raises(lim.InvalidArgument, match=r"^x must be in \[0, 2\], got 3$"):
        lim.check_int_range("x", 3, 0, 2)
    assert issubclass(lim.InvalidArgument, ValueError)


def test_the_body_limit_fits_a_grpc_message() -> None:
    from meshlm.common.channels import MAX_MESSAGE_BYTES

    assert lim.MAX_REQUEST_BYTES < MAX_MESSAGE_BYTES


def test_no_torch_nor_protobuf() -> None:
    code = "import sys, meshlm.common.input_limits; assert not {'torch', 'google.protobuf'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


class _Echo(tokenizer_pb2_grpc.TokenizerServiceServicer):
    async def Detokenize(self, request, context):
        return tokenizer_pb2.DetokenizeResponse(text=",".join(map(str, request.tokens)))

    async def Generate(self, request, context):
        yield tokenizer_pb2.GenerateResponse(text=request.rid)


def test_undecodable_requests_are_invalid_argument() -> None:
    async def main() -> list[tuple[grpc.StatusCode, str]]:
        server = GrpcServer(["meshlm.v1.TokenizerService"], "127.0.0.1", 0)
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(_Echo(), server.server)
        port = await server.start()
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                raw = channel.unary_unary("/meshlm.v1.TokenizerService/Detokenize")
                stream = channel.unary_stream("/meshlm.v1.TokenizerService/Generate")
                ok = tokenizer_pb2.DetokenizeRequest(tokens=[1, 2]).SerializeToString()
                reply = tokenizer_pb2.DetokenizeResponse.FromString(await raw(ok))
                out.append((grpc.StatusCode.OK, reply.text))
                for call, body in ((raw, b"\xff\xff\xff"), (stream, b"\x0a\x02\xff\xfe")):  # corrupt; bad UTF-8
                    try:
                        if call is stream:
                            async for _ in call(body):
                                pass
                        else:
                            await call(body)
                        out.append((grpc.StatusCode.OK, ""))
                    except grpc.aio.AioRpcError as e:
                        out.append((e.code(), e.details()))
                good = tokenizer_pb2.GenerateRequest(rid="r1").SerializeToString()
                texts = [tokenizer_pb2.GenerateResponse.FromString(m).text async for m in stream(good)]
                out.append((grpc.StatusCode.OK, ",".join(texts)))
        finally:
            await server.stop(0)
        return out

    ok, corrupt, bad_utf8, streamed = asyncio.run(main())
    assert ok == (grpc.StatusCode.OK, "1,2")
    assert corrupt[0] == grpc.StatusCode.INVALID_ARGUMENT and "Detokenize" in corrupt[1], corrupt
    assert bad_utf8[0] == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in bad_utf8[1], bad_utf8
    assert streamed == (grpc.StatusCode.OK, "r1")
