"""Incremental detokenization against a real byte-level BPE tokenizer's full decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.engine.detokenizer import IncrementalDetokenizer, byte_table
from worker.sampling_params import SamplingParams

TRAIN = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Stop here. END of text.",
    "A naïve café in 東京 serves tea 🙂 every morning.",
    "Streaming text one token at a time is what servers do.",
]
TEXTS = [
    "Hello world, the quick fox said hello.",
    "naïve café 東京 🙂 and more 🙂🙂 über 日本語 ñandú",
    "emoji at the end 🎉",
    "漢字かな交じり文 with ASCII in between 😀 done",
]
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module", params=["byte_table", "window"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    """A small vocabulary (256 bytes + ~40 merges) so that non-ASCII characters span tokens.
    Every test runs twice: on the byte table of a byte-level tokenizer, and on the decode
    window, which a decoder of another kind gets (here the same decoder in a Sequence, which
    decodes alike but is not recognised as byte-level)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if request.param == "window":
        tok.decoder = decoders.Sequence([decoders.ByteLevel()])
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    assert (byte_table(fast, True) is not None) == (request.param == "byte_table")
    return fast


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunks=(1,)) -> list[str]:
    """Feed ids in chunks of the given sizes (cycled); return the deltas, flush included."""
    deltas, i, c = [], 0, 0
    while i < len(ids) and detok.stop_matched is None:
        n = chunks[c % len(chunks)]
        deltas.append(detok.step(ids[i : i + n]))
        i, c = i + n, c + 1
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("chunks", [(1,), (3, 1, 2, 5), (7,)])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, text, chunks):
    prompt = encode(tokenizer, "Hello there! ")
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    ids = encode(tokenizer, text)
    ids = ids[:5] + [bos] + ids[5:] + [eos]  # special tokens are skipped in the text
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = feed(detok, ids, chunks)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == expected == detok.text
    assert deltas[-1] == ""  # no stop strings: nothing was held back
    assert detok.stop_matched is None


def test_special_tokens_kept_when_asked(tokenizer):
    ids = encode(tokenizer, "Hello world") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(), skip_special_tokens=False)
    assert "".join(feed(detok, ids)) == tokenizer.decode(ids) == "Hello world<eos>"


@pytest.mark.parametrize("text", TEXTS[1:])
def test_split_characters_never_emit_replacement_chars(tokenizer, text):
    ids = encode(tokenizer, text)
    # The test only means something if some character's bytes span several tokens.
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    for one_at_a_time in (False, True):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
        deltas = [detok.step_one(i) if one_at_a_time else detok.step([i]) for i in ids]
        assert all(REPLACEMENT not in d for d in deltas)
        assert "".join(deltas) == text


def test_incomplete_tail_is_flushed_as_decode_renders_it(tokenizer):
    ids = encode(tokenizer, "tea 🙂")[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    sent = "".join(detok.step([i]) for i in ids)
    assert REPLACEMENT not in sent
    assert sent + detok.flush() == tokenizer.decode(ids)


def run_with_stop(tokenizer, text, params, chunks=(1,)):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    sent = []  # every prefix of the output that was shown
    for delta in feed(detok, ids, chunks):
        sent.append((sent[-1] if sent else "") + delta)
    return detok, sent


@pytest.mark.parametrize(
    "text,stop",
    [
        ("Hello world, hello there!", "world"),  # a stop string inside the text
        ("Stop here. END of text.", "END"),  # spans tokens, checked below
        ("Stop here. END of text.", "Stop"),  # at the very start
        ("naïve café 東京 🙂 ok", "東京"),  # multi-byte, spans tokens
        ("Hello world, hello there!", "o"),  # a single character
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_and_nothing_past_the_cut_is_sent(tokenizer, text, stop, include):
    params = SamplingParams(stop=(stop, "never appears"), include_stop_str_in_output=include)
    for chunks in [(1,), (2, 3)]:
        detok, sent = run_with_stop(tokenizer, text, params, chunks)
        at = text.index(stop)
        expected = text[: at + len(stop)] if include else text[:at]
        assert detok.stop_matched == stop
        assert detok.text == expected
        assert sent[-1] == expected
        assert all(expected.startswith(s) for s in sent)


def test_stop_string_split_across_tokens_is_found(tokenizer):
    ids = encode(tokenizer, "Stop here. END of text.")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "END" not in pieces and " END" not in pieces  # it really spans tokens
    detok, sent = run_with_stop(tokenizer, "Stop here. END of text.", SamplingParams(stop="END"))
    assert detok.text == "Stop here. " and sent[-1] == "Stop here. "


def test_stop_string_in_a_single_token(tokenizer):
    ids = encode(tokenizer, "Hello world")
    pieces = [tokenizer.decode([i]) for i in ids]
    word = next(p for p in pieces if len(p.strip()) >= 3).strip()
    detok, _ = run_with_stop(tokenizer, "Hello world", SamplingParams(stop=word))
    assert detok.stop_matched == word and detok.text == "Hello world"[: "Hello world".index(word)]


def test_earliest_stop_string_wins(tokenizer):
    params = SamplingParams(stop=("there", "hello"))
    detok, _ = run_with_stop(tokenizer, "Hello world, hello there!", params, chunks=(50,))
    assert detok.stop_matched == "hello" and detok.text == "Hello world, "


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    params = SamplingParams(stop="END!")
    ids = encode(tokenizer, "Stop here. EN")
    detok = IncrementalDetokenizer(tokenizer, [], params)
    sent = "".join(detok.step([i]) for i in ids)
    assert sent == "Stop here. "  # "EN" could begin "END!"
    assert detok.text == "Stop here. EN"
    assert detok.flush() == "EN" and detok.stop_matched is None


def test_without_tokenizer_text_is_empty_and_stops_never_match():
    detok = IncrementalDetokenizer(None, [1, 2, 3], SamplingParams(stop="x"))
    assert detok.step([4, 5]) == "" and detok.flush() == ""
    assert detok.text == "" and detok.stop_matched is None


class RecordingTokenizer:
    """A real tokenizer whose decode calls are measured."""

    def __init__(self, inner):
        self.inner = inner
        self.window_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.window_lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_decode_window_stays_bounded(tokenizer):
    text = " ".join(TEXTS * 10)
    ids = encode(tokenizer, text)
    assert len(ids) > 500
    recorder = RecordingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(recorder, encode(tokenizer, TRAIN[0]), SamplingParams())
    assert "".join(feed(detok, ids)) == tokenizer.decode(ids)
    assert max(recorder.window_lengths) <= 12  # a few tokens, whatever the output length


def _longest_stop_tail(text: str, stops: tuple[str, ...]) -> int:
    """By definition: the longest tail of `text` shorter than some stop that begins it."""
    return max(
        (k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if s.startswith(text[-k:])),
        default=0,
    )


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abAB", max_size=30),
    stops=st.lists(st.text(alphabet="abAB", min_size=1, max_size=8), min_size=1, max_size=4),
)
def test_held_tail_is_the_longest_tail_that_begins_a_stop(text, stops):
    detok = IncrementalDetokenizer(None, [], SamplingParams(stop=tuple(stops)))
    detok._unsent = text
    assert detok._stop_prefix_len() == _longest_stop_tail(text, tuple(stops))


@pytest.mark.parametrize("cut", [1, 3, 6, 9])
def test_a_resumed_output_streams_exactly_what_was_not_sent(tokenizer, cut):
    """A detokenizer that resumes another's output after `cut` tokens, of which the first
    streamed the text it returned, sends the rest: nothing missing, nothing twice, stop
    strings found across the cut."""
    text = "Stop here. END of text. 東京 🙂"
    ids = encode(tokenizer, text)
    params = SamplingParams(stop="END of")
    first = IncrementalDetokenizer(tokenizer, [], params)
    sent = "".join(first.step([i]) for i in ids[:cut])
    second = IncrementalDetokenizer(tokenizer, [], params)
    second.resume(ids[:cut], len(sent))
    rest = [second.step([i]) for i in ids[cut:] if second.stop_matched is None]
    rest.append(second.flush())
    assert sent + "".join(rest) == "Stop here. "
    assert second.stop_matched == "END of"


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 299), min_size=1, max_size=30), skip=st.booleans())
def test_any_ids_stream_to_the_tokenizers_decode(tokenizer, ids, skip):
    """Ids in any order (split and invalid UTF-8, special tokens): the streamed text is what
    the tokenizer's own decode gives for them, on either path."""
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(), skip_special_tokens=skip)
    streamed = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert streamed == tokenizer.decode(ids, skip_special_tokens=skip) == detok.text
    # the engine's call, one id at a time (on the byte table: whole tokens' texts as tabled)
    one = IncrementalDetokenizer(tokenizer, [], SamplingParams(), skip_special_tokens=skip)
    assert "".join(one.step_one(i) for i in ids) + one.flush() == streamed == one.text
