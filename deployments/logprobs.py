"""Token logprobs as OpenAI's APIs write them: chat's `content` entries (each token's
text, logprob, bytes and alternatives), the legacy completions API's `tokens`,
`token_logprobs`, `top_logprobs` (keyed by token text) and `text_offset`.

A token's `bytes` are what it adds to the text's UTF-8, read from the tokenizer's
vocabulary (byte-level BPE, or SentencePiece with byte fallback). They are what a client
joins to rebuild a character split across tokens (an emoji, CJK), which each of those
tokens decoded alone writes as U+FFFD.
"""

import codecs
import json
from functools import lru_cache


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for (GPT-2's
    scheme): printable Latin-1 bytes are themselves, the others U+0100 on, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, n = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + n)] = b
            n += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()
_SPACE_MARK = "\u2581"   # SentencePiece's word boundary


def vocabulary_kind(tokenizer) -> str:
    """How the tokenizer's vocabulary writes bytes, from its decoder: "byte-level",
    "sentencepiece" or "text" (tokens are text; a token alone decodes whole)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:   # no decoder, or one defined in Python: read tokens as text
        return "text"
    parts = [spec, *spec.get("decoders", [])]
    kinds = {p.get("type") for p in parts}
    if "ByteLevel" in kinds:
        return "byte-level"
    if kinds & {"ByteFallback", "Metaspace"} or any(
            p.get("type") == "Replace" and p.get("pattern", {}).get("String") == _SPACE_MARK for p in parts):
        return "sentencepiece"
    return "text"


class TokenText:
    """Each token's text decoded alone (`piece`) and its bytes (`bytes_of`), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.kind = vocabulary_kind(tokenizer)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
        self.special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.piece = lru_cache(maxsize=65536)(self._piece)
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes_of)

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes_of(self, token_id: int) -> bytes:
        token = None
        if self.kind != "text" and token_id not in self._added:
            token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:   # text, an added token (written as itself), or past the vocabulary
            return self.piece(token_id).encode()
        if self.kind == "byte-level":
            return b"".join(bytes([_BYTE_LEVEL[c]]) if c in _BYTE_LEVEL else c.encode() for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace(_SPACE_MARK, " ").encode()


def utf8_reader():
    """Decodes tokens' bytes as they come: a character split across tokens is written
    by the token that completes it."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode


class LogprobFormat:
    """The engine's `Logprob`s (`token_id`, `logprob`, `top`: (id, logprob) pairs) in
    OpenAI's shapes."""

    def __init__(self, tokenizer):
        self.text = TokenText(tokenizer)

    def entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text.piece(token_id), "logprob": logprob, "bytes": list(self.text.bytes_of(token_id))}

    def chat(self, lps) -> dict | None:
        """Chat's (and Responses') `logprobs`: None where none were asked for."""
        if lps is None:
            return None
        return {"content": [{**self.entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self.entry(t, v) for t, v in lp.top]} for lp in lps]}

    def with_bytes(self, token_ids: list[int], lps) -> list[tuple[int, bytes, dict]]:
        """Each token with its bytes and its chat entry (`responses.TextLogprobs.add`)."""
        entries = self.chat(lps)["content"] if lps else []
        return [(t, self.text.bytes_of(t), e) for t, e in zip(token_ids, entries)]

    def completion(self, lps, offset: int = 0) -> dict | None:
        """The legacy completions API's logprobs of generated tokens, text offsets from
        `offset`; None when none were asked for."""
        if lps is None:
            return None
        return self.legacy([(lp.token_id, lp) for lp in lps], offset)

    def prompt(self, entries, prompt_ids: list[int], shown: str) -> dict:
        """The echoed prompt's part of completions logprobs (the first token has none),
        its offsets into `shown`, the prompt as echoed."""
        return self.legacy(list(zip(prompt_ids, entries or [])), 0, shown)

    def legacy(self, tokens: list[tuple[int, object]], offset: int, shown: str | None = None) -> dict:
        """`tokens`: (id, its `Logprob`, or None where it has none) in text order. A token's
        `text_offset` is where the text stood when it came: a character split across
        tokens moves it on at the token that completes it. Where `shown` is the text, a
        special token it does not show (a BOS the tokenizer added) takes no room in it,
        nor does the space SentencePiece writes before a first word."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        read = utf8_reader()
        for tok, lp in tokens:
            out["tokens"].append(self._legacy_token(tok))
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else self._top_with_sampled(lp))
            out["text_offset"].append(offset)
            text = read(self.text.bytes_of(tok))
            if shown is not None and not shown.startswith(text, offset):
                if tok in self.text.special:
                    text = ""
                elif text[:1] == " " and shown.startswith(text[1:], offset):
                    text = text[1:]
            offset += len(text)
        return out

    def _top_with_sampled(self, lp) -> dict[str, float]:
        """The legacy completions API's alternatives: the `logprobs` likeliest tokens and
        the sampled one, which OpenAI always includes (up to `logprobs` + 1 entries)."""
        top = {self._legacy_token(t): v for t, v in lp.top}
        top.setdefault(self._legacy_token(lp.token_id), lp.logprob)
        return top

    def _legacy_token(self, token_id: int) -> str:
        """A token's text in the legacy API, which has no `bytes`: a token that holds part
        of a character is written as its bytes, `bytes:\\xe2\\x98`, as OpenAI writes it,
        so that two such tokens among the alternatives stay two keys."""
        raw = self.text.bytes_of(token_id)
        try:
            raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return self.text.piece(token_id)
