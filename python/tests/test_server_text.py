"""vmem-serve's text side, in process: incremental detokenization gives, piece by piece, the text
a whole decode gives (multi-byte characters split across byte-level tokens included), and stop
strings end the text before them even when they straddle tokens or pieces, never emitting any
part of one."""

import pytest

import server_util as su

su.require()

from vmem.server.text import TextStream  # noqa: E402


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE (as Llama 3's and GPT-2's) trained here on text with accents and emoji."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld, ça va? 🎉🎉 naïve café", "the quick brown fox 狐狸 jumps", "stop here STOP there"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


TEXTS = ["héllo wörld 🎉 ça va", "狐狸 jumps over 🎉🎉 the café", "plain ascii text"]


@pytest.fixture(params=["rust", "python"], autouse=True)
def decoder(request, monkeypatch):
    """Both paths: the tokenizers library's DecodeStream, and the two-decode fallback (slow
    tokenizers, older tokenizers)."""
    import vmem.server.text as text

    if request.param == "python":
        monkeypatch.setattr(text, "DecodeStream", None)
    return request.param


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_pieces_add_up_to_the_whole_decode(byte_bpe, text, step):
    ids = byte_bpe(text)["input_ids"]
    prompt, gen = ids[:2], ids[2:]
    stream = TextStream(byte_bpe, prompt, ())
    pieces = [stream.push(gen[i:i + step], final=i + step >= len(gen)) for i in range(0, len(gen), step)]
    assert "".join(pieces) == byte_bpe.decode(ids)[len(byte_bpe.decode(prompt)):]
    assert all("\ufffd" not in p for p in pieces), pieces  # no half character ever goes out
    if not text.isascii():  # the case this is about: some token alone is half a character
        assert any("\ufffd" in byte_bpe.decode([t]) for t in gen), "no character was split across tokens"


@pytest.mark.parametrize("stop", ["wörld", "🎉", "o w", "ça v", "never there"])
def test_a_stop_string_ends_the_text_before_it_and_never_leaks(byte_bpe, stop):
    text = TEXTS[0]
    ids = byte_bpe(text)["input_ids"]
    stream = TextStream(byte_bpe, ids[:1], (stop, "zz"))
    pieces = []
    for i, t in enumerate(ids[1:]):
        pieces.append(stream.push([t], final=i == len(ids) - 2))
        if stream.stopped:
            break
    whole = byte_bpe.decode(ids)[len(byte_bpe.decode(ids[:1])):]
    out = "".join(pieces)
    if stop in whole:
        assert stream.stopped and out == whole[:whole.index(stop)]
    else:
        assert not stream.stopped and out == whole
    for p in range(1, len(pieces) + 1):  # no prefix of the output ever held a stop string
        assert stop not in "".join(pieces[:p])
    assert stream.push([ids[0]]) == "" or not stream.stopped
