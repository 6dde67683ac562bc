from forge_stream.engine.torch_engine.detok import IncrementalText


def _run(pieces, stop=(), include_stop=False):
    """Feed one piece of text per 'token'; the decoder joins the pieces of the ids so far."""
    text = IncrementalText(decode=lambda ids: "".join(pieces[i] for i in ids), stop=stop, include_stop=include_stop)
    out = []
    for i in range(len(pieces)):
        out.append(text.step(list(range(i + 1)), final=i == len(pieces) - 1))
        if text.stop_hit:
            break
    return out, text


def test_plain_text_is_released_token_by_token():
    out, text = _run(["a", "b", "c"])
    assert out == ["a", "b", "c"] and text.stop_hit is None


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    out, text = _run(["hel", "lo wo", "rld", "!"], stop=("o wor",))
    assert "".join(out) == "hell"
    assert text.stop_hit == "o wor"
    assert all("o wor" not in piece for piece in out)


def test_include_stop_keeps_the_stop_string():
    out, _ = _run(["ab", "STOP", "cd"], stop=("STOP",), include_stop=True)
    assert "".join(out) == "abSTOP"


def test_unfinished_utf8_is_held_back_until_complete():
    decoded = {1: "x\ufffd", 2: "x\u00e9"}
    text = IncrementalText(decode=lambda ids: decoded[len(ids)])
    assert text.step([0], final=False) == "x"
    assert text.step([0, 1], final=True) == "\u00e9"
