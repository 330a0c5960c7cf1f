"""The scheduler's parts put together over small CPU pools, without a model
(managers/scheduler_parts.py): prefill batching, retraction, aborts, and the package's rule of
no module-level mutable state (the radix cache's clock included)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import meshlm.scheduler.disaggregation as disaggregation_pkg
import meshlm.scheduler.managers as managers_pkg
import meshlm.scheduler.mem_cache as mem_cache_pkg
from meshlm.common.finish import AbortStatus
from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.managers.batch_log import BatchLog, PrefillCounts
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    PrefilledReq,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.managers.port import SchedulerPort
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.scheduler import Scheduler
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory
from meshlm.scheduler.managers.scheduler_parts import SchedulerParts
from meshlm.scheduler.mem_cache import (
    MHATokenToKVPool,
    RadixCache,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.sampling.sampling_params import SamplingParams

VOCAB = 1000
LAYERS, KV_HEADS, HEAD_DIM = 1, 1, 2


def model_config(context_len: int = 512) -> ModelConfig:
    return ModelConfig(
        path="tiny",
        architecture="LlamaForCausalLM",
        hidden_size=8,
        num_hidden_layers=LAYERS,
        num_attention_heads=1,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=16,
        vocab_size=VOCAB,
        context_len=context_len,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        is_embedding=False,
        eos_token_ids=(2,),
        hf={},
    )


def build(tokens: int, page: int, **config: Any) -> tuple[SchedulerParts, list[Any], list[Any]]:
    """Parts over a pool of `tokens` KV slots; returns them with the outputs and control
    replies the port sent."""
    cfg = SchedulerConfig(page_size=page, **config)
    rows = ReqToTokenPool(8, 512)
    alloc = TokenToKVPoolAllocator(tokens, page, debug=True)
    kv = MHATokenToKVPool(tokens, page, torch.float32, KV_HEADS, HEAD_DIM, LAYERS)
    memory = SchedulerMemory(
        req_to_token_pool=rows,
        allocator=alloc,
        kv_pool=kv,
        tree_cache=RadixCache(rows, alloc, page),
        max_total_num_tokens=alloc.size,
        max_running_requests=rows.size,
        vocab_size=VOCAB,
        device=torch.device("cpu"),
    )
    outputs: list[Any] = []
    controls: list[Any] = []
    parts = SchedulerParts.build(cfg, model_config(), None, SchedulerPort(outputs.append, controls.append), memory)
    return parts, outputs, controls


def req(rid: str, ids: list[int], max_new: int = 2) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new))


def prefill_directly(parts: SchedulerParts, reqs: list[Req], first_token: int = 7) -> None:
    """What a prefill step leaves behind, without a forward: rows and KV for each prompt,
    the prompt cached (and locked) in the tree, one output token; the requests decode."""
    tree = parts.memory.tree_cache
    for r in reqs:
        parts.prefill.match_prefix(r)
        tree.inc_lock_ref(r.last_node)
    batch = parts.memory.new_batch(reqs)
    batch.prepare_for_extend()
    for r in reqs:
        tree.cache_unfinished_req(r)
        r.output_ids.append(first_token)
    parts.state.running_batch.merge_batch(batch)


def finish_reasons(outputs: list[Any]) -> dict[str, Any]:
    return {d.rid: d.finish_reason for out in outputs if isinstance(out, BatchTokenIDOut) for d in out.deltas}


# ---- PrefillBatcher -----------------------------------------------------------------------------
def test_a_request_sharing_a_picked_prefix_waits_one_round_then_hits_the_cache() -> None:
    parts, _, _ = build(512, 1)
    shared = list(range(100, 140))
    a, b, c = req("a", shared + [1, 2]), req("b", shared + [3, 4]), req("c", list(range(300, 345)))
    parts.state.waiting_queue.extend([a, b, c])
    first = parts.prefill.get_new_batch_prefill()
    assert first is not None and first.reqs == [a, c] and first.pending_fb is not None
    assert parts.state.waiting_queue == [b]
    for r in first.reqs:  # the prefill ran: its prompts are in the tree
        parts.memory.tree_cache.cache_unfinished_req(r)
    second = parts.prefill.get_new_batch_prefill()
    assert second is not None and second.reqs == [b]
    assert b.cache_protected_len == len(shared) and parts.state.waiting_queue == []


def test_without_the_radix_cache_nothing_waits_for_a_shared_prefix() -> None:
    parts, _, _ = build(512, 1, disable_radix_cache=True)
    shared = list(range(100, 140))
    a, b = req("a", shared + [1]), req("b", shared + [2])
    parts.state.waiting_queue.extend([a, b])
    batch = parts.prefill.get_new_batch_prefill()
    assert batch is not None and batch.reqs == [a, b]


def test_a_long_prompt_is_chunked_and_continued_first() -> None:
    parts, _, _ = build(512, 4, chunked_prefill_size=16)
    long, short = req("long", list(range(10, 50))), req("short", list(range(60, 70)))
    parts.state.waiting_queue.extend([long, short])
    batch = parts.prefill.get_new_batch_prefill()
    assert batch is not None and batch.reqs == [long] and parts.state.chunked_req is long
    assert len(long.fill_ids) == 16 and batch.sampling_reqs == []
    parts.memory.tree_cache.cache_unfinished_req(long)
    nxt = parts.prefill.get_new_batch_prefill()
    assert nxt is not None and nxt.reqs[0] is long and len(long.fill_ids) == 32


def test_a_chunked_prompt_counts_once_and_its_own_chunks_are_not_cache_hits() -> None:
    parts, _, _ = build(512, 4, chunked_prefill_size=16)
    tree = parts.memory.tree_cache
    warm = req("warm", list(range(10, 18)) + [1])
    prefill_directly(parts, [warm])  # 8 prompt tokens of the next request are cached
    long = req("long", list(range(10, 50)))
    parts.state.waiting_queue.append(long)
    hits = []
    while True:
        batch = parts.prefill.get_new_batch_prefill()
        if batch is None:
            break
        hits.append(batch.cached_tokens)
        if long.is_chunked:
            tree.cache_unfinished_req(long, chunked=True)
        else:
            break
    assert hits == [8, 0, 0]  # 8 cached + 12, then 16, then the last 4 (after its own chunks)
    assert parts.stats.prompt_tokens == 40 and parts.stats.cached_tokens == 8
    assert long.cached_tokens == 8


def test_the_chunk_is_bounded_per_request_while_requests_decode() -> None:
    parts, _, _ = build(4096, 1, chunked_prefill_size=1024, prefill_chunk_per_req=32)
    budget = parts.prefill.chunk_budget
    assert budget(0, 1) == budget(0, 40) == 1024  # nothing running: the whole chunk (a lone prompt's TTFT)
    assert budget(2, 1) == 256 and budget(7, 1) == 256  # never under the floor
    assert budget(15, 1) == 512 and budget(30, 1) == 992  # 32 tokens per running or waiting request
    assert budget(4, 12) == 512  # a burst of arrivals widens the chunk
    assert budget(31, 1) == budget(64, 0) == budget(2, 62) == 1024  # never over --chunked-prefill-size
    off, _, _ = build(4096, 1, chunked_prefill_size=1024, prefill_chunk_per_req=0)
    assert off.prefill.chunk_budget(16, 1) == 1024
    small, _, _ = build(4096, 1, chunked_prefill_size=128)
    assert small.prefill.chunk_budget(2, 1) == 128  # a chunk size under the floor is kept as given


def test_a_prompt_arriving_while_requests_decode_is_prefilled_in_bounded_chunks() -> None:
    for mixed in (False, True):
        parts, _, _ = build(4096, 1, chunked_prefill_size=1024, enable_mixed_chunk=mixed)  # 64 per request
        running = [req(f"r{i}", list(range(10 + i, 20 + i)), max_new=50) for i in range(2)]
        prefill_directly(parts, running)
        long = req("long", list(range(100, 500)))
        parts.state.waiting_queue.append(long)
        batch = parts.prefill.get_new_batch_prefill()
        assert batch is not None and parts.state.chunked_req is long
        # 2 running: the 256-token floor; mixed, their two decode tokens count against it.
        assert len(long.fill_ids) == (254 if mixed else 256)
        alone, _, _ = build(4096, 1, chunked_prefill_size=1024, enable_mixed_chunk=mixed)
        long2 = req("long", list(range(100, 500)))
        alone.state.waiting_queue.append(long2)
        assert alone.prefill.get_new_batch_prefill() is not None
        assert alone.state.chunked_req is None and len(long2.fill_ids) == 400


# ---- BatchLog -----------------------------------------------------------------------------------
def test_batch_log_lines_count_the_prefill_and_decode_batches(caplog: pytest.LogCaptureFixture) -> None:
    parts, _, _ = build(512, 1, chunked_prefill_size=1024)
    running = [req(f"r{i}", list(range(10 + i, 20 + i)), max_new=50) for i in range(3)]
    prefill_directly(parts, running)  # 3 x 11 slots held (prompt + first token)
    waiting = [req("a", list(range(200, 230))), req("b", list(range(300, 340)))]
    parts.state.waiting_queue.extend(waiting)
    batch_log = BatchLog(parts.memory, parts.state, decode_log_interval=2)
    caplog.set_level(logging.INFO, logger="meshlm.scheduler")
    batch = parts.prefill.get_new_batch_prefill()  # mixed: the 3 running requests ride along
    assert batch is not None
    counts = PrefillCounts.of(batch, parts.state)
    assert counts == PrefillCounts(new_seqs=2, new_tokens=70, cached_tokens=0, mixed_decode=3, running=3)
    batch_log.prefill(counts, forward_s=0.25)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("Prefill batch. #new-seq: 2, #new-token: 70, #cached-token: 0, #mixed-decode: 3,")
    assert "#running-req: 3, #queue-req: 0, forward: 250 ms" in line
    used = parts.memory.num_used_tokens()
    assert f"token usage: {used / parts.memory.max_total_num_tokens:.2f}" in line

    caplog.clear()
    decode = parts.memory.new_batch(running)
    decode.prepare_for_decode()
    for _ in range(5):
        batch_log.decode(decode, forward_s=0.04)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # steps 2 and 4
    assert all(m.startswith("Decode batch. #running-req: 3, #token: ") for m in lines)
    assert all(m.endswith("#queue-req: 0, forward: 40 ms") for m in lines)

    caplog.clear()
    quiet = BatchLog(parts.memory, parts.state, decode_log_interval=0)
    for _ in range(5):
        quiet.decode(decode, forward_s=0.04)
    assert caplog.records == []
    with pytest.raises(ValueError, match="decode_log_interval must be >= 0, got -1"):
        BatchLog(parts.memory, parts.state, decode_log_interval=-1)


# ---- Retractor ----------------------------------------------------------------------------------
def test_retraction_frees_room_for_the_next_decode_step() -> None:
    parts, outputs, _ = build(16, 4)  # four pages: the two prompts fill them
    a, b = req("a", list(range(10, 18))), req("b", list(range(20, 28)))
    prefill_directly(parts, [a, b])
    running = parts.state.running_batch
    parts.retractor.update_running_batch(running)  # position 8 of each needs a fresh page
    assert running.reqs == [a] and running.pending_fb is not None
    assert parts.state.waiting_queue == [b] and b.retraction_count == 1 and b.req_pool_idx is None
    assert parts.stats.num_retracted == 1 and outputs == []
    # (1 output + 20 steps for the survivor) / (2 max new + 1), capped at 1.
    assert parts.state.new_token_ratio == 1.0


def test_a_lone_request_that_cannot_grow_ends_with_an_internal_error() -> None:
    parts, outputs, _ = build(8, 4)
    a = req("a", list(range(10, 18)))
    prefill_directly(parts, [a])
    parts.retractor.update_running_batch(parts.state.running_batch)
    assert parts.state.running_batch.is_empty() and parts.state.waiting_queue == []
    reason = finish_reasons(outputs)["a"]
    assert reason.status_code == AbortStatus.INTERNAL and "KV cache is too small" in reason.message
    parts.memory.check_idle()


def test_the_new_token_ratio_decays_per_decode_step_and_resets_when_idle() -> None:
    parts, _, _ = build(64, 1)
    start = parts.state.new_token_ratio
    prefill_directly(parts, [req("a", list(range(10, 18)), max_new=8)])
    parts.retractor.update_running_batch(parts.state.running_batch)
    assert parts.state.new_token_ratio == start - parts.retractor.new_token_ratio_decay
    parts.retractor.reset_new_token_ratio()
    assert parts.state.new_token_ratio == start


# ---- InputHandler -------------------------------------------------------------------------------
def generate(rid: str, ids: list[int], max_new: int | None = 4) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=SamplingParams(max_new_tokens=max_new))


def test_bad_requests_are_rejected_naming_the_field_and_good_ones_queued() -> None:
    parts, outputs, _ = build(64, 1)
    parts.inputs.process_input_requests(
        [
            generate("ok", [5, 6, 7], max_new=None),
            generate("empty", []),
            generate("vocab", [5, VOCAB]),
            generate("long", [5] * 64),
        ]
    )
    assert [r.rid for r in parts.state.waiting_queue] == ["ok"]
    # max_new_tokens is clamped to what the pool holds: 63 tokens a request, 3 of them prompt.
    assert parts.state.waiting_queue[0].sampling_params.max_new_tokens == 60
    reasons = finish_reasons(outputs)
    assert set(reasons) == {"empty", "vocab", "long"}
    assert "input_ids must not be empty" in reasons["empty"].message
    assert f"[0, {VOCAB})" in reasons["vocab"].message
    assert "(64 tokens)" in reasons["long"].message and all(r.status_code == 400 for r in reasons.values())


def test_an_abort_finds_requests_waiting_transferring_and_decoding() -> None:
    parts, outputs, controls = build(64, 1)
    decoding = req("job_1", list(range(10, 18)))
    prefill_directly(parts, [decoding])
    kv = torch.zeros(LAYERS, 2, 4, KV_HEADS, HEAD_DIM)
    parts.inputs.process_input_requests(
        [
            generate("job_0", [5, 6, 7]),
            generate("other", [5, 6, 8]),
            PrefilledReq(req=generate("job_2", [1, 2, 3, 4]), output_ids=[9], kv=kv),
        ]
    )
    assert len(parts.state.transfer_queue) == 1
    parts.inputs.process_input_requests([AbortReq(rid="job")])
    reasons = finish_reasons(outputs)
    assert {rid for rid, r in reasons.items() if r is not None} == {"job_0", "job_1", "job_2"}
    assert all(reasons[rid].status_code == AbortStatus.CANCELLED for rid in ("job_0", "job_1", "job_2"))
    assert [r.rid for r in parts.state.waiting_queue] == ["other"] and not parts.state.transfer_queue
    assert decoding.req_pool_idx is None  # its KV went back to the cache at once
    load = parts.inputs.get_load()
    assert load.num_running_reqs == 0 and load.num_queue_reqs == 1 and load.num_used_tokens == 0
    assert controls == []


def test_a_handed_over_kv_of_the_wrong_shape_is_rejected() -> None:
    parts, outputs, _ = build(64, 1)
    kv = torch.zeros(LAYERS, 2, 3, KV_HEADS, HEAD_DIM)  # the prompt has 4 tokens
    parts.inputs.process_input_requests([PrefilledReq(req=generate("p", [1, 2, 3, 4]), output_ids=[9], kv=kv)])
    assert not parts.state.transfer_queue
    assert "kv must have shape" in finish_reasons(outputs)["p"].message


# ---- shape rules --------------------------------------------------------------------------------
IMMUTABLE_CALLS = {"logging.getLogger", "tuple", "frozenset", "TypeVar"}


def _module_level_mutables(path: Path) -> list[str]:
    """Module-level assignments of mutable containers or of calls that may make one (a
    counter, a cache), and `global` statements."""
    tree = ast.parse(path.read_text())
    found = [f"{path.name}:{n.lineno} global" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is None:
            continue
        names = [ast.unparse(t) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
        if names == ["__all__"]:
            continue
        if (
            isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
            or isinstance(value, ast.Call)
            and ast.unparse(value.func) not in IMMUTABLE_CALLS
        ):
            found.append(f"{path.name}:{node.lineno} {names}")
    return found


def test_no_module_level_mutable_state_in_the_loop_and_caches() -> None:
    files = [
        p
        for pkg in (managers_pkg, mem_cache_pkg, disaggregation_pkg)
        for p in sorted(Path(pkg.__file__).parent.glob("*.py"))
    ]
    assert len(files) > 20
    assert [m for p in files for m in _module_level_mutables(p)] == []


def test_the_scheduler_has_no_mixins() -> None:
    assert Scheduler.__mro__ == (Scheduler, object)


def test_each_radix_cache_counts_its_own_accesses() -> None:
    """LRU order comes from a per-cache counter: the same operations give the same access
    times whatever other caches did meanwhile."""

    def run(other: RadixCache | None) -> list[int]:
        rows = ReqToTokenPool(4, 64)
        alloc = TokenToKVPoolAllocator(64, 1)
        cache = RadixCache(rows, alloc, 1)
        for key in ([1, 2, 3, 4], [1, 2, 9], [5, 6]):
            slots = alloc.alloc(len(key))
            assert slots is not None
            cache.insert(key, slots)
            if other is not None:
                other.match_prefix([1, 2, 3])
        cache.match_prefix([1, 2, 9])
        return sorted(n.last_access_time for n in cache._nodes())

    busy = RadixCache(ReqToTokenPool(4, 64), TokenToKVPoolAllocator(64, 1), 1)
    assert run(None) == run(busy)
