"""Reasoning: splitting a model's thinking from its answer (`parser.py`; styles by name in
`registry.py`), for message.reasoning_content and delta.reasoning_content."""
