"""Helpers of the tokenizer contract tests: a tokenizer service on loopback with the real
detokenizer and scripted schedulers (tokenizer_fakes.FakeScheduler), prompts, waiting."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshlm.common.ports import free_port
from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.tokenizer.service import start_server
from meshlm.v1 import tokenizer_pb2, tokenizer_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from tokenizer_fakes import FakeScheduler

CODE = grpc.StatusCode


def text_prompt(s: str) -> tokenizer_pb2.Prompt:
    return tokenizer_pb2.Prompt(text=s)


def chat_prompt(*turns: tuple[str, str]) -> tokenizer_pb2.Prompt:
    return tokenizer_pb2.Prompt(
        messages=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role=r, content=c) for r, c in turns])
    )


@dataclass
class Ring:
    stub: tokenizer_pb2_grpc.TokenizerServiceStub
    channel: grpc.aio.Channel
    manager: Any
    server: Any
    schedulers: list
    tokens: list[int]

    async def generate(self, **kw) -> list[tokenizer_pb2.GenerateResponse]:
        return [r async for r in self.stub.Generate(tokenizer_pb2.GenerateRequest(**kw), timeout=20)]

    async def error(self, coro) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await coro
        return exc.value


async def gen_list(call):
    """All responses of a Generate call (read() style, so a call already read from works)."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


@contextlib.asynccontextmanager
async def ring(
    tok: HFTokenizer,
    *,
    schedulers: int = 1,
    detokenizer: bool = True,
    embedding: bool = False,
    **config: Any,
):
    """Real detokenizer + `schedulers` fake schedulers + the tokenizer server, on local ports."""
    from meshlm.detokenizer.config import DetokenizerConfig
    from meshlm.detokenizer.service import start_detokenizer

    tokens = tok.encode(" The capital of France is Paris.")
    detok = None
    if detokenizer:
        detok = await start_detokenizer(
            DetokenizerConfig(tokenizer_path=str(tok.path), host="127.0.0.1", port=0, grace_period_s=1.0)
        )
        detok_addr = f"127.0.0.1:{detok.port}"
    else:
        detok_addr = f"127.0.0.1:{free_port()}"
    fakes = [FakeScheduler(f"fake-{i}", detok_addr, tokens, tokenizer_path=str(tok.path)) for i in range(schedulers)]
    for f in fakes:
        f.is_generation = not embedding
    sched_addrs = [f"127.0.0.1:{await f.start()}" for f in fakes] or [f"127.0.0.1:{free_port()}"]
    cfg = TokenizerConfig(
        host="127.0.0.1",
        port=0,
        tokenizer_path=str(tok.path),
        scheduler_addrs=tuple(sched_addrs),
        detokenizer_addrs=(detok_addr,),
        connect_timeout_s=config.pop("connect_timeout_s", 3.0),
        **config,
    )
    running = await start_server(cfg, tokenizer=tok)
    server, manager = running.server, running.manager
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    r = Ring(tokenizer_pb2_grpc.TokenizerServiceStub(channel), channel, manager, server, fakes, tokens)
    try:
        yield r
    finally:
        await channel.close()
        await running.close()
        for f in fakes:
            await f.stop(0)
        if detok is not None:
            await detok.stop(0.5)


async def wait_for(pred, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def ring_ready(r: Ring) -> None:
    await wait_for(
        lambda: len(r.manager.schedulers.connected()) == len(r.schedulers) and r.manager.detokenizers.connected()
    )
