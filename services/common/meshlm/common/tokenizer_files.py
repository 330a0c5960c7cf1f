"""Reading an HF tokenizer directory without transformers: the pieces every service shares.

The tokenizer service (chat templates, encoding), the detokenizer (incremental decoding) and the
scheduler (stop strings, sessions) each read the same directory with the `tokenizers` library;
the rules that must agree between them live here: how tokenizer.json is opened (padding and
truncation off, as transformers leaves them unless a call asks), how a special-token entry of
tokenizer_config.json / special_tokens_map.json is read, and transformers'
clean_up_tokenization.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# transformers' clean_up_tokenization (applied on decode when the config asks for it).
CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_tokenization(text: str) -> str:
    for a, b in CLEANUPS:
        text = text.replace(a, b)
    return text


def token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else None


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when the file is missing or holds another JSON value
    (a malformed file raises json.JSONDecodeError)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def open_tokenizer_json(directory: Path) -> Tokenizer:
    """directory/tokenizer.json with padding and truncation off (BERT exports pad to 128;
    transformers turns both off unless a call asks for them, and length limits are ours).
    Raises FileNotFoundError naming tokenizer_path when the file is missing."""
    from tokenizers import Tokenizer

    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"tokenizer_path {str(directory)!r} has no tokenizer.json")
    tok = Tokenizer.from_file(str(tok_file))
    tok.no_padding()
    tok.no_truncation()
    return tok
