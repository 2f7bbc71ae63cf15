"""One forward pass per step over a packed, ragged batch.

The batch is the step's new tokens of every scheduled sequence, packed as (T, 1):
decodes and prefill chunks share the pass, with no padding in the projections or the
MLP. Positions, slots and block tables come from the sequences' block ids. Logits are
computed only for the rows that sample: the last token of each sequence that reaches
its end this step. The last layer attends only for them too (`SampledRows`).
"""

import logging
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .attention import PADDING_FREE, available, build_metadata, get_backend, install_hook, prefill_fn, resolve_backend
from .attention.metadata import padded_rows
from .decode_graph import DecodeGraph
from .errors import UnsupportedModelError
from .kv.paged_cache import KVPool, PagedLayerCache, SampledRows, StepContext
from .kv.window_slots import WindowSlots
from .models.loader import has_attention_sinks, kv_geometry
from .outputs import Logprob
from .sampling import SampleResult, sample, token_logprobs
from .scheduler import ScheduledSeq
from .sequence import PLACEHOLDER

log = logging.getLogger(__name__)

# Architectures whose `Model.__call__` is `model.model(...)` then the tied embedding or
# `lm_head`; for them logits are computed for sampled rows only. Others run whole.
_SPLIT_HEAD_MODULES = {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"}
GATHER_COMPILE_MAX_BATCH = 8   # decode batches compiled under `auto` with `gather`


@dataclass
class SampledToken:
    token_id: int
    logprob: Logprob | None


@dataclass
class PromptRows:
    """Prompt positions whose next token's logprob a step computes: for each sequence
    that wants prompt logprobs, `count` positions from `first` (position p gives prompt
    token p + 1's logprob), at rows `row`.. of the step's packed batch. The arrays are
    lazy until `ModelRunner.collect`, which puts the host's `Logprob`s in `entries`, one
    list per (seq, first, count, row)."""

    spans: list[tuple]
    logprobs: mx.array
    top_ids: mx.array | None
    top_logprobs: mx.array | None
    entries: list[list[Logprob]] = field(default_factory=list)


@dataclass
class PendingStep:
    """A step queued on the device: its sampling sequences, in row order, and the lazy
    sampled arrays; `row_of` maps a sequence id to its row. A step whose sampling waits
    for the host (`deferred`: structured outputs, whose masks need the previous step's
    tokens consumed) holds its `logits` until `ModelRunner.sample` makes `result`."""

    seqs: list
    result: SampleResult | None
    row_of: dict[int, int]
    positions: list[int] = field(default_factory=list)   # where each sampled token goes
    prompt: PromptRows | None = None
    logits: mx.array | None = None
    num_tokens: int = 0   # new tokens the step computes, all sequences together

    @property
    def deferred(self) -> bool:
        return self.logits is not None


class ModelRunner:
    """`windows`: each layer's attention window (`layer_windows`), None for full
    attention; `window`: where sliding-window layers keep their K/V in a pool of window
    slots of their own (`WindowSlots`); None keeps every layer's in the main pool."""

    def __init__(self, model, windows: list[int | None], num_blocks: int, block_size: int, dtype: mx.Dtype,
                 attention_backend: str = "gather", compile_decode: bool | None = False,
                 graph_prefill_tokens: int = 0, prefill_kernel: bool = True,
                 window: WindowSlots | None = None):
        self.model = model
        self.block_size = block_size
        num_layers, kv_heads, head_dim = kv_geometry(model)
        self.window = window
        # Each layer's pool and its index there.
        apart = [window is not None and w is not None for w in windows]
        index = [sum(1 for j in range(i) if apart[j] == apart[i]) for i in range(num_layers)]
        self.pool = KVPool(apart.count(False), num_blocks, block_size, kv_heads, head_dim, dtype)
        self.window_pool = None if window is None else \
            KVPool(apart.count(True), window.num_slots, block_size, kv_heads, head_dim, dtype)
        heads = model.args.num_attention_heads
        self.attention_backend, why = resolve_backend(attention_backend, heads, kv_heads, head_dim,
                                                      block_size, dtype, min(filter(None, windows), default=None),
                                                      has_attention_sinks(model))
        prefill, prefill_why = None, "prefill kernel off"
        if prefill_kernel:
            prefill, prefill_why = prefill_fn(self.attention_backend, heads, kv_heads, head_dim, block_size, dtype)
        log.info("attention backend %s (%s; %s)", self.attention_backend, why, prefill_why)
        self.ctx = StepContext(attend_fn=get_backend(self.attention_backend), prefill_fn=prefill)
        self.wctx = StepContext(attend_fn=self.ctx.attend_fn, prefill_fn=prefill)   # the window pool's layers
        self.caches = [PagedLayerCache(self.window_pool if a else self.pool, j, self.wctx if a else self.ctx,
                                       last=i == num_layers - 1, window=w)
                       for i, (w, a, j) in enumerate(zip(windows, apart, index))]
        self.last_ctx = self.caches[-1].ctx
        # Where fused attention builds a plan per shape (CUDA), prefill attention keeps
        # to few shapes or does without it (`make_group`).
        self.plan_per_shape = available("cuda")
        # There MLX's matmuls plan per shape as well: uncompiled steps pad their packed
        # rows, and the rows they compute logits for, to a grid (`padded_rows`).
        self.pad_rows = self.plan_per_shape
        install_hook(model)
        self._split_head = type(model).__module__ in _SPLIT_HEAD_MODULES
        self.padding_free = self.attention_backend in PADDING_FREE
        # `None` (auto) compiles where it was measured to pay: every decode step with the
        # CUDA kernel; with `gather`, small batches only (on the CPU it gained 3-30 % at
        # one to eight sequences, broke even at 16 and lost 4 % at 32, where padding each
        # context to a multiple of 8 blocks costs more than tracing saves); not with the
        # Metal kernel, unmeasured.
        max_batch = None
        if compile_decode is None:
            compile_decode = self.attention_backend in ("cuda", "gather")
            if self.attention_backend == "gather":
                max_batch = GATHER_COMPILE_MAX_BATCH
        self.decode_graph = None
        if compile_decode:
            self.decode_graph = DecodeGraph(self._decode_logits, self.ctx, self.pool, self.padding_free,
                                            max_batch, self._window_pool())
        # Prefill chunks of up to this many tokens (prefix-cache hits, chat turns) join
        # a step's decodes in the compiled graph, one row a token, where the step fits a
        # bucket traced at start-up: such a step is host-bound, and eagerly it builds and
        # encodes the whole model's kernels one by one. 0: they run eagerly.
        self.graph_prefill_tokens = graph_prefill_tokens
        if graph_prefill_tokens and self.decode_graph is None:
            log.warning("graph_prefill_tokens does nothing without compile_decode: no graph to run in")

    def _window_pool(self):
        """(context, pool, slots) of the layers in the window pool, or None."""
        return None if self.window is None else (self.wctx, self.window_pool, self.window)

    def _window_tables(self) -> dict:
        """`build_metadata`'s arguments for the window pool's tables, if there is one."""
        if self.window is None:
            return {}
        return {"slot_of": self.window.slot_of, "window_scratch_slot": self.window_pool.scratch_slot}

    def pools(self) -> list[KVPool]:
        return [self.pool] + ([self.window_pool] if self.window_pool is not None else [])

    def _decode_logits(self, inputs: mx.array) -> mx.array:
        return self._logits(inputs, None, self._split_head)

    # -- forward ---------------------------------------------------------
    def _logits(self, inputs: mx.array, rows: mx.array | None, split_head: bool) -> mx.array:
        """Logits of `rows` of the packed batch (all rows, in order, when None)."""
        pick = (lambda x: x[:, 0]) if rows is None else (lambda x: x[rows, 0])
        if split_head:
            h = pick(self.model.model(inputs, cache=self.caches))
            if self.model.args.tie_word_embeddings:
                return self.model.model.embed_tokens.as_linear(h)
            return self.model.lm_head(h)
        return pick(self.model(inputs, cache=self.caches))

    def forward(self, scheduled: list[ScheduledSeq], split_head: bool | None = None,
                prev: "PendingStep | None" = None, prompt_spans: list[tuple] = ()) -> mx.array:
        """Build and return the lazy logits (S, V) of the sampling rows, in order, then of
        the prompt positions in `prompt_spans` ((seq, first, count, row), see `PromptRows`).
        An input token still in flight (`PLACEHOLDER`) is read from `prev`'s sampled
        tokens on the device, so this step can be queued before the previous one is read
        back. A step of decodes goes through the compiled decode graph when there is
        one, and so may one with short prefill chunks beside them (`_through_graph`)."""
        tables, starts, lengths, tokens, rows, ends = [], [], [], [], [], []
        fill_rows, fill_src = [], []
        t = 0
        self.ctx.sampled = self.wctx.sampled = None
        for s in scheduled:
            end = s.start + s.num_tokens
            tables.append(s.seq.block_ids[:-(-end // self.block_size)])
            starts.append(s.start)
            lengths.append(s.num_tokens)
            toks = s.seq.token_ids[s.start:end]
            if toks[-1] == PLACEHOLDER:
                fill_rows.append(t + s.num_tokens - 1)
                fill_src.append(prev.row_of[s.seq.seq_id])
                toks = toks[:-1] + [0]
            tokens.extend(toks)
            t += s.num_tokens
            if s.samples:
                rows.append(t - 1)
                ends.append((end, tables[-1]))
        for _, _, count, row in prompt_spans:
            rows.extend(range(row, row + count))
        if len(fill_rows) == t and fill_src == list(range(t)) and prev.result.tokens.shape[0] == t:
            inputs = prev.result.tokens   # steady decode: last step's samples, in order
        else:
            inputs = mx.array(np.asarray(tokens, dtype=np.int32))
            if fill_rows:
                inputs[mx.array(fill_rows)] = prev.result.tokens[mx.array(fill_src)]
        if self._through_graph(scheduled, t, split_head, prompt_spans):
            if t > len(scheduled):   # prefill chunks: a row a token, each with its sequence's table
                tables = [tb for s, tb in zip(scheduled, tables) for _ in range(s.num_tokens)]
                starts = [p for s in scheduled for p in range(s.start, s.start + s.num_tokens)]
            logits = self.decode_graph(inputs, tables, starts)
            return logits if len(rows) == t else logits[mx.array(rows, dtype=mx.int32)]
        pad = padded_rows(t) - t if self.pad_rows else 0
        if pad:
            inputs = mx.concatenate([inputs, mx.zeros((pad,), dtype=inputs.dtype)])
        self.ctx.meta = build_metadata(tables, starts, lengths, self.block_size, split_decodes=not self.padding_free,
                                       plan_per_shape=self.plan_per_shape, pad_rows=pad,
                                       scratch_slot=self.pool.scratch_slot, **self._window_tables())
        self.wctx.meta = self.ctx.meta.window
        # The last layer attends for the sampling rows alone, unless prompt rows are
        # wanted too: then it runs for all, as a plain prefill does.
        if rows and len(rows) < t and not prompt_spans:
            self.last_ctx.sampled = self._sampled_rows(rows, ends)
        split = self._split_head if split_head is None else split_head
        n = len(rows)
        if n == t and not pad and not prompt_spans:   # every row samples, in order, none pads
            return self._logits(inputs[:, None], None, split)
        if self.pad_rows:   # the logits' rows on a grid too; the extra ones repeat the last
            rows = rows + rows[-1:] * (padded_rows(n, 8) - n)
        logits = self._logits(inputs[:, None], mx.array(rows, dtype=mx.int32), split)
        return logits if len(rows) == n else logits[:n]

    def _through_graph(self, scheduled: list[ScheduledSeq], t: int, split_head: bool | None,
                       prompt_spans) -> bool:
        """Whether a step of `t` rows runs through the compiled decode graph: decodes
        only, or with short prefill chunks beside them (`graph_prefill_tokens`) if its
        rows fit a warm bucket. Prompt logprobs and the start-up check run eagerly."""
        graph = self.decode_graph
        if graph is None or split_head is not None or prompt_spans or not graph.accepts(t):
            return False
        if t == len(scheduled):
            return True
        return max(s.num_tokens for s in scheduled) <= self.graph_prefill_tokens and graph.warm(t)

    def _sampled_rows(self, rows: list[int], ends: list[tuple[int, list[int]]]) -> SampledRows:
        """The sampling rows (each sequence's end and block table in `ends`) as one-token
        queries over their whole contexts, longest context first (the order
        `build_metadata` groups by)."""
        order = sorted(range(len(rows)), key=lambda i: -ends[i][0])
        window = self._window_tables() if self.last_ctx is self.wctx else {}
        meta = build_metadata([ends[i][1] for i in order], [ends[i][0] - 1 for i in order],
                              [1] * len(rows), self.block_size, split_decodes=not self.padding_free,
                              plan_per_shape=self.plan_per_shape, window_only=bool(window), **window)
        return SampledRows(mx.array([rows[i] for i in order], dtype=mx.int32), meta)

    def build(self, scheduled: list[ScheduledSeq], prev: "PendingStep | None" = None,
              defer_sampling: bool = False) -> "PendingStep":
        """Build a step's graph, forward pass and sampling, lazily: nothing is queued on
        the device yet, so this runs while `prev` does. `defer_sampling`: the forward
        pass alone; `sample` adds the sampling once the host is ready for it."""
        spans = self._prompt_spans(scheduled)
        logits = self.forward(scheduled, prev=prev, prompt_spans=spans)
        seqs = [s.seq for s in scheduled if s.samples]
        sampling = logits[:len(seqs)] if spans else logits
        deferred = defer_sampling and bool(seqs)
        step = PendingStep(seqs, sample(sampling, seqs) if seqs and not deferred else None,
                           {seq.seq_id: i for i, seq in enumerate(seqs)},
                           logits=sampling if deferred else None,
                           num_tokens=sum(s.num_tokens for s in scheduled))
        if spans:
            targets = [seq.token_ids[p + 1] for seq, first, count, _ in spans for p in range(first, first + count)]
            k = max(seq.params.prompt_logprobs for seq, *_ in spans)
            lps = token_logprobs(logits[len(seqs):].astype(mx.float32), mx.array(targets, dtype=mx.int32), k)
            step.prompt = PromptRows(spans, *lps)
        return step

    @staticmethod
    def _prompt_spans(scheduled: list[ScheduledSeq]) -> list[tuple]:
        """The prompt positions of this step whose logprobs are still wanted, with the
        row each span begins at (the batch packs the sequences' tokens in order)."""
        spans, row = [], 0
        for s in scheduled:
            seq = s.seq
            if seq.wants_prompt_logprobs:
                first = max(s.start, len(seq.prompt_logprobs) - 1)
                last = min(s.start + s.num_tokens, seq.num_prompt_tokens - 1)
                if last > first:
                    spans.append((seq, first, last - first, row + first - s.start))
            row += s.num_tokens
        return spans

    def queue(self, pending: "PendingStep") -> None:
        """Queue a built step on the device (`mx.async_eval`) and return. Encoding the
        step's kernels here takes host time, with the GIL released.

        Call `wait()` first if a step is still running: MLX writes the pool in place
        only if no queued work still holds its buffer, and queued behind a running
        step, every KV write would copy its layer's whole pool array."""
        res, pr = pending.result, pending.prompt
        outs = [] if res is None else res.arrays()
        if pending.deferred:
            outs.append(pending.logits)
        if pr is not None:
            outs += [pr.logprobs, pr.top_ids, pr.top_logprobs]
        mx.async_eval(*(a for a in outs if a is not None), *(a for p in self.pools() for a in p.arrays()))

    @staticmethod
    def sample(pending: "PendingStep") -> None:
        """Sample a deferred step's logits, queued behind its forward pass, with the
        sequences' state as the host has it now (their grammars advanced past the
        previous step's tokens)."""
        pending.result = sample(pending.logits, pending.seqs)
        pending.logits = None
        mx.async_eval(*pending.result.arrays())

    @staticmethod
    def wait() -> None:
        """Block until the work queued on the device has finished."""
        mx.synchronize()

    @staticmethod
    def collect(pending: "PendingStep") -> list[SampledToken]:
        """Wait for a launched step and bring its sampled tokens to the host, and its
        prompt logprobs into `pending.prompt.entries`."""
        pr = pending.prompt
        if pr is not None:
            lps = pr.logprobs.tolist()
            ids = pr.top_ids.tolist() if pr.top_ids is not None else None
            tops = pr.top_logprobs.tolist() if pr.top_logprobs is not None else None
            i = 0
            for seq, first, count, _ in pr.spans:
                k, entries = seq.params.prompt_logprobs, []
                for p in range(first, first + count):
                    top = list(zip(ids[i][:k], tops[i][:k])) if k else []
                    entries.append(Logprob(seq.token_ids[p + 1], lps[i], top))
                    i += 1
                pr.entries.append(entries)
        res = pending.result
        if res is None:
            return []
        tokens = res.tokens.tolist()
        if res.logprobs is None:
            return [SampledToken(tok, None) for tok in tokens]
        lps = res.logprobs.tolist()
        top_ids = res.top_ids.tolist() if res.top_ids is not None else None
        top_lps = res.top_logprobs.tolist() if res.top_logprobs is not None else None
        out = []
        for i, (seq, tok) in enumerate(zip(pending.seqs, tokens)):
            k = seq.params.logprobs
            if k is None:
                out.append(SampledToken(tok, None))
                continue
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k else []
            out.append(SampledToken(tok, Logprob(tok, lps[i], top)))
        return out

    # -- start-up self-check ---------------------------------------------------
    def verify(self, atol: float | None = None) -> None:
        """Run a 3-token sequence through the paged path (a 2-token prefill chunk, then
        one decode) in block 0, and compare with mlx-lm's own cache. Catches models
        whose attention bypasses the hook, and a head split that does not hold.
        Block 0 is free at start-up, so nothing is disturbed."""
        from .sampling_params import SamplingParams
        from .sequence import Sequence

        if atol is None:
            # Wrong attention is off by O(1). Half precision rounds to a few percent;
            # float32 to ~1e-3 where MLX runs its matmuls in TF32 (CUDA, M5-class GPUs).
            atol = 1e-2 if self.pool.keys[0].dtype == mx.float32 else 6e-2
        probe = [1, 2, 3]
        ref = self.model(mx.array([probe]), cache=make_prompt_cache(self.model))[0].astype(mx.float32)
        seq = Sequence("verify", 0, probe[:2], SamplingParams())
        seq.block_ids = [0]
        for c in self.caches:
            c.attended = 0
        if self.window is not None:   # block 0 borrows slot 0, free at start-up too
            self.window.slot_of[0] = 0
        try:
            self._verify(seq, probe[2], ref, atol)
        finally:
            if self.window is not None:
                self.window.slot_of[0] = self.window.scratch

    def _verify(self, seq, third: int, ref: mx.array, atol: float) -> None:
        got_prefill = self.forward([ScheduledSeq(seq, 2, 0)], split_head=False)
        seq.token_ids.append(third)
        got_decode = self.forward([ScheduledSeq(seq, 1, 2)], split_head=False)
        if any(c.attended != 2 for c in self.caches):
            raise UnsupportedModelError(
                f"{type(self.model).__module__}: attention does not go through mlx-lm's "
                "scaled_dot_product_attention, so the paged KV cache cannot serve it")
        scale = float(mx.abs(ref).max().item()) or 1.0
        for got, want in ((got_prefill[0], ref[1]), (got_decode[0], ref[2])):
            err = float(mx.abs(got.astype(mx.float32) - want).max().item()) / scale
            if err > atol:
                raise UnsupportedModelError(
                    f"{type(self.model).__module__}: paged attention disagrees with mlx-lm "
                    f"(relative error {err:.3g} > {atol}); the architecture is not supported")
        if self._split_head:
            split = self.forward([ScheduledSeq(seq, 1, 2)], split_head=True)[0]
            err = float(mx.abs(split.astype(mx.float32) - got_decode[0].astype(mx.float32)).max().item())
            if err / scale > atol:
                self._split_head = False
