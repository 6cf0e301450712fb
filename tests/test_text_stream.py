"""A sequence's text as tokens come (`TextStream`): stop strings, held-back starts, half
characters, and decoding in pieces what decoding whole gives."""

import pytest


def letters():
    """A char tokenizer over a few letters, with end-of-text as the last id."""
    from gptkiln.tokenizers import CharTokenizer

    return CharTokenizer(sorted(" ENDabcdehlorw\n"), with_eot=True)


def pushed(stream, text: str) -> list[str]:
    tok = letters()
    return [stream.push(t) for t in tok.encode(text)]


def test_a_text_stream_ends_right_before_a_stop_string_and_holds_back_its_start():
    from gptkiln.text_stream import TextStream

    tok = letters()
    stream = TextStream(tok.decode, stop=["END"], eot_id=tok.eot_id)
    pieces = pushed(stream, "hello END world")
    assert pieces[:6] == list("hello") + [" "]
    assert pieces[6:8] == ["", ""]  # "E", "EN": maybe the start of END, so held back
    assert stream.done and stream.finish_reason == "stop"
    assert stream.text == "".join(pieces) == "hello "
    assert stream.push(tok.encode("w")[0]) == "" and stream.flush() == ""  # nothing after it


def test_a_text_stream_gives_out_a_held_back_start_that_did_not_become_a_stop_string():
    from gptkiln.text_stream import TextStream

    tok = letters()
    stream = TextStream(tok.decode, stop=["END", "\n\n"])
    pieces = pushed(stream, "a EN\nb")
    # "E", "EN" may begin END; then "\n" may begin "\n\n" (held) but "EN\n" begins no stop
    assert pieces == ["a", " ", "", "", "EN", "\nb"] and not stream.done
    assert pushed(stream, "\n") == [""] and stream.flush() == "\n"  # the end of text: given out
    assert stream.text == "a EN\nb\n" and stream.finish_reason == "length"


def test_the_earliest_stop_string_wins_and_a_stop_string_may_span_tokens():
    from gptkiln.text_stream import TextStream
    from gptkiln.tokenizers import load_tokenizer

    gpt2 = load_tokenizer("gpt2")
    ids = gpt2.encode("Hello world, and goodbye world")
    stream = TextStream(gpt2.decode, stop=["goodbye", "o w", "and"])
    text = "".join(stream.push(t) for t in ids)
    assert text == "Hell" and stream.done  # "o w" spans the tokens "Hello" and " world"


def test_a_text_stream_holds_half_a_character_until_its_other_bytes_come():
    from gptkiln.text_stream import TextStream
    from gptkiln.tokenizers import load_tokenizer

    gpt2 = load_tokenizer("gpt2")
    stream = TextStream(gpt2.decode, eot_id=gpt2.eot_id)  # 12520 is " \xf0\x9f": half an emoji
    assert [stream.push(t) for t in (71, 12520)] == ["h", " "]  # the space, not half an emoji
    assert stream.push(236) + stream.push(231) == gpt2.decode([12520, 236, 231])[1:]
    assert stream.push(gpt2.eot_id) == "" and stream.done and stream.finish_reason == "stop"


MIXED_TEXT = "Hello, world! 你好，世界。 Emoji: 🙂😀🎉 café naïve — done.\n"


def streamed(decode, ids, stop=(), ends=()):
    """What a `TextStream` gives out for ``ids``: each push's piece, then done, text, flush."""
    from gptkiln.text_stream import TextStream

    stream = TextStream(decode, stop, ends)
    pieces = [stream.push(t) for t in ids]
    return pieces, stream.done, stream.text, stream.flush()


def assert_decoded_in_pieces_as_whole(tok, seed: int = 0):
    """A tokenizer that `decodes_in_pieces` streams the text decoding it whole gives: real text
    (whole and split characters), runs of random ids (bytes that make no character, special
    tokens), with and without stop strings found in it."""
    import random

    assert tok.decodes_in_pieces
    rng = random.Random(seed)
    real = tok.encode(MIXED_TEXT * 3)
    sequences = [real, [rng.randrange(tok.vocab_size) for _ in range(300)]]
    sequences.append([rng.randrange(min(tok.vocab_size, 300)) for _ in range(300)])  # bytes
    ends = tok.stop_ids

    def whole(ids):  # not a tokenizer's own method: decoded whole, as before pieces
        return tok.decode(ids)

    for ids in sequences:
        text = tok.decode([t for t in ids if t not in ends])
        for stop in ((), (text[40:43],), (text[-30:-28], "\n")):
            stop = tuple(s for s in stop if s)
            assert streamed(tok.decode, ids, stop, ends) == streamed(whole, ids, stop, ends)


@pytest.mark.parametrize("kind", ["gpt2", "char", "bpe"])
def test_a_text_stream_decodes_in_pieces_what_decoding_whole_gives(kind):
    from gptkiln.tokenizers import build_char_tokenizer, load_tokenizer, train_bpe_tokenizer

    if kind == "gpt2":
        tok = load_tokenizer("gpt2")
    elif kind == "char":
        tok = build_char_tokenizer([MIXED_TEXT], with_eot=True)
    else:
        tok = train_bpe_tokenizer([MIXED_TEXT * 20, "the cat sat on the mat " * 20], 300)
    assert_decoded_in_pieces_as_whole(tok)


def test_a_text_streams_work_a_token_does_not_grow_with_its_text():
    from gptkiln.tokenizers import GPT2Tokenizer

    decoded = []

    class Counted(GPT2Tokenizer):
        def decode(self, ids):
            decoded.append(len(ids))
            return super().decode(ids)

    tok = Counted()
    ids = tok.encode(MIXED_TEXT * 80)  # 2,500 ids, emoji and Chinese split across tokens
    pieces, done, text, tail = streamed(tok.decode, ids, ("@@",), tok.stop_ids)
    assert "".join(pieces) + tail == MIXED_TEXT * 80 and len(ids) > 2000
    assert max(decoded) <= 4  # the ids since the last whole character, never the whole text
    decoded.clear()
    streamed(lambda i: tok.decode(i), ids[:300])  # a plain function: decoded whole
    assert max(decoded) == 300


def test_skip_special_tokens_leaves_a_templates_markers_out_of_the_text_not_the_ids(tmp_path):
    """With a tokenizer's `special_ids` hidden, a chat model's stray ``<|im_start|>`` is not
    text (vLLM's and transformers' skip_special_tokens), its id is kept, a character around it
    stays whole, and a stop string that is a hidden token's own text still ends the stream."""
    from hf_tokenizer_dirs import write_qwen3_dir

    from gptkiln.text_stream import TextStream, hidden_ids
    from gptkiln.tokenizers import load_tokenizer

    tok = load_tokenizer(write_qwen3_dir(tmp_path / "qwen"))
    start = tok.encode_templated("<|im_start|>")
    assert len(start) == 1 and start[0] in tok.special_ids and tok.eot_id in tok.special_ids
    ids = tok.encode("Hi é") + start + tok.encode("there")
    hidden = hidden_ids(tok, True)
    stream = TextStream(tok.decode, (), tok.stop_ids, hidden)
    text = "".join(stream.push(t) for t in ids) + stream.flush()
    assert text == "Hi éthere" and stream.ids == ids
    shown = TextStream(tok.decode, (), tok.stop_ids, hidden_ids(tok, False))
    assert "".join(shown.push(t) for t in ids) + shown.flush() == "Hi é<|im_start|>there"
    stopped = TextStream(tok.decode, ("<|im_start|>",), tok.stop_ids, hidden)
    assert "".join(stopped.push(t) for t in ids) == "Hi é" and stopped.done
    assert hidden_ids(load_tokenizer("gpt2"), True) == {50256}
