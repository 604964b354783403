"""Step-level batched decoding for causal models: many chats share every forward pass.

One scheduler thread owns the running batch: its rows, their shared KV cache (a transformers
`DynamicCache`, rows left-padded to one width) and the attention mask. Each turn of its loop
admits the requests that arrived (one left-padded prefill for all of them, whose last logits
give each its first token at once), merges their cache rows into the running batch, then runs
one decode step for every row. A request that arrives while others generate therefore waits
for at most one step and one prefill, never for a generation to end; one that arrives while a
prefill runs (the later chats of a burst) is admitted in the same turn, before the step.

Requests that arrive together are prefilled in groups, and each group's first tokens go out
before the next group (or step) runs: the scheduler waits, briefly and boundedly, for the event
loop to have sent them (`_flush`). It waits so after every step as well: the event loop then
sends the step's tokens and takes in the requests that came meanwhile with the GIL to itself,
instead of winning it back from a running step again and again. Before it prefills, it waits
(at most GATHER_S a turn) for the requests the event loop is still making ready (`_gather`),
so that those of a burst share one prefill.

The groups are sized to minimise the waiting requests' mean time to first token at the cost
the scheduler has fitted to its prefills (prefill_cost): with a cost per group c (the prefill's
cost per call, plus the hand-over to the event loop that follows it) and per prompt p, n
requests in groups of g wait on average about (n/g + 1)/2 * (c + g*p), least at
g = sqrt(n*c/p). Where a prefill costs what its tokens cost (a CPU on a model of some size),
one prefill of seven prompts would make the first six wait for the seventh; where the cost is
mostly per call (a GPU, or a tiny model), every request that arrived joins the one prefill.

Rows leave as they finish (EOS, a stop sequence, max_tokens, the context limit) or when their
client goes away (the request's cancel event); the columns that only padding still uses are
cut off, so the cache stays as wide as its longest live row. Sampling is per row, each with
its own torch.Generator, so a request's temperature, top_p, top_k, min_p and seed mean the
same whatever else runs beside it; a row that asks for logit_bias or a penalty keeps its own
state for them (LogitShaping), which rows without pay nothing for. Each row's text grows
through a Detokenizer, which decodes a window of a few ids per token, not the row's whole text
again at every step.

Models whose cache is not made of plain dynamic layers (sliding windows, linear attention)
cannot have rows merged into a running batch; for them the scheduler forms a new batch only
when the previous one has ended (static batching). Models whose rotary factors depend on the
batch's longest position (longrope, dynamic NTK) decode one request at a time, and a longrope
one is prefilled again where its factors switch, as `generate` does.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from solar_host.servers.detokenizer import Detokenizer
from solar_host.servers.hf_protocol import GenParams, StopScanner
from solar_host.servers.model_facts import batch_changes_rows, rope_switch_length, vocab_size
from solar_host.servers.prefill_cost import PrefillCost
from solar_host.servers.sampling import LogitShaping, sample

# What one step produced: (callback, argument) pairs to call on the event loop.
Deliveries = list[tuple[Callable[[Any], None], Any]]
# Deliver them on the event loop (one wake-up per step); the second argument, when given, is
# called on the loop once what those callbacks set off has run.
Post = Callable[[Deliveries, Callable[[], None] | None], None]

# After a prefill the scheduler waits for the event loop to send the first tokens before its
# next step, for at most this long (see _flush).
HANDOFF_S = 0.010
# Weight of the newest hand-over in their running average.
HANDOFF_WEIGHT = 0.2
# Times a turn of the scheduler takes in requests that arrived during its own prefills before
# it runs the step (see _run).
ADMIT_ROUNDS = 4
# Longest wait in one turn for requests the event loop has begun and not yet submitted, before
# the scheduler prefills those that are queued (see _gather), and how often it looks again.
GATHER_S = 0.010
GATHER_POLL_S = 0.001


@dataclass
class GenResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class Cancelled(Exception):
    """The request's client went away; its row was dropped."""


@dataclass
class GenRequest:
    """One generation. `on_piece` and `on_done` are called on the event loop (through Post)."""

    ids: list[int]
    params: GenParams
    max_new: int
    on_piece: Callable[[str], None] | None
    on_done: Callable[[GenResult | BaseException], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    # Its on_done is posted (DecodeScheduler._end): once, whatever fails after.
    ended: bool = False


@dataclass
class _Row:
    req: GenRequest
    scanner: StopScanner
    gen: torch.Generator | None
    text: Detokenizer  # the ids generated so far (text.ids) and their text
    # Its logit_bias and penalties, for a row that asks for any (None: the common path).
    shaping: LogitShaping | None = None

    @property
    def new(self) -> list[int]:
        return self.text.ids


class DecodeScheduler:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str,
        max_batch: int,
        post: Post,
        threads: int | None = None,
        arriving: Callable[[], int] | None = None,
    ):
        self.model, self.tok, self.device = model, tokenizer, device
        self.max_batch = max(1, max_batch)
        if batch_changes_rows(model.config):
            self.max_batch = 1
        self.rope_switch = rope_switch_length(model.config)
        self.vocab = vocab_size(model)  # the width of the logits
        self.prefill_cost = PrefillCost()  # fitted to the prefills so far
        self.handoff_s: float | None = None  # recent hand-overs after a prefill (average)
        self._post = post
        self._threads = threads
        # Requests the event loop has begun and not yet submitted (read without a lock: a
        # hint; see _gather). None: none are waited for.
        self._arriving = arriving
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        accepted = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values to cache (the old name warns, then goes).
        self._cache_kw = "cache" if "cache" in accepted else "past_key_values"
        self._keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        self._cond = threading.Condition()
        self._pending: list[GenRequest] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Owned by the scheduler thread only.
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._mergeable: bool | None = None  # known after the first prefill
        self._out: Deliveries = []
        # Counters (read by stats(); plain ints, written by the scheduler thread).
        self.steps = 0
        self.prefills = 0
        self.admitted = 0
        self.finished = 0
        self.cancelled = 0
        self.failed = 0  # requests whose prefill, row or step failed
        self.reprefills = 0  # whole-sequence prefills at a longrope switch (_step)
        self.max_rows = 0
        self.rows_now = 0

    # ---- the event loop's side -----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hf-decode", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, req: GenRequest) -> None:
        with self._cond:
            self._pending.append(req)
            self._cond.notify()

    def busy(self) -> int:
        """Requests queued or generating."""
        with self._cond:
            return len(self._pending) + self.rows_now

    def stats(self) -> dict[str, Any]:
        with self._cond:
            waiting = len(self._pending)
        return {
            "rows": self.rows_now,
            "waiting": waiting,
            "max_rows": self.max_rows,
            "max_batch_size": self.max_batch,
            "steps": self.steps,
            "prefills": self.prefills,
            "admitted": self.admitted,
            "finished": self.finished,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "reprefills": self.reprefills,
            "joins_running_batch": self._mergeable is not False,
            **_ms_fit(self.prefill_cost.fit()),
            "handoff_ms": None if self.handoff_s is None else round(self.handoff_s * 1000, 3),
        }

    # ---- the scheduler thread ------------------------------------------------------------

    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)  # per thread (OpenMP); this one decodes
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._rows:
                    self._cond.wait()
                if self._stopping:
                    pending, self._pending = self._pending, []
                    break
            taken: list[GenRequest] = []  # every request this turn took from the queue
            try:
                with torch.inference_mode():
                    self._drop(lambda r: r.req.cancel.is_set(), None)
                    # Requests that came while a prefill and its hand-over ran are admitted
                    # before the step: they would otherwise wait a whole step more, behind rows
                    # that already have their first token. Bounded: a stream of arrivals does
                    # not hold the running rows back for more than ADMIT_ROUNDS prefills.
                    gather_until = time.perf_counter() + GATHER_S
                    for _ in range(ADMIT_ROUNDS):
                        self._gather(gather_until)
                        new = self._take()
                        if not new:
                            break
                        taken += new
                        for group in self._prefill_groups(new):
                            self._admit(group)
                            self._flush(handoff=True, measure=True)  # first tokens go out now
                    if self._rows:
                        self._step()
            except Exception as err:  # a step (or a merge) failed: every row of the batch fails
                for r in [row.req for row in self._rows] + taken:
                    if not r.ended:
                        self.failed += 1
                    self._end(r, err)
                self._reset()
            self.rows_now = len(self._rows)
            # The loop's turn: it sends the tokens, and parses and submits the requests that
            # came meanwhile, before the next step takes the GIL from it again.
            self._flush(handoff=True)
        for req in pending + [r.req for r in self._rows]:
            self._end(req, Cancelled("server shutting down"))
        self._flush()

    def _gather(self, until: float) -> None:
        """With requests queued, wait (until `until`, at most) while others are still on their
        way through the event loop, so that they join the same prefill.

        The requests of a burst reach the scheduler one by one, as the event loop parses and
        tokenizes each; prefilled as they came, the first would be prefilled alone, and every
        later one would wait for the prefills and steps before it, which also take the GIL from
        the event loop still working on the rest. Waiting here lets go of the GIL."""
        if self._arriving is None:
            return
        with self._cond:
            while not self._stopping and self._arriving() > 0:
                if len(self._rows) + len(self._pending) >= self.max_batch:
                    return  # no room for more in this prefill
                left = until - time.perf_counter()
                if left <= 0:
                    return
                self._cond.wait(min(left, GATHER_POLL_S))

    def _take(self) -> list[GenRequest]:
        """The queued requests the batch has room for, in arrival order; those whose client
        has already gone are ended here, never prefilled."""
        with self._cond:
            if self._stopping:
                return []  # the next turn ends them all
            room = self.max_batch - len(self._rows)
            if self._rows and self._mergeable is False:
                room = 0  # static batching: wait for the batch to end
            new, self._pending = self._pending[:room], self._pending[room:]
        live = []
        for r in new:
            if r.cancel.is_set():
                self.cancelled += 1
                self._end(r, Cancelled("client disconnected"))
            else:
                live.append(r)
        return live

    def _prefill_groups(self, reqs: list[GenRequest]) -> list[list[GenRequest]]:
        """`reqs` in arrival order, cut into groups of near-equal size that minimise their mean
        wait for a first token (module docstring). One group until the cost per prompt is known
        apart from the cost per call, and where rows cannot join a running batch (the first
        prefill is the batch)."""
        fit = self.prefill_cost.fit()
        if len(reqs) < 2 or not self._mergeable or fit is None:
            return [reqs] if reqs else []
        per_call, per_token = fit
        # Each group's prefill is followed by a hand-over before the next group's starts: to
        # the requests still waiting that is a cost per group, as the call itself is.
        per_call += self.handoff_s or 0.0
        per_prompt = per_token * sum(len(r.ids) for r in reqs) / len(reqs)
        if per_prompt <= 0:
            return [reqs]
        size = max(1, round(math.sqrt(len(reqs) * per_call / per_prompt)))
        count = -(-len(reqs) // size)
        base, extra = divmod(len(reqs), count)
        groups, start = [], 0
        for k in range(count):
            end = start + base + (1 if k < extra else 0)
            groups.append(reqs[start:end])
            start = end
        return groups

    def _flush(self, handoff: bool = False, measure: bool = False) -> None:
        """Post what the batch produced to the event loop. With `handoff`, wait (at most
        HANDOFF_S) until the loop has acted on it: after a prefill, so that the first tokens
        go out before the next step rather than while it runs, and after a step, so that the
        loop sends them and takes in new requests without a step running beside it. With
        `measure`, the wait counts in `handoff_s` (a prefill's: the grouping's cost per group).

        Waiting costs the loop's own time and saves more: this thread and the event loop share
        the GIL, which a decode step lets go of and takes back at every torch operation, so a
        loop woken by the posted tokens can lose the race for it again and again while a step
        runs (CPython counts each take as a switch, and only asks the holder to drop the GIL
        after an interval with none)."""
        if not self._out:
            return
        out, self._out = self._out, []
        handed = threading.Event() if handoff else None
        try:
            self._post(out, None if handed is None else handed.set)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            return
        if handed is not None:
            started = time.perf_counter()
            handed.wait(HANDOFF_S)
            if not measure:
                return
            took = time.perf_counter() - started
            last = self.handoff_s
            self.handoff_s = took if last is None else last + HANDOFF_WEIGHT * (took - last)

    def _end(self, req: GenRequest, outcome: GenResult | BaseException) -> None:
        """Post `req`'s outcome, once: a request that already ended (finished in its prefill,
        refused, cancelled) is not told again that a later failure of the batch was its own."""
        if req.ended:
            return
        req.ended = True
        self._out.append((req.on_done, outcome))

    def _reset(self) -> None:
        self._rows, self._cache, self._mask = [], None, None

    def _admit(self, reqs: list[GenRequest]) -> None:
        """Prefill the new requests together and merge their rows into the running batch.

        A request that cannot become a row (no prompt ids, a seed its generator refuses) fails
        alone, before the prefill, which the others then share."""
        rows = []
        for r in reqs:
            try:
                if not r.ids:
                    raise ValueError("the prompt has no tokens")
                rows.append(
                    _Row(
                        r,
                        StopScanner(r.params.stop),
                        _generator(r.params, self.device),
                        Detokenizer.of(self.tok),
                        LogitShaping.of(r.params, r.ids, self.vocab, self.device),
                    )
                )
            except Exception as err:  # refused before any model work (not counted as failed)
                self._end(r, err)
        reqs = [row.req for row in rows]
        if not reqs:
            return
        started = time.perf_counter()
        try:
            logits, cache, m = self._prefill([r.ids for r in reqs])
        except Exception as err:
            # This group's prefill failed (out of memory on a long prompt, a model that cannot
            # take it): the running batch has not been touched, so only this group fails.
            for r in reqs:
                self.failed += 1
                self._end(r, err)
            return
        self.prefill_cost.record(m.numel(), time.perf_counter() - started)
        self.prefills += 1
        self.admitted += len(reqs)
        if self._mergeable is None:
            layers = getattr(cache, "layers", None)  # transformers 4.x caches have none
            self._mergeable = bool(layers) and all(
                type(layer).__name__ == "DynamicLayer" for layer in layers
            )
        if self._rows:
            self._merge(cache, m)
        else:
            self._cache, self._mask = cache, m
        self._rows.extend(rows)
        self.rows_now = len(self._rows)
        self.max_rows = max(self.max_rows, len(self._rows))
        self._accept(rows, logits, first=len(self._rows) - len(rows))

    def _prefill(self, seqs: list[list[int]]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One forward pass over `seqs`, left-padded to one width: (each one's last logits,
        their new cache, their attention mask)."""
        from transformers import DynamicCache

        width = max(len(ids) for ids in seqs)
        x = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        m = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, ids in enumerate(seqs):
            x[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            m[i, width - len(ids) :] = 1
        x, m = x.to(self.device), m.to(self.device)
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers 4.x: no config argument
            cache = DynamicCache()
        out = self.model(
            input_ids=x,
            attention_mask=m,
            position_ids=(m.cumsum(1) - 1).clamp(min=0),
            use_cache=True,
            **{self._cache_kw: cache},
            **self._keep_kw,
        )
        logits = out.logits[:, -1, :]
        if self.device.startswith("cuda"):  # kernels run asynchronously: time the work
            torch.cuda.synchronize(self.device)
        return logits, cache, m

    def _merge(self, cache: Any, mask: torch.Tensor) -> None:
        """Append `cache`'s rows to the running cache, left-padding the narrower of the two."""
        assert self._mask is not None
        old_w, new_w = self._mask.shape[1], mask.shape[1]
        w = max(old_w, new_w)
        pad = torch.nn.functional.pad
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat(
                [pad(old.keys, (0, 0, w - old_w, 0)), pad(new.keys, (0, 0, w - new_w, 0))]
            )
            old.values = torch.cat(
                [pad(old.values, (0, 0, w - old_w, 0)), pad(new.values, (0, 0, w - new_w, 0))]
            )
        self._mask = torch.cat([pad(self._mask, (w - old_w, 0)), pad(mask, (w - new_w, 0))])

    def _step(self) -> None:
        assert self._mask is not None
        if self.rope_switch is not None and int(self._mask.sum(1).max()) == self.rope_switch:
            # The next position is the first past a longrope model's switch: every cached key
            # was rotated with the short factors (rope_switch_length). Prefill the whole
            # sequence again, as generate does; its last logits are this step's.
            rows = self._rows
            logits, self._cache, self._mask = self._prefill([r.req.ids + r.new for r in rows])
            self.steps += 1
            self.reprefills += 1
            self._accept(rows, logits, first=0)
            return
        last = torch.tensor([[r.new[-1]] for r in self._rows], dtype=torch.long, device=self.device)
        ones = torch.ones((len(self._rows), 1), dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        pos = self._mask.sum(1, keepdim=True) - 1
        out = self.model(
            input_ids=last,
            attention_mask=self._mask,
            position_ids=pos,
            use_cache=True,
            **{self._cache_kw: self._cache},
            **self._keep_kw,
        )
        self.steps += 1
        self._accept(self._rows, out.logits[:, -1, :], first=0)

    def _accept(self, rows: list[_Row], logits: torch.Tensor, first: int) -> None:
        """Pick each row's next token from its logits; finish the rows that are done."""
        greedy = logits.argmax(-1).tolist()
        done: dict[int, str | BaseException] = {}
        for i, row in enumerate(rows):
            try:
                t = _pick(row, logits, i, greedy[i])
            except Exception as err:  # this row's sampling alone: the batch goes on
                done[first + i] = err
                continue
            piece = row.scanner.update(row.text.add(t))
            if piece and row.req.on_piece is not None:
                self._out.append((row.req.on_piece, piece))
            if row.scanner.stopped or t in self.eos_ids:
                done[first + i] = "stop"
            elif len(row.new) >= row.req.max_new:
                done[first + i] = "length"
        if done:
            self._drop(lambda r: False, done)

    def _drop(
        self, cancelled: Callable[[_Row], bool], done: dict[int, str | BaseException] | None
    ) -> None:
        """Remove finished (done: row index -> reason, or the error that ended the row) and
        cancelled rows from the batch.

        The batch shrinks before the counters move: stats() read from another thread never
        shows a request counted as cancelled or finished while its row is still there."""
        keep: list[int] = []
        gone: list[tuple[_Row, str | BaseException | None]] = []  # (row, reason; None: cancelled)
        for i, row in enumerate(self._rows):
            if done is not None and i in done:
                gone.append((row, done[i]))
            elif cancelled(row):
                gone.append((row, None))
            else:
                keep.append(i)
        if not gone:
            return
        self._select(keep)
        self.rows_now = len(self._rows)
        for row, reason in gone:
            if reason is None:
                self.cancelled += 1
                self._end(row.req, Cancelled("client disconnected"))
            elif isinstance(reason, BaseException):
                self.failed += 1
                self._end(row.req, reason)
            else:
                self._finish(row, reason)

    def _select(self, keep: list[int]) -> None:
        """Keep only these rows of the batch (and of its cache and mask)."""
        if not keep:
            self._reset()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._rows = [self._rows[i] for i in keep]
        self._cache.batch_select_indices(idx)
        assert self._mask is not None
        self._mask = self._mask[idx]
        # Columns that are padding in every remaining row serve nobody: cut them.
        lead = int(self._mask.any(0).to(torch.int8).argmax())
        if lead > 0 and self._mergeable:
            for layer in self._cache.layers:
                layer.keys = layer.keys[..., lead:, :]
                layer.values = layer.values[..., lead:, :]
            self._mask = self._mask[:, lead:]

    def _finish(self, row: _Row, reason: str) -> None:
        rest = row.scanner.finish(row.text.finish())
        if rest and row.req.on_piece is not None:
            self._out.append((row.req.on_piece, rest))
        self.finished += 1
        res = GenResult(row.scanner.final or "", len(row.req.ids), len(row.new), reason)
        self._end(row.req, res)


def _ms_fit(fit: tuple[float, float] | None) -> dict[str, float | None]:
    per_call, per_token = (None, None) if fit is None else fit
    return {
        "prefill_ms_per_call": None if per_call is None else round(per_call * 1000, 3),
        "prefill_ms_per_token": None if per_token is None else round(per_token * 1000, 4),
    }


def _generator(params: GenParams, device: str) -> torch.Generator | None:
    if params.temperature <= 0:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def _pick(row: _Row, logits: torch.Tensor, i: int, greedy: int) -> int:
    """The next token of `row`, whose logits are `logits[i]`; `greedy` is their argmax, taken
    for the whole batch at once. A row with a bias or penalties shapes its own logits first,
    greedy or not. (A greedy row without them never indexes its logits: that view cost every
    row of every step.)"""
    p = row.req.params
    if row.shaping is not None:
        shaped = row.shaping.apply(logits[i])
        t = int(shaped.argmax()) if p.temperature <= 0 else sample(shaped, p, row.gen)
        row.shaping.saw(t)
        return t
    return greedy if p.temperature <= 0 else sample(logits[i], p, row.gen)
