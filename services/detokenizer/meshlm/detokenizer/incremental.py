"""Incremental, UTF-8-safe detokenization (SGLang's DetokenizerManager core), without gRPC.

Per request a `DecodeStatus` holds the ids seen so far (`decode_ids`: prompt tail, then output
ids) and a surround window `[surr_offset, read_offset)`. At each step, for the request's ids:

    surr_text = decode(ids[surr:read]); read_text = decode(ids[surr:])
    new_text  = read_text[len(surr_text):]

Unfinished and `new_text` non-empty without a trailing U+FFFD: commit (`decoded_text += new_text`,
`surr = read`, `read = len(ids)`). Otherwise only `find_printable_text(new_text)` is shown and
the offsets stay. On finish everything is flushed. The request's output text is
`decoded_text + new_text`, trimmed at a matched stop string (unless no_stop_trim); what goes out
is the part past `sent_offset`.

Invariants:
- `surr_offset <= read_offset <= len(decode_ids)`; `read_offset >= prompt_len`; both offsets sit
  on character boundaries once the first output has been committed.
- A delta's `text_offset` equals the sum of the lengths of the request's earlier deltas (the
  characters already sent), so a tokenizer can concatenate or de-duplicate by offset. The one
  exception is the final delta when a stop string that was partly streamed is trimmed: its
  `text_offset` is then smaller, and the full text is `sent[:text_offset] + text`.
- Unfinished deltas never contain U+FFFD produced by an incomplete character.
- A matched stop token (the last output id when the finish matched a token) is not decoded,
  unless no_stop_trim.
- A present seed resets the request: output ids restart at token offset 0 and text at offset 0.
- A request's state is deleted when it finishes; at most `max_states` states are kept (LRU).
- Requests of one step are decoded together, one `batch_decode` per (skip_special_tokens,
  spaces_between_special_tokens) pair; a request whose ids cannot be decoded fails alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshlm.detokenizer.decoder import TextDecoder

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
_MAX_LOST = 4096
_MAX_CHUNKS = 64

# CJK Unified Ideographs blocks (the ranges Hugging Face's TextStreamer treats as whole words).
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


def is_cjk_char(ch: str) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def find_printable_text(text: str) -> str:
    """The prefix of not-yet-committed text that is safe to show (Hugging Face TextStreamer rule):
    all of it after a trailing newline or CJK character, up to the last character when the one
    before it is CJK, otherwise up to and including the last space. Never past a U+FFFD."""
    cut = text.find(REPLACEMENT_CHAR)
    if cut >= 0:
        text = text[:cut]
    if text.endswith("\n"):
        return text
    if text and is_cjk_char(text[-1]):
        return text
    if len(text) > 1 and is_cjk_char(text[-2]):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


@dataclass(frozen=True)
class Seed:
    """Per-request decode parameters (the wire's DecodeSeed)."""

    prompt_tail_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    want_logprob_text: bool = False


@dataclass(slots=True)
class TokenDelta:
    """One request's entry of a step: new output ids starting at `token_offset` (a value: not
    changed after creation)."""

    rid: str
    ids: Sequence[int]
    token_offset: int = 0
    seed: Seed | None = None
    finished: bool = False
    matched_token: int | None = None
    matched_str: str | None = None


@dataclass(slots=True)
class TextDelta:
    """What one TokenDelta produced (a value). `ids`/`token_offset`: the output ids accepted (an overlap
    with ids already seen is clipped). `started`: this delta created or reset the state.
    `error`: the request's text cannot be produced (state lost, bad ids); finish it with it."""

    rid: str
    text: str
    text_offset: int
    ids: Sequence[int]
    token_offset: int
    seed: Seed
    finished: bool
    started: bool = False
    error: str | None = None


@dataclass(slots=True)
class DecodeStatus:
    """One request's decode state (see the module docstring for the offsets). The committed
    text is kept as chunks (`decoded_text` joins them) so a step costs O(new text), not
    O(text so far); `sent_offset >= decoded_len` between steps."""

    decode_ids: list[int]
    surr_offset: int
    read_offset: int
    seed: Seed
    prompt_len: int
    decoded_chunks: list[str] = field(default_factory=list)
    decoded_len: int = 0
    sent_offset: int = 0
    num_output_ids: int = 0

    @classmethod
    def from_seed(cls, seed: Seed) -> DecodeStatus:
        tail = list(seed.prompt_tail_ids)
        return cls(decode_ids=tail, surr_offset=0, read_offset=len(tail), seed=seed, prompt_len=len(tail))

    @property
    def decoded_text(self) -> str:
        if len(self.decoded_chunks) > 1:
            self.decoded_chunks[:] = ["".join(self.decoded_chunks)]
        return self.decoded_chunks[0] if self.decoded_chunks else ""

    def commit(self, text: str) -> None:
        """Append committed text and move the window past the ids decoded so far."""
        self.decoded_chunks.append(text)
        self.decoded_len += len(text)
        if len(self.decoded_chunks) > _MAX_CHUNKS:
            self.decoded_chunks[:] = ["".join(self.decoded_chunks)]
        self.surr_offset = self.read_offset
        self.read_offset = len(self.decode_ids)


@dataclass(slots=True)
class _Work:
    """A request being decoded in the current pass."""

    delta: TokenDelta
    status: DecodeStatus
    ids: Sequence[int]
    token_offset: int
    started: bool
    surr_ids: list[int] = field(default_factory=list)
    read_ids: list[int] = field(default_factory=list)
    surr_text: str = ""
    read_text: str = ""
    error: str | None = None


class IncrementalDetokenizer:
    """Decode states of all live requests, and the step function over them."""

    def __init__(
        self,
        decoder: TextDecoder,
        max_states: int = 65536,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if max_states < 1:
            raise ValueError(f"max_states must be >= 1, got {max_states}")
        self.decoder = decoder
        self.max_states = max_states
        self.on_evict = on_evict
        self._states: OrderedDict[str, DecodeStatus] = OrderedDict()
        self._lost: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: object) -> bool:
        return rid in self._states

    def status(self, rid: str) -> DecodeStatus | None:
        return self._states.get(rid)

    def drop(self, rid: str) -> None:
        self._states.pop(rid, None)

    def step(self, deltas: Sequence[TokenDelta]) -> list[TextDelta | None]:
        """Decode one step; the result is aligned with `deltas`. None: the delta is dropped
        (its request already failed with an error)."""
        results: list[TextDelta | None] = []
        start = 0
        while start < len(deltas):
            seen: set[str] = set()
            end = start
            while end < len(deltas) and deltas[end].rid not in seen:
                seen.add(deltas[end].rid)
                end += 1
            results += self._pass(deltas[start:end])
            start = end
        return results

    # ---- one pass: each rid at most once ---------------------------------------------------
    def _pass(self, deltas: Sequence[TokenDelta]) -> list[TextDelta | None]:
        out: list[TextDelta | None] = [None] * len(deltas)
        work: list[tuple[int, _Work]] = []
        for i, d in enumerate(deltas):
            item = self._prepare(d)
            if isinstance(item, _Work):
                work.append((i, item))
            else:
                out[i] = item
        self._decode([w for _, w in work])
        for i, w in work:
            out[i] = self._finish(w)
        return out

    def _prepare(self, d: TokenDelta) -> _Work | TextDelta | None:
        """Find or create the request's state and append the new ids (or fail the request)."""
        ids, offset, started = d.ids, d.token_offset, False
        if d.seed is not None:
            self._states.pop(d.rid, None)
            self._lost.pop(d.rid, None)
            if offset != 0:
                return self._fail(d, f"a seed restarts the output at token offset 0, got token offset {offset}")
            status, started = self._insert(d.rid, DecodeStatus.from_seed(d.seed)), True
        elif d.rid in self._states:
            status = self._states[d.rid]
            self._states.move_to_end(d.rid)
            expected = status.num_output_ids
            if offset > expected:
                return self._fail(d, f"token offset {offset} skips ids {expected}..{offset - 1} (never received)")
            if offset < expected:
                ids, offset = ids[expected - offset :], expected
        elif d.rid in self._lost:
            if d.finished:
                del self._lost[d.rid]
            return None
        elif offset == 0:
            status, started = self._insert(d.rid, DecodeStatus.from_seed(Seed())), True
        else:
            return self._fail(d, f"no decode state at token offset {offset} (evicted, or resent without a seed)")
        status.decode_ids.extend(ids)
        status.num_output_ids += len(ids)
        w = _Work(delta=d, status=status, ids=ids, token_offset=offset, started=started)
        end = len(status.decode_ids)
        if (
            d.finished
            and d.matched_token is not None
            and not status.seed.no_stop_trim
            and end - 1 >= status.read_offset
            and status.decode_ids[-1] == d.matched_token
        ):
            end -= 1
        w.surr_ids = status.decode_ids[status.surr_offset : status.read_offset]
        w.read_ids = status.decode_ids[status.surr_offset : end]
        return w

    def _insert(self, rid: str, status: DecodeStatus) -> DecodeStatus:
        self._states[rid] = status
        while len(self._states) > self.max_states:
            old, _ = self._states.popitem(last=False)
            logger.warning("decode state of request %s evicted (max_states=%d)", old, self.max_states)
            if self.on_evict is not None:
                self.on_evict(old)
        return status

    def _fail(self, d: TokenDelta, why: str) -> TextDelta:
        self._states.pop(d.rid, None)
        if not d.finished:
            self._lost[d.rid] = None
            while len(self._lost) > _MAX_LOST:
                self._lost.popitem(last=False)
        message = f"detokenizer cannot continue request {d.rid}: {why}"
        logger.error("%s", message)
        return TextDelta(
            rid=d.rid,
            text="",
            text_offset=0,
            ids=d.ids,
            token_offset=d.token_offset,
            seed=d.seed or Seed(),
            finished=True,
            error=message,
        )

    def _decode(self, work: list[_Work]) -> None:
        """Fill surr_text/read_text: one batch_decode per flag pair; on failure, one by one."""
        groups: dict[tuple[bool, bool], list[_Work]] = {}
        for w in work:
            key = (w.status.seed.skip_special_tokens, w.status.seed.spaces_between_special_tokens)
            groups.setdefault(key, []).append(w)
        for (skip, spaces), items in groups.items():
            seqs = [w.surr_ids for w in items] + [w.read_ids for w in items]
            try:
                texts = self.decoder.batch_decode(seqs, skip, spaces)
            except (OverflowError, ValueError, TypeError):
                for w in items:
                    self._decode_one(w, skip, spaces)
                continue
            n = len(items)
            for i, w in enumerate(items):
                w.surr_text, w.read_text = texts[i], texts[n + i]

    def _decode_one(self, w: _Work, skip: bool, spaces: bool) -> None:
        try:
            w.surr_text, w.read_text = self.decoder.batch_decode([w.surr_ids, w.read_ids], skip, spaces)
        except (OverflowError, ValueError, TypeError) as e:
            w.error = f"cannot decode its token ids ({type(e).__name__}: {e})"

    def _finish(self, w: _Work) -> TextDelta:
        d, s = w.delta, w.status
        if w.error is not None:
            return self._fail(d, w.error)
        base = s.decoded_len
        pending = w.read_text[len(w.surr_text) :]
        if not d.finished:
            if pending and not pending.endswith(REPLACEMENT_CHAR):
                s.commit(pending)
            else:
                pending = find_printable_text(pending)
            end = base + len(pending)
            text_offset = s.sent_offset
            text = pending[text_offset - base :]
            s.sent_offset = max(text_offset, end)
        elif d.matched_str and not s.seed.no_stop_trim:
            full = s.decoded_text + pending
            pos = full.find(d.matched_str)
            end = pos if pos >= 0 else len(full)
            text_offset = min(s.sent_offset, end)
            text = full[text_offset:end]
        else:
            end = base + len(pending)
            text_offset = min(s.sent_offset, end)
            text = pending[text_offset - base :]
        if d.finished:
            self._states.pop(d.rid, None)
        return TextDelta(
            rid=d.rid,
            text=text,
            text_offset=text_offset,
            ids=w.ids,
            token_offset=w.token_offset,
            seed=s.seed,
            finished=d.finished,
            started=w.started,
        )
