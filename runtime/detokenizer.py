"""Incremental detokenization and stop strings.

Text is decoded over a sliding window of tokens and released only when it does not
end in U+FFFD, so a multi-byte character split across tokens is never emitted broken.
A stop string may straddle tokens: text that could still be the start of one is held
back until the next token settles it. The stop string itself is not returned. A sequence
that ends inside a character ends its text with U+FFFD, as decoding its tokens whole does.
"""


class IncrementalDetokenizer:
    CONTEXT = 6   # prompt tokens decoded as left context, for tokenizers that strip spaces

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True):
        # The Rust tokenizer underneath a fast HF tokenizer decodes without Python overhead.
        self._decode = getattr(tokenizer, "backend_tokenizer", tokenizer).decode
        self._ids = list(prompt_token_ids[-self.CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.stop = list(stop or [])
        self._skip = skip_special_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int, find_stops: bool = True) -> None:
        """Feed one generated token; sets `stopped` when a stop string appears in the
        text up to it (`find_stops` False: not looked for, as before `min_tokens`)."""
        if self.stopped:
            return
        self._ids.append(token_id)
        self._settle(find_stops, final=False)

    def finish(self, find_stops: bool = True) -> None:
        """The sequence ended: tokens that began a character no later token completed
        write it as U+FFFD, instead of being dropped."""
        if not self.stopped and self._read < len(self._ids):
            self._settle(find_stops, final=True)

    def _settle(self, find_stops: bool, final: bool) -> None:
        prefix_text = self._decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        new_text = self._decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        before = len(self.text)
        self.text += delta
        if self.stop and find_stops:
            lo = max(0, before - self._hold)
            hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i != -1]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet returned that is safe to return now."""
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out
