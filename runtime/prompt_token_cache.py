"""`PromptTokenCache`: long prompts that begin like a recent one are tokenized only from
near where they part.

The engine's prefix cache spares a repeated prefix its compute, but not its tokenizing:
a 7,744-token prompt takes 4–6 ms to tokenize on one core, and waves of them queue for
the tokenizer threads, in front of every prefix hit. Long prompts with shared starts are
what such workloads send (a system prompt or document before each question, a chat's
history growing by a turn), so this cache keeps recent long prompts with their tokens
and the characters each token covers. A prompt that shares its first characters with one
of them reuses the tokens of the shared part and tokenizes only the rest.

Why the joined tokens are the prompt's own. The cut is a place where the tokenizer's
pre-tokenizer cuts the text into pieces that no token crosses (the regex of byte-level
BPE tokenizers: GPT-2's, Llama 3's, Qwen's, gpt-oss's), and where those pieces are
decided by the text just around it, so that the whole prompt is cut there as the cached
one was. The cut lies at least `GUARD_CHARS` before the two texts part. The rest is then
tokenized fresh from the cut, and must give, for the first `CHECK_TOKENS` tokens up to
the guard, the same ids ending at the same characters as the cached tokenization did in
context; otherwise (a normalizer or added token reaching across the cut, say) the prompt
is tokenized whole. Tokenizers whose pre-tokenizer does not cut the text (SentencePiece
BPE over whole texts, as Llama 2's) are not cached at all. As a standing check, every
`VERIFY_EVERY`-th reuse is compared with the prompt tokenized whole, and one difference
turns the cache off for good (logged)."""

import json
import logging
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIN_CHARS = 2048          # shorter prompts tokenize in well under a millisecond
ANCHOR_CHARS = 256        # shared starts are found in steps of this many characters
GUARD_CHARS = 64          # the cut lies at least this far before where the texts part
WINDOW_CHARS = 256        # the stretch before the guard searched for the pre-tokenizer's cuts
CHECK_TOKENS = 8          # tokens past the cut that the fresh tokenization must repeat
VERIFY_EVERY = 64
CAPACITY_TOKENS = 1 << 20   # about 12 bytes a token, with the texts besides

# Pre-tokenizers that cut a text into pieces that tokens never cross (with their
# settings that turn the cutting off: byte-level's regex, Metaspace's split).
_CUTTING = {"ByteLevel": ("use_regex", True), "Metaspace": ("split", True), "Split": None,
            "Whitespace": None, "WhitespaceSplit": None, "BertPreTokenizer": None,
            "Punctuation": None, "Digits": None, "UnicodeScripts": None, "CharDelimiterSplit": None}
_PROBES = ("The quick brown fox jumps over the lazy dog, twice.\n\nThen it   rests.",
           "Numbers 12345 and caf\u00e9 \u4f60\u597d, tabs\tand 'quotes' don't matter!")


def cuts_text(pre_tokenizer: dict | None) -> bool:
    """Whether a pre-tokenizer (its JSON) cuts text into pieces tokens never cross."""
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(cuts_text(p) for p in pre_tokenizer.get("pretokenizers", ()))
    kind = pre_tokenizer.get("type")
    if kind not in _CUTTING:
        return False
    flag = _CUTTING[kind]
    return flag is None or pre_tokenizer.get(flag[0], flag[1]) == flag[1]


def _has_prepend(normalizer: dict | None) -> bool:
    if not normalizer:
        return False
    if normalizer.get("type") == "Sequence":
        return any(_has_prepend(n) for n in normalizer.get("normalizers", ()))
    return normalizer.get("type") == "Prepend"


@dataclass
class _Entry:
    text: str
    ids: array          # tokens without the special ones the tokenizer adds around a text
    starts: array       # the characters each token covers
    ends: array
    keys: list[int]     # its anchors' keys in the index


def _anchor_keys(text: str) -> list[int]:
    """A key for each first `ANCHOR_CHARS * (j + 1)` characters of `text`, chained so
    that each costs only its own characters."""
    keys, key = [], 0
    for j in range(ANCHOR_CHARS, len(text) + 1, ANCHOR_CHARS):
        key = hash((key, text[j - ANCHOR_CHARS:j]))
        keys.append(key)
    return keys


def _common_prefix(a: str, b: str, known: int) -> int:
    """The length of the characters `a` and `b` begin with alike, at least `known` (checked)."""
    if a[:known] != b[:known]:
        return 0
    lo, hi = known, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptTokenCache:
    """`encode(text, add_special_tokens)`, as the tokenizer's, reusing the tokens of
    recent long prompts that `text` begins like. Safe to call from several threads: the
    tokenizing runs outside the lock (the Rust tokenizer releases the GIL for it)."""

    def __init__(self, tokenizer, capacity_tokens: int = CAPACITY_TOKENS, verify_every: int = VERIFY_EVERY):
        self.tokenizer = tokenizer
        self.capacity_tokens = capacity_tokens
        self.verify_every = verify_every
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[int, int] = {}
        self._next_id = 0
        self._tokens = 0
        self._lock = threading.Lock()
        self.stats = {"reused": 0, "whole": 0, "refused": 0, "reused_tokens": 0}
        self.reason_off = self._check()
        if self.reason_off:
            log.info("prompt token cache off: %s", self.reason_off)

    @property
    def enabled(self) -> bool:
        return self.reason_off is None

    def _check(self) -> str | None:
        """Why this tokenizer cannot be cached, or None."""
        if self.backend is None:
            return "not a fast (Rust) tokenizer"
        pre = self.backend.pre_tokenizer
        if pre is None or not cuts_text(json.loads(pre.__getstate__())):
            return "its pre-tokenizer does not cut the text into pieces"
        norm = self.backend.normalizer
        if norm is not None and _has_prepend(json.loads(norm.__getstate__())):
            return "its normalizer prepends to the text"
        self._head: list[int] = []
        self._tail: list[int] = []
        for i, probe in enumerate(_PROBES):
            plain = self._encode_whole(probe, False)[0]
            full = self._encode_whole(probe, True)[0]
            if i == 0:
                at = next((k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain), None)
                if at is None:
                    return "its special tokens are not put around the text"
                self._head, self._tail = full[:at], full[at + len(plain):]
            if self._head + plain + self._tail != full:
                return "its special tokens are not put around the text alike"
            if list(self.tokenizer.encode(probe, add_special_tokens=True)) != full:
                return "the tokenizer's encode differs from its Rust tokenizer's"
        if self.backend.truncation or self.backend.padding:
            return "its Rust tokenizer truncates or pads"
        return None

    # -- tokenizing -------------------------------------------------------------------
    def _encode_whole(self, text: str, add_special_tokens: bool):
        enc = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return enc.ids, enc.offsets

    def _whole(self, text: str) -> tuple[list[int], list]:
        ids, offsets = self._encode_whole(text, True)
        end = len(ids) - len(self._tail)
        return ids[len(self._head):end], offsets[len(self._head):end]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.enabled or len(text) < MIN_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        keys = _anchor_keys(text)
        found = self._find(text, keys)
        ids = None
        if found is not None:
            ids = self._reuse(text, keys, *found)
        if ids is None:
            ids, offsets = self._whole(text)
            with self._lock:
                self.stats["whole"] += 1
            self._store(text, array("i", ids), array("i", (s for s, _ in offsets)),
                        array("i", (e for _, e in offsets)), keys)
        return self._head + ids + self._tail if add_special_tokens else ids

    def _find(self, text: str, keys: list[int]) -> tuple[_Entry, int] | None:
        """The cached entry sharing the longest start with `text`, and that length."""
        with self._lock:
            for j in range(len(keys) - 1, -1, -1):
                eid = self._index.get(keys[j])
                if eid is not None:
                    entry = self._entries[eid]
                    self._entries.move_to_end(eid)
                    break
            else:
                return None
        shared = _common_prefix(entry.text, text, (j + 1) * ANCHOR_CHARS)
        return (entry, shared) if shared else None

    def _reuse(self, text: str, keys: list[int], e: _Entry, shared: int) -> list[int] | None:
        """`text`'s tokens: `e`'s before a cut, and the rest tokenized fresh; None where
        no cut is found or the fresh tokens do not repeat `e`'s past it."""
        if shared == len(text) == len(e.text):
            self._count(len(e.ids))
            return e.ids.tolist()
        kcut = bisect_right(e.ends, shared - GUARD_CHARS)   # e's tokens [0, kcut) end before the guard
        found = self._cut(e, shared - GUARD_CHARS, kcut)
        if found is None:
            return None
        cut, k0 = found
        ids, offsets = self._encode_whole(text[cut:], False)
        n = kcut - k0
        # The same ids, ending at the same characters. Not the same starts: byte-level
        # offsets leave a token's leading spaces out, but not at a text's very start,
        # and put a token of spaces alone at either of its ends: such tokens are placed
        # by their neighbours.
        same = list(ids[:n]) == list(e.ids[k0:kcut]) and all(
            o[1] + cut == e.ends[k0 + i] or o[0] == o[1] for i, o in enumerate(offsets[:n]))
        if not same:
            self._count(None)
            return None
        joined = e.ids[:k0]
        joined.extend(ids)
        if self._count(k0) and not self._verify(text, joined.tolist()):
            return None
        starts, ends = e.starts[:k0], e.ends[:k0]
        starts.extend(o[0] + cut for o in offsets)
        ends.extend(o[1] + cut for o in offsets)
        self._store(text, joined, starts, ends, keys)
        return joined.tolist()

    def _cut(self, e: _Entry, limit: int, kcut: int) -> tuple[int, int] | None:
        """The last place before `limit` where the pre-tokenizer cuts `e.text`, no token
        of `e` crosses, and at least `CHECK_TOKENS` of `e`'s tokens lie before `kcut`:
        (that character, the index of `e`'s first token past it); None if there is none."""
        start = max(0, limit - WINDOW_CHARS)
        pieces = self.backend.pre_tokenizer.pre_tokenize_str(e.text[start:limit])
        for _, (s, _) in reversed(pieces[1:]):      # the window's first piece may be cut short
            cut = start + s
            k0 = bisect_right(e.ends, cut)          # e's tokens [0, k0) end by the cut
            if kcut - k0 >= CHECK_TOKENS and e.starts[k0] >= cut:
                return cut, k0
        return None

    def _count(self, reused_tokens: int | None) -> bool:
        """Counts a reuse of so many tokens (None: one refused); whether to verify it."""
        with self._lock:
            if reused_tokens is None:
                self.stats["refused"] += 1
                return False
            self.stats["reused"] += 1
            self.stats["reused_tokens"] += reused_tokens
            return bool(self.verify_every) and self.stats["reused"] % self.verify_every == 0

    def _verify(self, text: str, joined: list[int]) -> bool:
        """Whether `joined` is `text` tokenized whole; if not, the cache turns off."""
        whole = self._whole(text)[0]
        if whole == joined:
            return True
        at = next((i for i, (a, b) in enumerate(zip(whole, joined)) if a != b), min(len(whole), len(joined)))
        log.warning("prompt token cache off: a reused tokenization differed from the whole one at token %d "
                    "of %d; prompts are tokenized whole from now on", at, len(whole))
        self.reason_off = "a reused tokenization differed from the whole one"
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self._tokens = 0
        return False

    # -- the cache --------------------------------------------------------------------
    def _store(self, text: str, ids: array, starts: array, ends: array, keys: list[int]) -> None:
        if not self.enabled or len(ids) > self.capacity_tokens:
            return
        entry = _Entry(text, ids, starts, ends, keys)
        with self._lock:
            eid = self._next_id
            self._next_id += 1
            self._entries[eid] = entry
            self._tokens += len(ids)
            for key in keys:
                self._index[key] = eid
            while self._tokens > self.capacity_tokens:
                old_id, old = self._entries.popitem(last=False)
                self._tokens -= len(old.ids)
                for key in old.keys:
                    if self._index.get(key) == old_id:
                        del self._index[key]

    def cached_tokens(self) -> int:
        return self._tokens
