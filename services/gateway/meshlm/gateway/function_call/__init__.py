"""Tool calling: model-format parsers (one file per format, `registry.py` by name), the stream
of a choice's calls (`stream.py`) and the schemas of constrained tool_choice (`constrained.py`)."""
