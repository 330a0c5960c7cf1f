"""The scheduler loop and its parts (SGLang's managers/).

    scheduler.py          Scheduler: the loop (event_loop_normal, get_next_batch_to_run, run_batch)
    scheduler_parts.py    SchedulerParts: each part below, constructed with what it needs
    scheduler_state.py    SchedulerState: waiting queue, running batch, chunked req, last batch
    scheduler_memory.py   SchedulerMemory: request rows, KV pool, allocator, prefix cache
    input_handler.py      InputHandler: requests, aborts, sessions, flush, load reports
    request_checks.py     RequestValidator: checks naming the field and the limit
    prefill_batcher.py    PrefillBatcher: get_new_batch_prefill (chunking, mixed chunk, in-batch sharing)
    retraction.py         Retractor: update_running_batch, retract_decode, new_token_ratio
    output_processor.py   OutputProcessor: process_batch_result_*, check_finished, stream_output
    schedule_batch.py     ScheduleBatch: KV allocation, prepare_for_extend / decode, mix, filter / merge
    schedule_policy.py    SchedulePolicy (fcfs, lpm), PrefillAdder budgets
    req.py                Req
    session_controller.py SessionController: multi-turn sessions
    tp_worker.py          TpModelWorker: forward + sampling of one batch
    io_struct.py          the messages in and out; port.py: SchedulerPort (queue in, callbacks out)
    scheduler_stats.py    SchedulerStats; tokenizer_protocol.py: what the loop uses of a tokenizer

Prefill/decode disaggregation's two halves are in meshlm.scheduler.disaggregation.
"""
