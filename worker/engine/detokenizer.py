"""Incremental detokenization and stop strings, per request.

Each step decodes a short window of token ids twice, without and with the new tokens, and
emits the difference (the approach of vLLM's `detokenize_incrementally`, TGI and HF's
TextStreamer), so the cost per token does not grow with the output. The window starts a few
tokens before the text still to be read, because tokenizers render a token differently at the
start of a text (SentencePiece drops the leading space) than in context.

A byte-level BPE tokenizer (GPT-2's scheme, used by Llama 3, Qwen, SmolLM2 and the built-in
model) renders a token the same wherever it stands: its text is the UTF-8 decoding of the
concatenated bytes of the tokens. For those the bytes of every id are tabled once (from the
tokenizer's own vocabulary, checked against its `decode` id by id) and a step is a table lookup
fed to an incremental UTF-8 decoder, which holds back a character split across tokens and
renders invalid bytes as U+FFFD as `decode` does: about a tenth of the two decode calls.
"""

from __future__ import annotations

import codecs
import functools
import weakref
from collections.abc import Sequence

from worker.sampling_params import SamplingParams

# Prompt tokens decoded before the first output token, for context (as vLLM does).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas and watches for stop strings.

    `text` is everything decoded so far (cut at a matched stop string); `step` returns the part
    of it that is safe to show: it holds back an incomplete trailing UTF-8 character and the
    longest tail that could still begin a stop string (at most max(len(stop)) - 1 characters).
    Call `flush` when the request ends for another reason (EOS, length) to get what was held.

    With `tokenizer=None` (token ids only), text stays empty and stop strings never match.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_ids = None if tokenizer is None else _decoder(tokenizer)
        # byte-level tokenizers: each id's bytes and whole text, and a UTF-8 decoder for bytes
        tables = (None, None) if tokenizer is None else _tables(tokenizer, skip_special_tokens)
        self._bytes, self._texts = tables
        self._utf8 = None if self._bytes is None else _UTF8(errors="replace")
        self._params = params
        self._skip_special = skip_special_tokens
        # Ids of the decode window: a little prompt context, then the output.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0  # window start: decoded only for context
        self._read_offset = len(context)  # ids before this are already in `_pieces`
        self._pieces: list[str] = []  # decoded output text, in order
        self._unsent = ""  # tail of the text not yet returned by step(); bounded
        # the stop string that ended the output, once it appears in the text
        self.stop_matched: str | None = None
        self._finished = False
        self._num_output = 0  # output tokens seen: stop strings count after params.min_tokens

    @property
    def text(self) -> str:
        """Output text so far; cut before a matched stop (after it with include_stop_str)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]  # join once; later calls reuse it
        return self._pieces[0] if self._pieces else ""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text that is safe to emit (possibly "")."""
        if self._finished or self._tokenizer is None:
            return ""
        self._num_output += len(new_token_ids)
        if self._bytes is not None:
            new_text = self._decode_bytes(new_token_ids)
            if not self._params.stop:  # nothing to hold back: the new text, and any unsent
                if new_text:
                    self._pieces.append(new_text)
                if self._unsent:  # (after a resume)
                    new_text, self._unsent = self._unsent + new_text, ""
                return new_text
            self._append(new_text)
        else:
            self._ids.extend(new_token_ids)
            self._append(self._decode_new())
        if self.stop_matched is not None:
            return self._take(hold=0)
        return self._take(hold=self._stop_prefix_len())

    def step_one(self, token_id: int) -> str:
        """`step([token_id])`: the engine's call for every request at every step, which a
        byte-level tokenizer without stop strings answers from its table alone."""
        texts = self._texts
        if texts is None or self._params.stop or self._unsent or self._finished:
            return self.step((token_id,))
        self._num_output += 1
        utf8 = self._utf8
        # a whole token's text as it is, unless a character's first bytes wait in the decoder
        text = texts[token_id] if 0 <= token_id < len(texts) and not utf8.buffer else None
        if text is None:
            text = utf8.decode(self._bytes[token_id] if 0 <= token_id < len(texts) else b"")
        if text:
            self._pieces.append(text)
        return text

    def resume(self, token_ids: Sequence[int], text_sent: int) -> None:
        """Continue an output that another detokenizer started: `token_ids` were generated and
        the first `text_sent` characters of their text shown. What was held back (an incomplete
        character, the start of a possible stop string) is unsent again, and stop strings are
        matched over the whole output from here on. Fed one token at a time, as the first one
        was, so that its decode window (which waits out a character split across tokens) ends
        where the first one's did."""
        for token_id in token_ids:
            self.step([token_id])
        if self._tokenizer is not None and self.stop_matched is None:
            self._unsent = self.text[text_sent:]

    def flush(self) -> str:
        """End the request: return everything held back, including an incomplete character."""
        if self._finished or self._tokenizer is None:
            self._finished = True
            return ""
        if self._utf8 is not None:  # an incomplete character at the end becomes U+FFFD
            self._append(self._utf8.decode(b"", final=True))
        elif self._read_offset < len(self._ids):
            # Still incomplete at the end: emit it as decode() renders it (with U+FFFD).
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self._read_offset = len(self._ids)
            self._append(full[len(prefix) :])
        delta = self._take(hold=0)
        self._finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self._skip_special)

    def _decode_bytes(self, ids: Sequence[int]) -> str:
        table, n = self._bytes, len(self._bytes)
        if len(ids) == 1:
            i = ids[0]
            return self._utf8.decode(table[i] if 0 <= i < n else b"")
        return self._utf8.decode(b"".join(table[i] if 0 <= i < n else b"" for i in ids))

    def _decode_new(self) -> str:
        """Text added by the ids after `_read_offset`; "" while the tail is incomplete."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet, or the last character's bytes are still arriving: keep the
            # window and decode it again with the next tokens.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the id list bounded: drop what is left of the window.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return full[len(prefix) :]

    def _append(self, new_text: str) -> None:
        """Add decoded text and cut it at the earliest stop string, if one completes."""
        if not new_text:
            return
        self._unsent += new_text
        self._pieces.append(new_text)
        if self._num_output <= self._params.min_tokens:
            return  # as vLLM: stop strings are looked for only after min_tokens tokens
        cut = self._find_stop()
        if cut is None:
            return
        stop, end = cut
        self.stop_matched = stop
        removed = len(self._unsent) - end
        self._unsent = self._unsent[:end]
        self._trim_pieces(removed)

    def _find_stop(self) -> tuple[str, int] | None:
        """The earliest stop string in the unsent text and where the text ends, or None.

        Any occurrence lies entirely in `_unsent`: step() never sends a tail that could still
        begin a stop string.
        """
        best: tuple[int, str] | None = None
        for stop in self._params.stop:
            at = self._unsent.find(stop)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        end = at + len(stop) if self._params.include_stop_str_in_output else at
        return stop, end

    def _trim_pieces(self, n: int) -> None:
        """Remove the last n characters of the text."""
        while n > 0:
            last = self._pieces.pop()
            if len(last) > n:
                self._pieces.append(last[:-n])
            n -= len(last)

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string.

        A tail that begins a stop starts with the stop's first character, so only those
        positions are tried, earliest (longest tail) first: a step costs about one `find` per
        stop string, not one comparison per tail length."""
        unsent, longest = self._unsent, 0
        n = len(unsent)
        for stop in self._params.stop:
            at = unsent.find(stop[0], max(n - len(stop) + 1, 0))
            while at != -1 and n - at > longest:
                if stop.startswith(unsent[at:]):
                    longest = n - at
                    break
                at = unsent.find(stop[0], at + 1)
        return longest

    def _take(self, hold: int) -> str:
        """Return the unsent text except its last `hold` characters."""
        cut = len(self._unsent) - hold
        delta, self._unsent = self._unsent[:cut], self._unsent[cut:]
        if self.stop_matched is not None:
            self._finished = True
        return delta


def _decoder(tokenizer):
    """`tokenizer.decode`, or for a list of ints the method it ends in (`_decode`) when the
    class keeps transformers' `decode`: that one first converts its input to Python objects,
    checking every id's type, twice per generated token here (most of a decode step's own time
    with hundreds of requests running). The same text either way."""
    decode = getattr(type(tokenizer), "decode", None)
    if decode is not None and decode is _base_decode() and hasattr(tokenizer, "_decode"):
        return tokenizer._decode
    return tokenizer.decode


@functools.cache
def _base_decode():
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # (transformers absent: a tokenizer of another kind)
        return None
    return PreTrainedTokenizerBase.decode


_UTF8 = codecs.getincrementaldecoder("utf-8")
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {skip: tables}


def byte_table(tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    """The bytes of every id of a byte-level BPE tokenizer (b"" for a special token skipped),
    such that `decode(ids)` is the lossy UTF-8 decoding of their concatenation; None for
    another kind of tokenizer, or one whose `decode` of some id says otherwise. Made once per
    tokenizer and flag."""
    return _tables(tokenizer, skip_special_tokens)[0]


def _tables(tokenizer, skip_special: bool) -> tuple[list[bytes] | None, list[str | None] | None]:
    """(byte table, each id's text where its bytes are whole UTF-8 on their own, else None) of
    a tokenizer and flag, made once (kept per tokenizer where it can be weakly referenced)."""
    try:
        per_flag = _TABLES.setdefault(tokenizer, {})
    except TypeError:  # (not weakly referenceable)
        per_flag = {}
    if skip_special not in per_flag:
        table = _make_byte_table(tokenizer, skip_special)
        per_flag[skip_special] = (table, None if table is None else _whole_texts(table))
    return per_flag[skip_special]


def _whole_texts(table: list[bytes]) -> list[str | None]:
    texts: list[str | None] = []
    for raw in table:
        try:
            texts.append(raw.decode())
        except UnicodeDecodeError:
            texts.append(None)
    return texts


def _make_byte_table(tokenizer, skip_special: bool) -> list[bytes] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) and not (
        type(backend.model).__name__ == "BPE"
        and not getattr(
            tokenizer,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False,
        )
    ):  # transformers would clean the decoded text up
        return None
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # the alphabet's characters, each standing for one byte (GPT-2's scheme)
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    assert set(char_byte) == set(ByteLevel.alphabet())
    size = backend.get_vocab_size(with_added_tokens=True)
    table = [b""] * size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < size:  # as the decoder: mapped bytes when every character maps, else UTF-8
            mapped = [char_byte.get(c) for c in token]
            table[i] = token.encode() if None in mapped else bytes(mapped)
    for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if i < size and skip_special and added.special:
            table[i] = b""
    for i, raw in enumerate(table):  # the tokenizer's word, id by id, where it is whole text
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            continue
        if backend.decode([i], skip_special_tokens=skip_special) != text:
            return None
    return table
