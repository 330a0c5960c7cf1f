#!/usr/bin/env python
"""The CPU model kernels (--fused-ops auto: oneDNN-prepacked linears + fused C elementwise ops +
the decode kernel's fused KV store) against plain eager torch (--fused-ops torch), same weights,
same process, interleaved runs, on the default SmolLM2-135M.

    python bench/bench_cpu_kernels.py                       # decode at batch 1, 16, 64 (ctx 320); prefill 512
    python bench/bench_cpu_kernels.py --threads 1 --batches 1,64 --context 1024

Prints, per shape, the median forward time of each and the ratio auto / torch (lower is
better), the largest logit difference between the two and whether their argmax tokens agree;
for decode shapes also the time of the auto runner's linear layers alone (every linear of the
model and the LM head once, on rows of that batch size) and forward / linears, the share of a
decode step that is not GEMM.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from meshlm.scheduler.model_executor.model_runner import ModelRunner
from meshlm.scheduler.model_loader import resolve_model_path


def decode_batch(runner: ModelRunner, b: int, ctx: int) -> ForwardBatch:
    """b requests of ctx cached tokens each (rows 0..b-1 of the table, slots laid out per row),
    decoding one token: positions ctx, new slot = table[row, ctx]."""
    table = runner.req_to_token_pool.req_to_token
    rows = torch.arange(b)
    ids = torch.randint(100, 4000, (b,), generator=torch.Generator().manual_seed(b))
    return ForwardBatch(
        ForwardMode.DECODE,
        b,
        ids,
        torch.full((b,), ctx),
        torch.full((b,), ctx + 1),
        rows,
        table[rows, ctx].clone(),
        seq_lens_cpu=[ctx + 1] * b,
    )


def prefill_batch(runner: ModelRunner, n: int) -> ForwardBatch:
    """One request of n fresh tokens in row 0."""
    table = runner.req_to_token_pool.req_to_token
    ids = torch.randint(100, 4000, (n,), generator=torch.Generator().manual_seed(n))
    return ForwardBatch(
        ForwardMode.EXTEND,
        1,
        ids,
        torch.arange(n),
        torch.tensor([n]),
        torch.tensor([0]),
        table[0, :n].clone(),
        seq_lens_cpu=[n],
        extend_prefix_lens_cpu=[0],
        extend_seq_lens_cpu=[n],
    )


def linears_ms(runner: ModelRunner, rows: int, repeats: int) -> float:
    """Median time of one pass over every linear layer (and the LM head) at `rows` rows."""
    mods: list[tuple[Any, int]] = []
    for m in runner.model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            mods.append((m, m.packed.in_features if m.packed is not None else m.weight.shape[1]))
    head = runner.model.logits_processor.packed_head
    if head is not None:
        mods.append((head, head.in_features))
    xs = {k: torch.randn(rows, k).to(runner.dtype) for k in {k for _, k in mods}}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for m, k in mods:
                m(xs[k])
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64", help="decode batch sizes (default 1,16,64)")
    ap.add_argument("--context", type=int, default=320, help="cached tokens per decoding request (default 320)")
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prefill case; 0 skips it (default 512)")
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per system and shape (default 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model-path", default=None, help="HF dir or .gguf (default: packaged SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | auto (default float32)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    path = resolve_model_path(args.model_path)
    mc = ModelConfig.from_path(path)
    slots = max(max(batches) * (args.context + 4), args.prefill) + 64
    runners = {
        mode: ModelRunner(
            mc,
            SchedulerConfig(
                model_path=str(path), dtype=args.dtype, fused_ops=mode, max_total_tokens=slots, load_progress=False
            ),
        )
        for mode in ("torch", "auto")
    }
    for r in runners.values():  # request b's tokens in slots b*(ctx+4) + [0, ctx]
        table = r.req_to_token_pool.req_to_token
        for b in range(max(batches)):
            table[b, : args.context + 1] = torch.arange(
                b * (args.context + 4), b * (args.context + 4) + args.context + 1
            )
        if args.prefill:
            table[0, : args.prefill] = torch.arange(args.prefill)
    cases = [(f"decode b={b} ctx={args.context}", lambda r, b=b: decode_batch(r, b, args.context)) for b in batches]
    if args.prefill:
        cases.append((f"prefill {args.prefill} tokens", lambda r: prefill_batch(r, args.prefill)))
    dtype = runners["auto"].dtype
    print(f"threads={torch.get_num_threads()}, {str(dtype).removeprefix('torch.')}, {path.name}")
    print(
        f"{'shape':28s} {'torch ms':>9s} {'auto ms':>9s} {'auto/torch':>10s} {'max|dlogit|':>11s} {'argmax':>7s}"
        f" {'linears ms':>10s} {'auto/linears':>12s}"
    )
    for name, make in cases:
        logits = {m: r.forward(make(r)).next_token_logits for m, r in runners.items()}
        times: dict[str, list[float]] = {m: [] for m in runners}
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            for m, r in runners.items():
                fb = make(r)
                t0 = time.perf_counter()
                r.forward(fb)
                times[m].append(time.perf_counter() - t0)
        med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
        diff = float((logits["torch"] - logits["auto"]).abs().max())
        agree = float((logits["torch"].argmax(-1) == logits["auto"].argmax(-1)).float().mean())
        lin = ""
        if name.startswith("decode"):
            ms = linears_ms(runners["auto"], int(name.split("b=")[1].split()[0]), args.repeats)
            lin = f" {ms:10.1f} {med['auto'] / ms:12.2f}"
        print(
            f"{name:28s} {med['torch']:9.1f} {med['auto']:9.1f} {med['auto'] / med['torch']:10.2f} "
            f"{diff:11.2e} {agree:7.0%}{lin}",
            flush=True,
        )


if __name__ == "__main__":
    main()
