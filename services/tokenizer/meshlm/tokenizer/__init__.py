"""meshlm.tokenizer: the tokenizer service (SGLang's TokenizerManager + meshlm's public gRPC API).

Never imports torch: tokenization uses the `tokenizers` library and chat templates are rendered
with jinja2 (hf_tokenizer.py). Entry point: `python -m meshlm.tokenizer [flags]` or
`meshlm.tokenizer.__main__.main(argv)`.
"""
