"""The `meshlm` command.

    meshlm generate [engine flags] --prompt TEXT [--prompt TEXT ...]
        Load the model into an in-process engine and complete the prompts (chat-templated
        unless --raw), printing each completion and the throughput.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional, Sequence

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description="meshlm: LLM inference as gRPC services")
    parser.add_argument("--log-level", default="warning", help="logging level (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts with the in-process engine")
    from meshlm.launch.engine_flags import add_engine_flags

    add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three examples)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens per completion (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
