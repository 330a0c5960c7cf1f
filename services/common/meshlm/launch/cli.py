"""The `meshlm` command.

meshlm launch [flags] [engine flags]
    Start gateway, tokenizer, scheduler and detokenizer as separate processes on loopback
    (the HTTP API on --port, the public gRPC API on --grpc-port); Ctrl-C stops them all.
    --api-key-file (or MESHLM_API_KEY) guards both APIs; the services get it by environment.
meshlm serve gateway|tokenizer|scheduler|detokenizer [flags]
    Run one component in this process (the container entrypoint); `--help` lists its flags
    (each also readable from MESHLM_<COMPONENT>_<FLAG> environment variables).
meshlm generate [engine flags] --prompt TEXT [--prompt TEXT ...]
    Complete prompts with an in-process engine (no services), printing throughput.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlm.launch.launcher import LaunchPlan

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain continuous batching in one sentence.",
)


def _generate(args: argparse.Namespace) -> int:
    from meshlm.scheduler.config import SchedulerConfig
    from meshlm.scheduler.engine import Engine

    config = SchedulerConfig.from_cli_args(args)
    with Engine(config) as engine:
        prompts = args.prompt or list(DEFAULT_PROMPTS)
        sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        reqs = []
        for p in prompts:
            ids = engine.tokenize(p) if args.raw else engine.apply_chat_template([{"role": "user", "content": p}])
            reqs.append({"input_ids": ids, "sampling_params": sp})
        t0 = time.perf_counter()
        results = engine.generate_batch_sync(reqs)
        elapsed = time.perf_counter() - t0
        tokens = 0
        for p, r in zip(prompts, results):
            tokens += len(r["output_ids"])
            print(f"### {p}\n{r['text']}\n")
        print(f"{len(prompts)} requests, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s)")
    return 0


COMPONENTS = ("gateway", "tokenizer", "scheduler", "detokenizer")
LAUNCH_ENV_PREFIX = "MESHLM_"  # `meshlm launch` reads MESHLM_API_KEY, MESHLM_INTERNAL_TOKEN_FILE, ...


def _engine_args(config: object) -> list[str]:
    """Engine flags that differ from their defaults, as scheduler command-line arguments."""
    import dataclasses

    from meshlm.common.flags import option

    out: list[str] = []
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if f.name in ("model_path", "tokenizer_path") or value == f.default:
            continue
        if isinstance(value, bool):
            out.append(option(f.name) if value else option("no_" + f.name))
        else:
            out += [option(f.name), str(value)]
    return out


def launch_plan(args: argparse.Namespace) -> LaunchPlan:
    """What `meshlm launch` starts, from its parsed flags."""
    from meshlm.common.auth import AuthConfig
    from meshlm.common.tls import TlsConfig
    from meshlm.launch import launcher
    from meshlm.scheduler.config import SchedulerConfig
    from meshlm.scheduler.model_loader import resolve_model_path

    config = SchedulerConfig.from_cli_args(args)
    try:
        tls = TlsConfig.from_cli_args(args)
        auth = AuthConfig.from_cli_args(args, public=True)
    except ValueError as e:
        raise SystemExit(f"meshlm launch: {e}") from None
    if config.disaggregation_mode != "null":
        raise SystemExit(
            "meshlm launch: use --decode-dp-size N for prefill/decode disaggregation "
            "(it sets each scheduler's --disaggregation-mode)"
        )
    model = resolve_model_path(config.model_path)
    tokenizer_args = ["--routing-policy", args.routing_policy, "--migration-limit", str(args.migration_limit)]
    if args.tokenizer_max_queued_requests is not None:
        tokenizer_args += ["--max-queued-requests", str(args.tokenizer_max_queued_requests)]
    gateway_args: list[str] = []
    if args.tool_call_parser:
        gateway_args += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        gateway_args += ["--reasoning-parser", args.reasoning_parser]
    if args.strict_api:
        gateway_args.append("--strict-api")
    return launcher.LaunchPlan(
        model_path=str(model),
        tokenizer_path=str(config.tokenizer_path or model),
        host=args.host,
        http_port=args.port,
        grpc_port=args.grpc_port,
        dp_size=args.dp_size,
        decode_dp_size=args.decode_dp_size,
        tokenizer_replicas=args.tokenizer_replicas,
        detokenizer_replicas=args.detokenizer_replicas,
        scheduler_args=tuple(_engine_args(config)),
        tokenizer_args=tuple(tokenizer_args),
        gateway_args=tuple(gateway_args),
        batch_relays=args.batch_relays,
        otlp_endpoint=args.otlp_endpoint,
        log_level=args.log_level,
        tls=tls,
        api_key=auth.api_key_value,
        internal_token=auth.internal_token_value,
    )


class StartupInterrupted(Exception):
    """SIGTERM arrived while the services were starting."""


def _interrupt_startup(signum: int, frame: object) -> None:
    raise StartupInterrupted(f"signal {signum} during start-up")


def _launch(args: argparse.Namespace) -> int:
    from meshlm.common.launcher_watch import LAUNCHER_PID_ENV
    from meshlm.launch.launcher import launch

    plan = launch_plan(args)
    # SIGTERM's default action would end this process at once and leave the services it has
    # started running (holding their ports); raised here, it unwinds launch(), which stops them.
    # (SIGINT already does: KeyboardInterrupt.)
    signal.signal(signal.SIGTERM, _interrupt_startup)
    # The services end with this process even if it is killed (common/launcher_watch.py). The
    # kernel watches the thread that started them: launch() runs on the main thread here. (Not
    # in launch() itself: a caller may start systems from worker threads that end long before.)
    try:
        system = launch(plan, env={LAUNCHER_PID_ENV: str(os.getpid())})
    except StartupInterrupted:
        print("meshlm: stopped during start-up", file=sys.stderr, flush=True)
        return 143
    print(f"meshlm is serving: HTTP {system.http_url}  gRPC {system.grpc_address}", flush=True)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stop["now"] and any(c.proc and c.proc.poll() is None for c in system.children):
            time.sleep(0.5)
    finally:
        system.stop()
    return 0


def _serve(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"meshlm.{args.component}.__main__")
    return int(module.main(args.component_args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description="meshlm: LLM inference as gRPC services")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="warning", help="logging level (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts with the in-process engine", parents=[common])
    from meshlm.common.auth import add_auth_cli_args
    from meshlm.common.tls import add_tls_cli_args
    from meshlm.launch.engine_flags import add_engine_flags

    add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three examples)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens per completion (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    gen.set_defaults(func=_generate)

    lau = sub.add_parser("launch", help="start all four services as processes on loopback", parents=[common])
    lau.add_argument("--host", default="127.0.0.1", help="address every service binds (default: 127.0.0.1)")
    lau.add_argument("--port", type=int, default=30000, help="HTTP port of the gateway (default: 30000)")
    lau.add_argument("--grpc-port", type=int, default=30001, help="public gRPC port of tokenizer 0 (default: 30001)")
    lau.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="schedulers (data-parallel replicas); several split the host's CPUs, "
        "OMP_NUM_THREADS = CPUs / schedulers each unless set (default: 1)",
    )
    lau.add_argument(
        "--decode-dp-size",
        type=int,
        default=0,
        help="prefill/decode disaggregation: start this many decode schedulers; the --dp-size "
        "schedulers become prefill schedulers that hand requests to them (default: 0, off)",
    )
    lau.add_argument("--tokenizer-replicas", type=int, default=1, help="tokenizer processes (default: 1)")
    lau.add_argument("--detokenizer-replicas", type=int, default=1, help="detokenizer processes (default: 1)")
    lau.add_argument("--routing-policy", default="round_robin", help="round_robin | shortest_queue")
    lau.add_argument(
        "--tokenizer-max-queued-requests",
        type=int,
        default=None,
        help="most requests in flight per tokenizer replica (its --max-queued-requests); more get HTTP 503 "
        "with Retry-After / RESOURCE_EXHAUSTED at once. The engine flag --max-queued-requests caps each "
        "scheduler's waiting queue the same way (default: the tokenizer's 4096)",
    )
    lau.add_argument(
        "--migration-limit",
        type=int,
        default=1,
        help="request migration: times a request may move to another scheduler when its scheduler is "
        "lost mid-decode, continuing from the tokens already streamed; 0 = off (default: 1)",
    )
    lau.add_argument(
        "--tool-call-parser",
        default=None,
        help="the gateway's tool-call parser for tool_choice auto: hermes | qwen25 | llama3_json | mistral | pythonic",
    )
    lau.add_argument("--reasoning-parser", default=None, help="the gateway's reasoning parser: deepseek-r1 | qwen3")
    lau.add_argument(
        "--strict-api", action="store_true", help="the gateway rejects request fields it does not support (400)"
    )
    lau.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry spans to this OTLP/gRPC endpoint")
    lau.add_argument(
        "--batch-relays",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the gateway, tokenizers and detokenizers under SCHED_BATCH, so their wake-ups do not "
        "preempt the scheduler's threads on the shared cores: +7-12%% tok/s at concurrency 64 on one "
        "2-core host, -3%% at concurrency 1 on another (default: off)",
    )
    add_tls_cli_args(lau, None)  # passed to all four services; the certificate must name --host
    # The API key guards the gateway and the tokenizers' gRPC API; the internal token (random
    # unless given) every link between the services. Children get both by environment, never argv.
    add_auth_cli_args(lau, LAUNCH_ENV_PREFIX, public=True)
    add_engine_flags(lau)
    lau.set_defaults(func=_launch)

    srv = sub.add_parser("serve", help="run one component (container entrypoint)", add_help=False)
    srv.add_argument("component", choices=COMPONENTS, help="which component to run")
    srv.add_argument("component_args", nargs=argparse.REMAINDER, help="the component's own flags (see --help)")
    srv.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from meshlm.common.grpc_env import prefer_classic_endpoints

    prefer_classic_endpoints()  # first: gRPC reads it when it loads; `launch`'s services inherit it
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "warning").upper()  # `serve` passes its flags to the component
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
