"""meshlm.gateway: the HTTP front (OpenAI-compatible /v1/* and SGLang-native routes).

Holds no model and never imports torch or transformers: every request is answered by a
tokenizer replica over gRPC (meshlm.v1.TokenizerService).
"""
