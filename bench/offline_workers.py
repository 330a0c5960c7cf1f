"""The measurements of bench_offline.py, each run in its own process: the meshlm engine
(continuous batching) or HF transformers generate (static batches), with wall time, CPU use, peak
RSS (and on CUDA peak GPU memory)."""

from __future__ import annotations

import json
import os
import random
import resource
import time
from typing import Any

TOKEN_LO = 100  # random ids are drawn from [TOKEN_LO, vocab - TOKEN_LO): no special tokens


def warmup_prompts(seed: int, vocab: int, count: int, length: int) -> list[list[int]]:
    """Distinct from every timed prompt's stream, so the radix cache gives the timed run nothing."""
    rng = random.Random(f"warmup-{seed}")
    return [[rng.randrange(TOKEN_LO, vocab - TOKEN_LO) for _ in range(length)] for _ in range(count)]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _cpu_s() -> tuple[float, float]:
    """(this process's CPU seconds, the whole machine's busy CPU seconds from /proc/stat)."""
    t = os.times()
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    return t.user + t.system, busy


def _cpu_delta(c0: tuple[float, float], elapsed: float) -> dict[str, float]:
    """Cores this process kept busy, and cores other processes took, over the timed phase."""
    c1 = _cpu_s()
    own, machine = c1[0] - c0[0], c1[1] - c0[1]
    return {"cpu_s": own, "own_cores": own / elapsed, "other_cores": max(machine - own, 0.0) / elapsed}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _sync(device) -> None:
    """Wait for queued GPU work, so wall time covers it (no-op on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_stats(device) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {}
    return {
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / (1 << 20),
        "gpu_name": torch.cuda.get_device_name(device),
    }


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from meshlm.scheduler.engine import Engine

    prompts, out_lens = spec["prompts"], spec["output_lens"]
    t_load = time.perf_counter()
    engine = Engine(
        model_path=spec["model_path"],
        dtype=spec["dtype"],
        device=spec.get("device", "auto"),
        max_total_tokens=spec["max_total_tokens"],
        max_running_requests=spec["max_running_requests"],
        random_seed=spec["seed"],
        load_progress=False,
        **spec.get("engine_args", {}),
    )
    load_s = time.perf_counter() - t_load
    try:

        def req(ids: list[int], n: int) -> dict[str, Any]:
            sp = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
            return {"input_ids": ids, "sampling_params": sp}

        # Warm-up: a short prefill + decode at a modest batch size; then drop its cached KV.
        warm = warmup_prompts(spec["seed"], spec["vocab"], min(8, len(prompts)), 32)
        engine.generate_batch_sync([req(w, 8) for w in warm])
        # Right after the last result the loop may still hold the finished batch for one
        # iteration (flush_cache refuses then), so retry briefly.
        for _ in range(100):
            flushed = engine.flush_cache()
            if flushed.success:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"flush_cache after warm-up failed: {flushed.message}")
        rss_before = _rss_mib()

        st = engine.scheduler.stats
        keys = (
            "decode_steps",
            "decode_forward_s",
            "decode_step_s",
            "generation_tokens",
            "num_retracted",
            "prompt_tokens",
            "cached_tokens",
        )
        s0 = {k: getattr(st, k) for k in keys}
        c0, t0 = _cpu_s(), time.perf_counter()
        results = engine.generate_batch_sync([req(p, n) for p, n in zip(prompts, out_lens)])
        elapsed = time.perf_counter() - t0
        cpu = _cpu_delta(c0, elapsed)
        # The last step's stats are recorded after its outputs went out: a control round trip
        # (answered at the top of the next loop iteration) makes sure they are in.
        engine.get_load()
        s1 = {k: getattr(st, k) for k in keys}
        d = {k: s1[k] - s0[k] for k in keys}
        got = [len(r["output_ids"]) for r in results]
        bad = [(i, g, n) for i, (g, n) in enumerate(zip(got, out_lens)) if g != n]
        if bad:
            raise RuntimeError(f"engine produced wrong output lengths (idx, got, want): {bad[:5]}")
        runner = engine.scheduler.tp_worker.model_runner
        return {
            "system": "ours",
            "device": str(runner.device),
            **_gpu_stats(runner.device),
            "elapsed_s": elapsed,
            **cpu,
            "useful_tokens": sum(out_lens),
            "load_s": load_s,
            "engine_args": spec.get("engine_args", {}),
            "attention_backend": type(runner.attn_backend).__name__,
            "graph_runner": type(runner.graph_runner).__name__ if runner.graph_runner is not None else None,
            "graph_replays": runner.graph_runner.num_replays if runner.graph_runner is not None else 0,
            "decode_steps": d["decode_steps"],
            "decode_forward_s": d["decode_forward_s"],
            "decode_step_s": d["decode_step_s"],
            "decode_tokens": d["generation_tokens"],
            "num_retracted": d["num_retracted"],
            "cached_tokens": d["cached_tokens"],
            "kv_pool_gib": runner.memory_report()["kv_pool_gib"],
            "max_total_tokens": runner.max_total_num_tokens,
            "max_running_requests": runner.max_running_requests,
            "rss_before_mib": rss_before,
            "peak_rss_mib": _peak_rss_mib(),
        }
    finally:
        engine.shutdown()


def worker_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from meshlm.scheduler.model_executor.model_runner import resolve_device
    from meshlm.scheduler.model_loader import resolve_model_path

    dtype = getattr(torch, spec["dtype"])
    device = resolve_device(spec.get("device", "auto"))
    path = str(resolve_model_path(spec["model_path"]))
    t_load = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:  # transformers 4
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    model.to(device).eval()
    _sync(device)
    load_s = time.perf_counter() - t_load
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id or 0)
    if isinstance(pad, list):
        pad = pad[0]
    bs = spec["batch_size"]

    def run_batch(prompts: list[list[int]], new: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
                use_cache=True,
            )
        made = out.shape[1] - width
        if made != new:
            raise RuntimeError(f"HF generated {made} tokens, wanted {new}")
        return made * len(prompts)

    warm = warmup_prompts(spec["seed"], spec["vocab"], bs, 32)
    run_batch(warm, 8)
    _sync(device)
    rss_before = _rss_mib()

    prompts, out_lens = spec["prompts"], spec["output_lens"]
    generated = 0
    c0, t0 = _cpu_s(), time.perf_counter()
    for s in range(0, len(prompts), bs):
        generated += run_batch(prompts[s : s + bs], max(out_lens[s : s + bs]))
    _sync(device)
    elapsed = time.perf_counter() - t0
    cpu = _cpu_delta(c0, elapsed)
    batches = [prompts[s : s + bs] for s in range(0, len(prompts), bs)]
    padded_in = sum(max(len(p) for p in b) * len(b) for b in batches)
    return {
        "system": "hf",
        "device": str(device),
        **_gpu_stats(device),
        "batch_size": bs,
        "elapsed_s": elapsed,
        **cpu,
        "useful_tokens": sum(out_lens),
        "load_s": load_s,
        "generated_tokens": generated,
        "input_tokens": sum(len(p) for p in prompts),
        "padded_input_tokens": padded_in,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "rss_before_mib": rss_before,
        "peak_rss_mib": _peak_rss_mib(),
    }


def worker_main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    res = worker_ours(spec) if spec["system"] == "ours" else worker_hf(spec)
    res["torch_threads"] = torch.get_num_threads()
    with open(out_path, "w") as f:
        json.dump(res, f)
