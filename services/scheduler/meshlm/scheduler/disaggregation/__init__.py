"""Prefill/decode disaggregation inside the scheduler loop (SGLang's disaggregation/ package,
over an in-memory handoff instead of an RDMA engine).

    prefill.py  PrefillHandoff: a prefill scheduler hands each prefilled request over
    decode.py   DecodeAdmission: a decode scheduler checks, queues and admits handed-over requests

The transport between the two (gRPC streams, KV chunking) is the service's:
meshlm/scheduler/service/handoff.py.
"""
