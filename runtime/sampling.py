"""Batched sampling with per-request parameters.

One call samples a row per sequence from (B, V) logits. Filters run only when some
row asks for them, and then on the whole batch at once. Seeded rows draw their noise
from a key derived from (seed, completion index, token index) alone, so a seeded
request gives the same tokens whatever else shares its batch.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .sequence import Sequence
from .structured_output import allowed_tokens


@dataclass
class SampleResult:
    tokens: mx.array                   # (B,) int32
    logprobs: mx.array | None = None   # (B,) logprob of the sampled token, raw model distribution
    top_ids: mx.array | None = None    # (B, k)
    top_logprobs: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        """The arrays to evaluate: those asked for."""
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if a is not None]


def _apply_logit_bias(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    """`logit_bias`, and -inf for EOS and stop ids before `min_tokens`."""
    rows, cols, vals = [], [], []
    for i, s in enumerate(seqs):
        for tok, bias in s.params.logit_bias.items():
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
        if s.early_stop_ids and s.num_output_tokens < s.params.min_tokens:
            rows += [i] * len(s.early_stop_ids)
            cols += s.early_stop_ids
            vals += [-mx.inf] * len(s.early_stop_ids)
    if not rows:
        return logits
    return logits.at[mx.array(rows), mx.array(cols)].add(mx.array(vals, dtype=logits.dtype))


def _apply_penalties(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    """Repetition penalty (HF style) over prompt and output; presence and frequency
    penalties (OpenAI style) over the output."""
    idx = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not idx:
        return logits
    vocab = logits.shape[-1]
    sub = logits[mx.array(idx)]
    counts = np.zeros((len(idx), vocab), dtype=np.float32)
    seen = np.zeros((len(idx), vocab), dtype=bool)
    for r, i in enumerate(idx):
        s = seqs[i]
        np.add.at(counts[r], np.asarray(s.output_token_ids, dtype=np.int64), 1.0)
        seen[r, np.asarray(s.token_ids, dtype=np.int64)] = True
    counts_m, seen_m = mx.array(counts), mx.array(seen)
    rep = mx.array([seqs[i].params.repetition_penalty for i in idx], dtype=mx.float32)[:, None]
    pres = mx.array([seqs[i].params.presence_penalty for i in idx], dtype=mx.float32)[:, None]
    freq = mx.array([seqs[i].params.frequency_penalty for i in idx], dtype=mx.float32)[:, None]
    sub = mx.where(seen_m, mx.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - pres * (counts_m > 0) - freq * counts_m
    if len(idx) == len(seqs):
        return sub
    out = mx.array(logits)   # a new array: `logits` stays the model's, for logprobs
    out[mx.array(idx)] = sub
    return out


def _apply_grammars(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    """Structured outputs: -inf for every token a sequence's grammar does not allow next."""
    idx = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.masks]
    if not idx:
        return logits
    allowed = allowed_tokens([seqs[i].grammar for i in idx], logits.shape[-1])
    if len(idx) == len(seqs):
        return mx.where(allowed, logits, -mx.inf)
    return logits.at[mx.array(idx)].add(mx.where(allowed, 0.0, -mx.inf))


def _filter(x: mx.array, seqs: list[Sequence]) -> tuple[mx.array, mx.array | None]:
    """top-k, top-p and min-p on temperature-scaled logits. Returns the logits in
    descending order with dropped entries at -inf, and that order."""
    vocab = x.shape[-1]
    ks = [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs]
    ps = [s.params.top_p for s in seqs]
    mins = [s.params.min_p for s in seqs]
    if all(k >= vocab for k in ks) and all(p >= 1.0 for p in ps) and not any(mins):
        return x, None
    order = mx.argsort(-x, axis=-1)
    sx = mx.take_along_axis(x, order, axis=-1)
    probs = mx.softmax(sx, axis=-1)
    keep = mx.arange(vocab)[None] < mx.array(ks)[:, None]
    keep = keep & ((mx.cumsum(probs, axis=-1) - probs) < mx.array(ps)[:, None])
    keep = keep & (probs >= mx.array(mins)[:, None] * probs[:, :1])
    return mx.where(keep, sx, -mx.inf), order


def _gumbel(shape: tuple[int, int], seqs: list[Sequence]) -> mx.array:
    noise = mx.random.gumbel(shape=shape)
    seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
    if seeded:
        rows = []
        for i in seeded:
            s = seqs[i]
            key = mx.random.key(hash((s.params.seed, s.index, s.num_output_tokens)) & (2**63 - 1))
            rows.append(mx.random.gumbel(shape=(shape[1],), key=key))
        noise[mx.array(seeded)] = mx.stack(rows)
    return noise


def sample(logits: mx.array, seqs: list[Sequence]) -> SampleResult:
    """logits: (B, V), one row per sequence in `seqs`. Returns lazy arrays."""
    logits = logits.astype(mx.float32)
    x = _apply_grammars(_apply_penalties(_apply_logit_bias(logits, seqs), seqs), seqs)
    tokens = mx.argmax(x, axis=-1)
    if not all(s.params.greedy for s in seqs):
        temps = mx.array([s.params.temperature or 1.0 for s in seqs], dtype=mx.float32)
        scaled, order = _filter(x / temps[:, None], seqs)
        choice = mx.argmax(scaled + _gumbel(scaled.shape, seqs), axis=-1)
        if order is not None:
            choice = mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        greedy = mx.array([s.params.greedy for s in seqs])
        tokens = mx.where(greedy, tokens, choice)
    tokens = tokens.astype(mx.int32)

    want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
    if not want:
        return SampleResult(tokens)
    return SampleResult(tokens, *token_logprobs(logits, tokens, max(want)))


def token_logprobs(logits: mx.array, tokens: mx.array, k: int):
    """The logprob of `tokens[i]` under row i of `logits` (B, V), and with `k` > 0 the
    k likeliest ids and their logprobs per row, likeliest first (lazy arrays)."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if k == 0:
        return picked, None, None
    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    return picked, mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(top_lp, order, axis=-1)
