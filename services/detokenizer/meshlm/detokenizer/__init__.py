"""meshlm.detokenizer: SGLang's DetokenizerManager as a gRPC service.

Schedulers push one BatchTokenIDOut per engine step (`DetokenizerService.Push`); the detokenizer
turns each request's new token ids into a UTF-8-safe text delta (surround window, held-back
partial characters, stop trimming, skip_special_tokens) and streams the deltas, batched per
origin, to the tokenizer replica that owns each request (`DetokenizerService.Subscribe`).

Layout: `decoder` (tokenizer.json -> text), `incremental` (the per-request decode state machine,
no gRPC), `batches` (proto <-> plain values), `manager` (routing, holding, spans, metrics),
`service` (the thin gRPC servicer and `serve`), `config` (flags and env vars).

This package never imports torch.
"""
