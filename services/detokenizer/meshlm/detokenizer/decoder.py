"""Token ids -> text with the `tokenizers` library (a Hugging Face tokenizer.json), torch-free.

Invariants:
- `batch_decode(seqs, skip, spaces)` returns one string per sequence, exactly what Hugging Face's
  fast tokenizer returns for `decode(ids, skip_special_tokens=skip)`.
- Special tokens are the added tokens flagged special in tokenizer.json plus every special token
  that tokenizer_config.json / special_tokens_map.json declares (bos/eos/unk/pad/..., additional
  special tokens, added_tokens_decoder entries with special=true), as transformers registers them.
- `spaces_between_special_tokens` is part of the decode call (callers group requests by the flag
  pair), but a tokenizer.json tokenizer defines no separator around special tokens: like
  transformers' fast tokenizers (and so SGLang with them), the text is the same for both values.
- `token_texts(ids)` decodes each id on its own (special tokens kept), cached per id; an id
  outside the vocabulary decodes to "".
- Decoding raises OverflowError (or ValueError/TypeError) for ids that are not valid u32 values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import AddedToken, Tokenizer

from meshlm.common.tokenizer_files import read_json_object, token_content

_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
_LIST_KEYS = ("additional_special_tokens", "extra_special_tokens")
_TOKEN_TEXT_CACHE_MAX = 1 << 18


class TextDecoder(Protocol):
    """What the incremental detokenizer needs from a tokenizer."""

    def batch_decode(
        self,
        sequences: Sequence[Sequence[int]],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> list[str]: ...

    def token_texts(self, ids: Sequence[int]) -> list[str]: ...


def declared_special_tokens(config: dict[str, Any]) -> list[str]:
    """Every special token a tokenizer_config.json / special_tokens_map.json declares."""
    found: list[str] = []
    for key in _SPECIAL_KEYS:
        content = token_content(config.get(key))
        if content:
            found.append(content)
    for key in _LIST_KEYS:
        value = config.get(key)
        items: Iterable[Any] = value.values() if isinstance(value, dict) else (value or [])
        for item in items:
            content = token_content(item)
            if content:
                found.append(content)
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, dict) and entry.get("special") and isinstance(entry.get("content"), str):
            found.append(entry["content"])
    return list(dict.fromkeys(found))


class TokenizerDecoder:
    """A `TextDecoder` over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    @classmethod
    def from_path(cls, path: str | Path) -> TokenizerDecoder:
        """Load `<dir>/tokenizer.json` (or a tokenizer.json file) and register the special tokens
        that the directory's tokenizer_config.json and special_tokens_map.json declare."""
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(
                f"tokenizer_path {str(path)!r} has no tokenizer.json; expected a Hugging Face tokenizer "
                f"directory (with tokenizer.json) or the path of a tokenizer.json file"
            )
        tokenizer = Tokenizer.from_file(str(file))
        declared: list[str] = []
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            declared += declared_special_tokens(read_json_object(file.parent / name))
        already = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        missing = [
            AddedToken(c, special=True, normalized=False)
            for c in dict.fromkeys(declared)
            if c not in already and tokenizer.token_to_id(c) is not None
        ]
        if missing:
            tokenizer.add_special_tokens(missing)
        return cls(tokenizer)

    def batch_decode(
        self,
        sequences: Sequence[Sequence[int]],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> list[str]:
        if not sequences:
            return []
        return self.tokenizer.decode_batch([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        cache = self._token_text
        missing = list(dict.fromkeys(i for i in ids if i not in cache))
        if missing:
            if len(cache) + len(missing) > _TOKEN_TEXT_CACHE_MAX:
                cache.clear()
                missing = list(dict.fromkeys(ids))
            valid = [i for i in missing if i >= 0]
            cache.update(
                zip(
                    valid,
                    self.tokenizer.decode_batch([[i] for i in valid], skip_special_tokens=False),
                )
            )
            cache.update((i, "") for i in missing if i < 0)
        return [cache[i] for i in ids]
