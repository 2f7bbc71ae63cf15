"""Token logprobs' text: each token's bytes, and where a character split across tokens
is counted, in the legacy offsets and in Responses' output_text entries."""

from dataclasses import dataclass, field

import pytest

from deployments.logprobs import LogprobFormat, TokenText
from deployments.responses import TextLogprobs
from runtime.models.loader import load_tokenizer

TEXT = "héllo ☃ 世界"


@dataclass
class Lp:
    token_id: int
    logprob: float = -0.5
    top: list = field(default_factory=list)


def _sentencepiece_tokenizer():
    """A SentencePiece-style vocabulary as Llama 2's: "▁" for spaces, and the 256
    `<0xNN>` byte tokens for what it lacks."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "h", "l", "o", "ll", "▁h", "llo"]:
        vocab[piece] = len(vocab)
    merges = [("l", "l"), ("▁", "h"), ("ll", "o")]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_tokens_bytes_spell_the_characters_split_across_tokens(default_model, kind):
    """Joined, the tokens' bytes are the text's UTF-8 (after the space SentencePiece puts
    before it), though a token holding part of a character decodes alone to U+FFFD."""
    tok = load_tokenizer(default_model) if kind == "byte-level" else _sentencepiece_tokenizer()
    text = TokenText(tok)
    assert text.kind == kind
    ids = tok.encode(TEXT, add_special_tokens=False)
    want = TEXT.encode() if kind == "byte-level" else b" " + TEXT.encode()
    assert b"".join(text.bytes_of(t) for t in ids) == want
    assert any(text.piece(t) == "\ufffd" for t in ids)
    special = tok.convert_tokens_to_ids(tok.eos_token)
    assert text.bytes_of(special) == tok.eos_token.encode()


def test_legacy_offsets_move_on_at_the_token_that_completes_a_character(default_model):
    tok = load_tokenizer(default_model)
    fmt = LogprobFormat(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = fmt.completion([Lp(t) for t in ids], offset=3)
    ends = [3]
    for t in ids:   # where the text stands after each token, decoded as it comes
        ends.append(3 + len(tok.decode(ids[:len(ends)]).rstrip("\ufffd")))
    assert out["text_offset"] == ends[:-1] and ends[-1] == 3 + len(TEXT)
    # Tokens holding part of a character are written as their bytes, so that two of them
    # among a position's alternatives stay two keys.
    partial = [t for t in ids if fmt.text.piece(t) == "\ufffd"]
    assert [name for t, name in zip(ids, out["tokens"]) if t in partial] == \
        ["bytes:" + "".join(f"\\x{b:02x}" for b in fmt.text.bytes_of(t)) for t in partial]
    top = fmt.completion([Lp(partial[0], top=[(partial[1], -1.0), (partial[2], -2.0)])])["top_logprobs"][0]
    assert len(top) == 3 and all(k.startswith("bytes:\\x") for k in top)
    entries = fmt.chat([Lp(t, top=[(t, -0.5)]) for t in ids])["content"]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == TEXT
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in entries)


def test_echoed_prompt_offsets_point_into_the_prompt_as_echoed():
    """An echoed prompt's offsets index the prompt string the client sent: the BOS the
    tokenizer added takes no room in it, nor the space SentencePiece writes before the
    first word, and a split character moves them on at the token that completes it."""
    from tokenizers import processors

    tok = _sentencepiece_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    prompt = "hello héllo"
    ids = tok.encode(prompt)
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁h", "<0x65>", "llo", "▁h", "<0xC3>", "<0xA9>", "llo"]
    out = LogprobFormat(tok).prompt([None] + [Lp(t) for t in ids[1:]], ids, prompt)
    assert out["text_offset"] == [0, 0, 1, 2, 5, 7, 7, 8]
    assert out["token_logprobs"][0] is None and out["tokens"][:2] == ["<s>", "h"]


def test_output_text_entries_go_out_with_the_characters_they_wrote(default_model):
    """Responses' output_text logprobs: a delta's entries are the tokens of its own text,
    where a character's bytes span several tokens too."""
    tok = load_tokenizer(default_model)
    fmt = LogprobFormat(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    lps = TextLogprobs(None, "answer")
    lps.add(fmt.with_bytes(ids, [Lp(t) for t in ids]))
    got, deltas = [], [tok.decode(ids[:i + 1]).rstrip("\ufffd") for i in range(len(ids))]
    for before, now in zip([""] + deltas, deltas):   # the content handed out as a stream would
        delta = now[len(before):]
        entries = lps.release(delta)
        assert bytes(b for e in entries for b in e["bytes"]).decode() == delta
        got += entries
    assert len(got) == len(ids) and lps.rest(False) == []
