"""Balanced: packed documents placed so that every rank holds S/N tokens and the same causal work.

Zigzag balances causal work over the whole sequence, not per document: on a long-tailed mix
(a few long documents, many short ones) one rank can hold 3x another's work. Per-document zigzag
(DocZigzag) balances exactly but cuts every document into 2N pieces, padded. `Balanced` does
neither blindly. For the batch's document lengths it builds candidate placements:

* the k longest documents are *cut* zigzag-style into 2N chunks (rank r holds chunks r and
  2N-1-r of each), which balances their causal work exactly; their odd tokens go to the ranks
  holding the fewest so far, so token counts never differ by more than one;
* every other document, longest first, is *placed whole* on the rank with the least work among
  those with room for it; what fits nowhere goes whole after all where the shortest documents
  placed so far, taken back, and it can fill every rank's remaining room exactly (`_exact_fill`);
  only what still fits nowhere fills the remaining room along the ring, each such document on
  one rank or passed on to the next rank with room (`_chain_fill`: its second piece sees the
  first one rank back), or in rank order where that leaves the slowest rank faster;
* or, in a second candidate for each k, a document that would overload its best whole home (or
  has none) goes whole there or is cut zigzag-style over a *window* of g consecutive ranks
  (cyclically; 2g chunks), whichever makes the slowest of them fastest. A window needs ring
  offsets up to g - 1 either way where a cut over all ranks needs N - 1: it balances documents
  too long for one rank's share of work but too short for 2N chunks of `min_chunk` tokens, and
  spares the other ranks the steps a cut over all of them adds.

Each candidate (k = 0, 1, 2, 3, 4, 6, 8, ..., with and without windows, and with windows of at
most 2 and 4 ranks) is judged by its slowest
rank's time, `_rank_time`: its (query, key) pairs plus what its ring steps with work cost the
host and the device (`STEP_HOST_CHUNKS` says why: on small batches over many ranks the steps,
not the imbalance, bound a rank). Of the candidates within `TOLERANCE` of the fastest, those
within it of the fastest device time (`_device_time`: where the host bounds every candidate
alike, the work still differs) are kept, and of them the one whose ranks share the fewest tokens
wins. With `hidden_steps=h` (a training step whose other work hides the host time of h ring
steps a rank) a rank's first h steps cost the host nothing, and the placement for h = 0 or h = N
is taken where the search's greedy choices ended slower than it by that measure. A document is
cut over g ranks only if its 2g chunks
hold at least `min_chunk` (default 512) tokens each (smaller pieces cost the kernels more than
the imbalance they remove). Equal documents that divide evenly are placed whole (no
communication at all); a long-tailed mix cuts its few long documents. Work is counted as a
causal mask's (query, key) pairs: the placement depends on the documents, N, `min_chunk` and
`hidden_steps` only, never on the mask of one layer, so a model mixing window and full layers
shards its batch once.

No padding: the packed sequence's length must be a multiple of N (pad it with one more
document). Local order: a rank holds first the chunks of cut documents, then the pieces of split
ones (what other ranks attend to), then its whole documents, each group in increasing global
order (`_local_order` says why); one document's pieces on a rank are always in global order. The
layout carries its documents, so `ring_attention(..., layout=Balanced(...))` applies the document
mask by itself; inside the op the documents travel as the `cu_seqlens` tensor: a new document
structure every batch is a new input, not a new graph under torch.compile.

    documents 10, 2, 2, 2 over 2 ranks (M = 8, min_chunk=1; the 10 is cut into chunks of 3, 2, 3, 2):
    rank 0:  a0 a1 a2 | a8 a9 | d0 | b0 b1     (chunks 0 and 3 of a, d's first token, b whole)
    rank 1:  a3 a4 | a5 a6 a7 | d1 | c0 c1     (chunks 1 and 2 of a, d's last token, c whole)
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .base import Layout, documents_of, documents_tensor

#: placements whose slowest rank (`_rank_time`) is within this fraction of the fastest's count as
#: equally fast (the one sharing the fewest tokens wins); and a document overloads a rank when its
#: work would pass the mean by more than this (then windows are searched for it)
TOLERANCE = 0.02
#: the default `Balanced(min_chunk=)`: a document is cut over g ranks only if its 2g chunks hold at least this
#: many tokens each: smaller pieces run the kernels far below their rate (a 128-row tile mostly
#: masked), which costs more than the imbalance it removes (measured on H100 with FA4: log-normal
#: mixes cut into ~200-token chunks ran 4-16x the kernel time of the whole documents)
MIN_CHUNK = 512
#: What one ring step with work costs a rank beyond its (query, key) pairs, in min_chunk^2 causal
#: pairs: a forward and a backward launch cost the host about 1.1-1.4 ms (FA4's Python and dtcp's
#: merges) and the device about 0.2 ms of fixed work (FA4's backward pre/post-processing, the
#: accumulators), while FA4 runs 8-11 M pairs per ms at 32/8 heads of 128 dims (measured on one
#: H100, torch 2.11, FA4 4.0.0b36, 2026-11-26: bench_split's long-tailed mixes at N = 8 and 16,
#: 128K tokens): about 12 M and 2 M pairs, 46 and 8 x 512^2. The host runs ahead of the device,
#: so a rank takes about max(host x steps, pairs + device x steps) (`_rank_time`): where its work
#: is small, the number of steps, not the imbalance, decides, and cutting a short document over
#: more ranks costs more than it saves. In units of min_chunk^2 because min_chunk is already the
#: scale below which fixed costs win: a smaller one weighs steps less, and min_chunk=1 balances
#: the work alone.
STEP_HOST_CHUNKS = 46
STEP_DEVICE_CHUNKS = 8
#: the most ranks a window cuts a document over (a longer one is cut over all N); it bounds the
#: placement's search (N windows of each width), which runs on the host once per batch
WINDOW_RANKS = 8
#: narrower limits on a window's ranks also tried (without cuts over all ranks), each one more
#: candidate placement (host time once per batch)
WIDEST_TRIED = (2, 4)

Run = tuple[int, int]


@dataclass(frozen=True)
class Balanced(Layout):
    """Packed documents balanced over the ranks: equal tokens and equal causal work per rank.

    `doc_lens`: the packed documents' lengths, in order (their sum is S, a multiple of N). See
    the module docstring for the placement; `dtcp.Balanced.from_cu_seqlens(cu_seqlens)` builds
    it from a batch's boundaries. None (`dtcp.Balanced()`, the spec "balanced"): the placement of
    the documents each `ring_attention` call gets as `cu_seqlens` (a tensor, so that a new
    document structure is not a new graph for code that keeps one layout object).
    `min_chunk`: a document is cut over g ranks only if its 2g chunks hold at least this many
    tokens each.
    `hidden_steps`: how many of a rank's ring steps queue on the host while the device runs other
    work (the rest of a training step's layer), so that their host time costs nothing. 0 (the
    default): every step's host time counts, as for an isolated call; at N or more, a rank's
    device time alone decides (more steps for less imbalance where the device is the bound).
    The integrations and `context_parallel(layout="auto")` set it from the cost objective in
    force (`dtcp.config.cost_objective`, `layer_flops_per_token`; `dtcp.hidden_ring_steps`).
    Both are part of the placement, so they travel with the layout into the op: sharding and
    attention always agree on them."""

    doc_lens: Optional[tuple[int, ...]] = None
    min_chunk: int = dataclasses.field(default=MIN_CHUNK, kw_only=True)
    hidden_steps: int = dataclasses.field(default=0, kw_only=True)
    name = "balanced"

    def __post_init__(self):
        if not isinstance(self.min_chunk, int) or isinstance(self.min_chunk, bool) or self.min_chunk < 1:
            raise ValueError(f"Balanced(min_chunk={self.min_chunk!r}): min_chunk must be an int >= 1")
        if not isinstance(self.hidden_steps, int) or isinstance(self.hidden_steps, bool) or self.hidden_steps < 0:
            raise ValueError(f"Balanced(hidden_steps={self.hidden_steps!r}): hidden_steps must be an int >= 0 (the "
                             "ring steps whose host time other device work hides; 0 counts every step's)")
        # (a flag of its own: code that asks it under torch.compile guards on a bool, not on the
        # documents, which change every batch)
        object.__setattr__(self, "carries_documents", self.doc_lens is not None)
        if self.doc_lens is None:
            object.__setattr__(self, "cu_seqlens", None)
            return
        # A private tensor (not a dataclass field: equality and hashing stay by value).
        object.__setattr__(self, "cu_seqlens", documents_tensor(self.doc_lens, "Balanced"))

    @staticmethod
    def from_cu_seqlens(cu_seqlens, min_chunk: int = MIN_CHUNK, hidden_steps: int = 0) -> "Balanced":
        """From the packed sequence's document boundaries: a list or an int tensor (0 = c0 <= ... <= cn = S)."""
        return Balanced(documents_of(cu_seqlens, "Balanced"), min_chunk=min_chunk, hidden_steps=hidden_steps)

    def op_spec(self) -> str:
        """The layout as the op receives it (its documents travel as cu_seqlens): "balanced", with
        "@<min_chunk>" for another minimum chunk and "+<hidden_steps>" for hidden steps."""
        return (self.name + ("" if self.min_chunk == MIN_CHUNK else f"@{self.min_chunk}")
                + (f"+{self.hidden_steps}" if self.hidden_steps else ""))

    def multiple(self, world_size: int) -> int:
        return world_size

    def check(self, seq_len: int, world_size: int) -> None:
        if self.doc_lens is None:
            super().check(seq_len, world_size)
            return
        total = sum(self.doc_lens)
        if seq_len != total:
            raise ValueError(f"Balanced holds documents of {total} tokens in all; got a sequence of {seq_len}. "
                             "Build the layout from this batch's boundaries: dtcp.Balanced.from_cu_seqlens(cu_seqlens)")
        if total % world_size:
            raise ValueError(f"Balanced over {world_size} ranks needs a packed length that is a multiple of "
                             f"{world_size}; the documents hold {total} tokens. Pad the packed sequence with one "
                             f"more document of {-total % world_size} tokens (or more)")

    def _documents(self) -> tuple[int, ...]:
        if self.doc_lens is None:
            raise ValueError("Balanced() without documents places each call's cu_seqlens; to shard a batch, build "
                             "the layout from its boundaries: dtcp.Balanced.from_cu_seqlens(cu_seqlens)")
        return self.doc_lens

    def runs(self, seq_len, world_size, rank):
        self.check(seq_len, world_size)
        return list(balanced_placement(self._documents(), world_size, self.min_chunk, self.hidden_steps)[rank])

    def causal_blocks(self, local_len, world_size, rank, src):
        """None: the planner derives every block from the runs, whose local order is not global
        order (shared pieces first), so not even the own block is causal in local indices."""
        return None

    def spec(self) -> str:
        return self.op_spec() if self.doc_lens is None else self.op_spec() + ":" + ",".join(map(str, self.doc_lens))

    def rank_work(self, world_size: int) -> tuple[int, ...]:
        """Each rank's causal (query, key) pairs under the document mask (what the placement balances)."""
        return placement_work(self._documents(), world_size, self.min_chunk, self.hidden_steps)


def balanced_options(op_spec: str) -> Optional[dict]:
    """Balanced's keyword arguments in an op spec ("balanced", "balanced@64", "balanced+8",
    "balanced@64+8"): {"min_chunk": ..., "hidden_steps": ...}; None for other layouts."""
    head, _, hidden = op_spec.partition("+")
    name, _, min_chunk = head.partition("@")
    if name != Balanced.name:
        return None
    return {"min_chunk": int(min_chunk) if min_chunk else MIN_CHUNK, "hidden_steps": int(hidden) if hidden else 0}


def _causal_pairs(a: int, b: int) -> int:
    """Causal (query, key) pairs of the tokens at offsets [a, b) of one document: sum of p + 1."""
    return (b * (b + 1) - a * (a + 1)) // 2


def _cut_counts(num_docs: int) -> list[int]:
    """How many of the longest documents to try cutting: 0, 1, 2, 3, 4, 6, 8, 12, ... then all."""
    counts, k = [0, 1, 2, 3], 4
    while k < num_docs:
        counts.append(k)
        k = k * 3 // 2 if k % 2 == 0 else k + 1
    return sorted({c for c in counts if c < num_docs} | {num_docs})


def balanced_placement(doc_lens: tuple[int, ...], world_size: int, min_chunk: int = MIN_CHUNK,
                       hidden_steps: int = 0) -> tuple[tuple[Run, ...], ...]:
    """Every rank's runs (global [start, end), in local order) for these documents over `world_size`
    ranks (see the module docstring); a document is cut over g ranks only if it holds at least
    2g x `min_chunk` tokens; the host time of `hidden_steps` ring steps a rank counts nothing
    (`Balanced(hidden_steps=)`).
    Pure and deterministic: every rank computes the same."""
    return _placement(tuple(doc_lens), world_size, min_chunk, min(hidden_steps, world_size))


@lru_cache(maxsize=256)
def _placement(doc_lens: tuple[int, ...], world_size: int, min_chunk: int,
               hidden_steps: int = 0) -> tuple[tuple[Run, ...], ...]:
    best = _searched(doc_lens, world_size, min_chunk, hidden_steps)
    if hidden_steps:
        # The search books steps at their hidden_steps cost while it places (windows, refills),
        # and with some steps hidden its greedy choices can end slower, by that same measure,
        # than the placement that counts every step's host time (bench_split's log-normal s4,
        # 128K over 16 ranks, one step hidden: 56.7 against 41.7 M pairs) or none. The fastest
        # of them by the measure asked for is taken.
        slowest = _slowest_of(best, doc_lens, min_chunk, hidden_steps)
        for other in sorted({0, world_size} - {hidden_steps}):
            alt = _searched(doc_lens, world_size, min_chunk, other)
            alt_slowest = _slowest_of(alt, doc_lens, min_chunk, hidden_steps)
            if alt_slowest < slowest:
                best, slowest = alt, alt_slowest
    return best


def _slowest_of(placement, doc_lens: tuple[int, ...], min_chunk: int, hidden_steps: int) -> float:
    """The slowest rank's `_rank_time` in a placement (runs per rank)."""
    work, steps = work_of_runs(placement, doc_lens), steps_of_runs(placement, doc_lens)
    return max(_rank_time(w, s, min_chunk, hidden_steps) for w, s in zip(work, steps))


def _searched(doc_lens: tuple[int, ...], world_size: int, min_chunk: int,
              hidden_steps: int) -> tuple[tuple[Run, ...], ...]:
    """The candidates' search (module docstring), each rank's time `_rank_time` with `hidden_steps`."""
    n = world_size
    total = sum(doc_lens)
    if n < 1 or total % n:
        raise ValueError(f"balanced_placement: {total} tokens do not split over {n} ranks")
    docs = []
    pos = 0
    for i, length in enumerate(doc_lens):
        if length:
            docs.append((length, i, pos))
        pos += length
    # longest first; ties keep document order (deterministic on every rank)
    by_length = sorted(docs, key=lambda d: (-d[0], d[1]))
    cuttable = sum(1 for length, _, _ in by_length if length >= 2 * n * min_chunk)
    # Every candidate: the k longest cut over all ranks, the rest whole (no communication for
    # them) or, where that overloads a rank, over windows of a few ranks. The fastest by
    # `_rank_time`; of those within the tolerance of it, the one whose ranks share the fewest
    # tokens (what the ring sends: cut chunks and split pieces).
    candidates = []

    def consider(k: int, windows: bool, widest: int = WINDOW_RANKS, widths: Optional[list] = None) -> None:
        pieces, work, steps = _place(by_length, k, n, total // n, min_chunk, windows, widest, widths, hidden_steps)
        slowest = max(_rank_time(w, s, min_chunk, hidden_steps) for w, s in zip(work, steps))
        device = max(_device_time(w, s, min_chunk) for w, s in zip(work, steps))
        shared = max(sum(b - a for (a, b), group in p if group < 2) for p in pieces)
        candidates.append((slowest, device, shared, pieces, k))

    for k in _cut_counts(cuttable):
        consider(k, False)
    # Windows (a search per overloading document, host time) for the fewest cuts and for the
    # best k without them only: what windows replace is cuts over all ranks.
    widths: list[int] = []  # the widths of the windows the placement without cuts took
    for k in sorted({0, min(candidates)[4]}):
        consider(k, True, widths=widths if k == 0 else None)
    # The window search widens each document's window while its own slowest rank gets faster, one
    # document at a time: the longest may take five ranks where four would have left the next
    # longest a window of its own (log-normal, N = 8: 16.0K and 14.8K tokens over ranks 0-4 and
    # 5-7 and 0, seven steps on rank 5; with windows of at most four, four steps a rank). So
    # narrower windows are tried too.
    for widest in _narrower_limits(n, widths):
        consider(0, True, widest)
    fastest = min(c[0] for c in candidates)
    near = [c for c in candidates if c[0] <= (1 + TOLERANCE) * fastest]
    # Where the host bounds every candidate (the same steps), their device time still differs:
    # the GPU is loaded behind other work in a training step, and an imbalanced rank is slower
    # there (log-normal, N = 8: two candidates of 8 steps each, one 2.0x the mean's pairs).
    quickest = min(c[1] for c in near)
    best = min((c for c in near if c[1] <= (1 + TOLERANCE) * quickest), key=lambda c: (c[2], c[0]))
    return tuple(_local_order(p) for p in best[3])


def _narrower_limits(n: int, widths: list[int]) -> list[int]:
    """The limits of WIDEST_TRIED worth a candidate over N ranks, `widths` the windows the placement
    without cuts took: those below WINDOW_RANKS and N - 1, and below its widest window. A limit at
    or above every window taken changes no document's choice (each window search would find the
    same best width first), so it would give the same placement again."""
    return [w for w in WIDEST_TRIED if w < min(WINDOW_RANKS, n - 1) and w < max(widths, default=1)]


def _rank_time(work: float, steps: int, min_chunk: int, hidden_steps: int = 0) -> float:
    """A rank's time in causal pairs: `work` pairs over `steps` ring steps with work (STEP_HOST_CHUNKS
    says why), where the host time of `hidden_steps` steps is hidden behind other device work (the
    rest of a training step's layer: `Balanced(hidden_steps=)`). With every step hidden, the
    device's time alone (`_device_time`)."""
    host = STEP_HOST_CHUNKS * min_chunk * min_chunk * max(0, steps - hidden_steps)
    return max(host, _device_time(work, steps, min_chunk))


def _device_time(work: float, steps: int, min_chunk: int) -> float:
    """A rank's device time in causal pairs: `_rank_time` without the host's part."""
    return work + STEP_DEVICE_CHUNKS * min_chunk * min_chunk * steps


def _local_order(pieces: list[tuple[Run, int]]) -> tuple[Run, ...]:
    """A rank's runs in local order: first the chunks of cut documents, then the pieces of split
    documents (both attend to, or are attended by, other ranks), then the documents it holds whole;
    each group in increasing global order, touching runs joined.

    Why not all in global order: the ring only sends, receives and computes the shared pieces.
    Held together at the front of the shard, they are one short span to send, and a ring step's
    query rows or keys are mostly one range (views instead of gathers); in global order whole
    documents fall between them (measured: spans 3x shorter on a log-normal mix at N = 8). Cut
    chunks come before split pieces because a step with a cut document uses the chunks of every
    cut document. Within one document a rank's pieces keep their global order, which is all the
    planner needs (plan/mask.py `band_tasks` works from global positions)."""
    return tuple(run for group in (0, 1, 2) for run in _merged(sorted(r for r, g in pieces if g == group)))


def _place(by_length, cut: int, n: int, per_rank: int, min_chunk: int, windows: bool, widest: int = WINDOW_RANKS,
           widths: Optional[list] = None, hidden_steps: int = 0):
    """(pieces per rank as (run, group), causal work per rank, ring steps with work per rank) when
    the `cut` longest documents are cut zigzag-style over all ranks and the rest placed whole or,
    with `windows`, cut over a few consecutive ranks (at most `widest`) where whole they would
    overload every rank with room (module docstring). `widths`: where given, the width of each
    window taken is appended to it. Ranks' times are `_rank_time`'s with `hidden_steps`."""
    tokens, work = [0] * n, [0] * n
    # (run, group): 0 a chunk of a cut document, 1 a piece of a split one, 2 a whole document
    pieces: list[list[tuple[Run, int]]] = [[] for _ in range(n)]
    # the ring offsets d at which rank r has work (it attends to keys of rank r - d)
    offsets: list[set[int]] = [set() for _ in range(n)]

    def put(rank: int, start: int, a: int, b: int, group: int) -> None:  # offsets [a, b) of the document at `start`
        pieces[rank].append(((start + a, start + b), group))
        tokens[rank] += b - a
        work[rank] += _causal_pairs(a, b)

    def cut_over(ranks: list[int], start: int, length: int) -> None:
        """Zigzag over `ranks` (g of them, 2g chunks): the i-th holds chunks i and 2g-1-i, whose
        causal work sums to the same for every i; each attends to every other one's low chunk."""
        g = len(ranks)
        base, extra = divmod(length, 2 * g)
        sizes = [base] * (2 * g)
        # Odd tokens to the ranks holding the fewest so far (low chunk first, then high): token
        # counts then never differ by more than one, so the cut documents alone never overfill a
        # rank; no rank of the group takes more than ceil(length / g).
        fewest = sorted(range(g), key=lambda i: (tokens[ranks[i]], ranks[i]))
        for j in range(extra):
            i = fewest[j % g]
            sizes[i if j < g else 2 * g - 1 - i] += 1
        offset = 0
        for chunk, size in enumerate(sizes):
            if size:
                put(ranks[min(chunk, 2 * g - 1 - chunk)], start, offset, offset + size, 0)
            offset += size
        for r in ranks:
            offsets[r].update(_offsets(r, ranks, n))

    for length, _, start in by_length[:cut]:
        cut_over(list(range(n)), start, length)
    rest = by_length[cut:]
    target = sum(_causal_pairs(0, length) for length, _, _ in by_length) / n * (1 + TOLERANCE)
    # The documents after each one (shorter) bring this much work per token: a rank that takes
    # few tokens now must take more of them later (every rank ends with per_rank tokens).
    rest_work, rest_tokens, density = 0, 0, [0.0] * len(rest)
    for i in range(len(rest) - 1, -1, -1):
        density[i] = rest_work / rest_tokens if rest_tokens else 0.0
        rest_work += _causal_pairs(0, rest[i][0])
        rest_tokens += rest[i][0]

    def refill(leftover: list[tuple[int, int]]) -> None:
        """Place the documents that fit nowhere whole, with no new ring step where possible:
        short documents placed whole are taken back (the 2N shortest of all, then twice as many,
        ..., then the same with each rank's shortest, ...) until they and the leftover fill every
        rank's free room exactly (`_exact_fill`). Where no such fill is found, the rooms are
        filled along the ring (`_chain_fill`: a document passed on from a rank to the next with
        room), with no take-back and with the first, or in rank order and document order (a
        document spanning as many ranks as it needs): whichever leaves the slowest rank fastest
        (`_rank_time`), then the fewest steps in all. Placed longest first by work, the whole
        documents leave the last few rooms a few tokens each (log-normal, N = 8: 1 to 17 tokens
        on six ranks), often smaller than any document; in rank order they split the last
        documents over up to eleven ranks (as many steps on the last one). The short documents
        taken back cost little work wherever they go."""
        shortest = sorted(d for d in placed if d[0] < min_chunk)
        own = [[d for d in shortest if d[2] == r] for r in range(n)]  # each rank's, shortest first
        tries, with_own, take, each = [], [], 2 * n, 1
        while True:
            tries.append(shortest[:take])
            with_own.append(sorted(set(shortest[:take]).union(*(o[:each] for o in own))))
            if take >= len(shortest):
                break
            take, each = take * 2, each * 2
        # (the shortest of all first: where they fill the rooms, the placement is the one every
        # run measured before each rank's own were taken back too)
        tries += [back for back in with_own if back not in tries]

        def fill_with(back):
            rooms = [per_rank - t for t in tokens]
            for length, _, rank in back:
                rooms[rank] += length
            return rooms, leftover + [(s, l) for l, s, _ in back]

        def each_piece(docs, homes):
            """(rank, document start, [a, b) in it, group, the ranks of its earlier pieces) of
            every piece a fill places: a passed-on piece attends to the pieces before it."""
            for (start, length), home in zip(docs, homes):
                if isinstance(home, int):
                    yield home, start, 0, length, 2, ()
                    continue
                for k, (rank, a, b) in enumerate(home):
                    yield rank, start, a, b, 1, [r for r, _, _ in home[:k] if r != rank]

        def slowest(option) -> tuple[float, int]:
            """The slowest rank's time with this fill, then all ranks' steps (the fewer, the better)."""
            back, docs, homes = option
            w, o = list(work), [set(x) for x in offsets]
            for length, _, rank in back:
                w[rank] -= _causal_pairs(0, length)
            for rank, _, a, b, _, earlier in each_piece(docs, homes):
                w[rank] += _causal_pairs(a, b)
                o[rank].update((rank - r) % n for r in earlier)
            return max(_rank_time(w[r], 1 + len(o[r]), min_chunk, hidden_steps) for r in range(n)), sum(map(len, o))

        chosen = None
        for back in tries:
            rooms, docs = fill_with(back)
            homes = _exact_fill([length for _, length in docs], rooms)
            if homes is not None:
                chosen = back, docs, homes
                break
        else:
            rooms, _ = fill_with([])
            docs = sorted(leftover)  # (in document order)
            options = [([], docs, _in_rank_order([length for _, length in docs], rooms))]
            for back in [[]] + with_own[:1]:
                rooms, docs = fill_with(back)
                found = _chain_fill([length for _, length in docs], rooms)
                if found is not None:
                    options.append((back, docs, found[1]))
            chosen = min(options, key=slowest)
        back, docs, homes = chosen
        for length, start, rank in back:
            pieces[rank].remove(((start, start + length), 2))
            tokens[rank] -= length
            work[rank] -= _causal_pairs(0, length)
        for rank, start, a, b, group, earlier in each_piece(docs, homes):
            put(rank, start, a, b, group)
            offsets[rank].update((rank - r) % n for r in earlier)

    placed: list[tuple[int, int, int]] = []  # (length, start, rank) of each document placed whole
    leftover = []
    for i, (length, _, start) in enumerate(rest):
        whole = _causal_pairs(0, length)
        room = [r for r in range(n) if per_rank - tokens[r] >= length]
        home = min(room, key=lambda r: (work[r], -(per_rank - tokens[r]), r)) if room else None

        def projected(r: int, add_tokens: float, add_work: float, new_steps: int = 0, rho=density[i]) -> float:
            """Rank r's time (`_rank_time`) once it has taken this share (and `new_steps` more
            steps with work) and filled its room at the density of the shorter documents still
            to place."""
            filled = work[r] + add_work + rho * (per_rank - tokens[r] - add_tokens)
            return _rank_time(filled, 1 + len(offsets[r]) + new_steps, min_chunk, hidden_steps)

        # (a window of g >= 2 ranks needs 2g chunks of min_chunk tokens)
        if windows and length >= 4 * min_chunk and \
                (home is None or work[home] + whole + density[i] * (per_rank - tokens[home] - length) > target):
            ranks = _window(length, whole, home, tokens, per_rank, min_chunk, projected, offsets, widest)
            if ranks is not None:
                if len(ranks) == 1:
                    put(ranks[0], start, 0, length, 2)
                    placed.append((length, start, ranks[0]))
                else:
                    cut_over(ranks, start, length)
                    if widths is not None:
                        widths.append(len(ranks))
                continue
        if home is not None:
            put(home, start, 0, length, 2)
            placed.append((length, start, home))
        else:
            leftover.append((start, length))
    if leftover:
        refill(leftover)
    return pieces, work, [1 + len(o) for o in offsets]


def _exact_fill(lengths: list[int], rooms: list[int]) -> Optional[list[int]]:
    """A rank for each of these documents such that each rank's documents fill its room exactly
    (the rooms sum to the lengths), or None where this search finds none: rank by rank, most room
    first, a subset of the documents left whose lengths sum to the room (a bitset of reachable
    sums per prefix, as Python ints; the largest documents first, so the shortest stay for the
    rooms after)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    homes: list[Optional[int]] = [None] * len(lengths)
    for rank in sorted(range(len(rooms)), key=lambda r: (-rooms[r], r)):
        room = rooms[rank]
        if not room:
            continue
        items = [i for i in order if homes[i] is None and lengths[i] <= room]
        sizes = [lengths[i] for i in items]
        reach = _subset_sums(sizes, room)
        if not reach[-1] >> room & 1:
            return None
        for j in _pick(sizes, reach, room):
            homes[items[j]] = rank
    return None if any(h is None for h in homes) else homes


def _subset_sums(lengths: list[int], limit: int) -> list[int]:
    """Prefix bitsets of the sums reachable (up to `limit`) with the first i lengths, i = 0..len."""
    mask = (1 << (limit + 1)) - 1
    reach = [1]
    for length in lengths:
        reach.append((reach[-1] | (reach[-1] << length)) & mask)
    return reach


def _pick(lengths: list[int], reach: list[int], total: int) -> list[int]:
    """Indices into `lengths` of a subset summing to `total` (reachable in `reach`, `_subset_sums`)."""
    chosen = []
    for j in range(len(lengths), 0, -1):  # the sum stays reachable without item j: skip it
        if not reach[j - 1] >> total & 1:
            chosen.append(j - 1)
            total -= lengths[j - 1]
    return chosen


#: the ranks `_chain_fill` visits, at most, in its search (host time, once per batch and candidate)
CHAIN_FILL_VISITS = 64
#: the splits it tries at each rank: the shortest documents that can pass on to the next rank
CHAIN_FILL_BRANCHES = 3


def _chain_fill(lengths: list[int], rooms: list[int]):
    """A home for each document such that the rooms (which sum to the lengths) are filled
    exactly: a rank (whole), or pieces [(rank, start, end), ...] over ranks that follow each other
    among those with room, in ring order. Returns ((farthest, splits), homes): `farthest` the
    largest ring offset at which a piece's rank attends to an earlier piece's (each distinct one
    is a ring step for it), `splits` how many ranks take a piece passed on; or None (no rank has
    room).

    From each start in turn the ranks with room are walked in ring order: a rank takes what the
    previous one passed on, then documents that fill the rest exactly, or else the most tokens of
    whole documents that leave a gap some other document fills and passes on to the next rank
    (the `CHAIN_FILL_BRANCHES` shortest such documents whose rest fits there are tried in turn,
    and the shortest longer than the gap, whose rest goes on further, last). Depth first, at most
    `CHAIN_FILL_VISITS` ranks in all; branches that cannot beat the best so far are cut. Documents
    are taken longest first, so that the short ones stay for the gaps."""
    n = len(rooms)
    visits = [CHAIN_FILL_VISITS]
    best: list = [None]

    def walk(order, pos, left, carry, homes, farthest, splits):
        """Fill order[pos:]; `carry`: (document, pieces so far) or None."""
        if best[0] is not None and (farthest, splits) >= best[0][0]:
            return
        if pos == len(order):
            if not left and carry is None:
                best[0] = ((farthest, splits), homes)
            return
        visits[0] -= 1
        if visits[0] < 0 and best[0] is not None:  # (the first walk always ends in a fill: below)
            return
        rank, room = order[pos], rooms[order[pos]]
        if carry is not None:
            i, pieces = carry
            done = pieces[-1][2]
            take = min(lengths[i] - done, room)
            pieces = pieces + [(rank, done, done + take)]
            farthest = max(farthest, max((rank - r) % n for r, _, _ in pieces[:-1]))
            splits += 1
            room -= take
            if done + take < lengths[i]:  # it goes on past this rank too
                walk(order, pos + 1, left, (i, pieces), homes, farthest, splits)
                return
            homes = dict(homes)
            homes[i] = pieces
        items = [lengths[i] for i in left]
        reach = _subset_sums(items, room)
        options = []  # (the whole documents taken, the one passed on with its tokens here, or None)
        if reach[-1] >> room & 1:
            options.append((set(_pick(items, reach, room)), None))
        elif pos + 1 < len(order):
            after = rooms[order[pos + 1]]
            shortest = sorted(range(len(items)), key=lambda j: (items[j], j))
            for j in shortest:
                # document j passed on: the whole ones sum to t in (room - its length, room - 1],
                # its rest (length - (room - t)) fits the next rank: the largest such t
                lo, hi = max(0, room - items[j] + 1), min(room - 1, room - items[j] + after)
                window = reach[-1] >> lo & ((1 << (hi - lo + 1)) - 1) if lo <= hi else 0
                if window:
                    total = lo + window.bit_length() - 1
                    picked = set(_pick(items, reach, total))
                    if j not in picked:  # (in the one subset of that sum this search looks at)
                        options.append((picked, (j, room - total)))
                        if len(options) == CHAIN_FILL_BRANCHES:
                            break
            # and the shortest that goes on past the next rank, after the largest sum below the
            # room: there always is one (the documents left hold at least the room, and adding any
            # outside that sum would pass it), so no walk ends before the last rank
            total = (reach[-1] & ((1 << room) - 1)).bit_length() - 1
            picked = set(_pick(items, reach, total))
            over = [j for j in shortest if j not in picked and items[j] > room - total]
            if over:
                options.append((picked, (over[0], room - total)))
        for picked, passed in options:
            placed = dict(homes)
            placed.update((left[j], rank) for j in picked)
            rest = [left[j] for j in range(len(left)) if j not in picked and (passed is None or j != passed[0])]
            nxt = None if passed is None else (left[passed[0]], [(rank, 0, passed[1])])
            walk(order, pos + 1, rest, nxt, placed, farthest, splits)

    for s in range(n):
        order = [(s + i) % n for i in range(n) if rooms[(s + i) % n]]
        if order and order[0] == s:
            walk(order, 0, sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), None, {}, 0, 0)
        if visits[0] < 0 or (best[0] is not None and best[0][0][0] <= 1):  # (neighbours only: good enough)
            break
    if best[0] is None:
        return None
    score, homes = best[0]
    return score, [homes[i] for i in range(len(lengths))]


def _in_rank_order(lengths: list[int], rooms: list[int]) -> list:
    """`_chain_fill`'s homes for the rooms filled in rank order, the documents in the order given,
    each spanning as many ranks as it needs."""
    homes, rank, used = [], 0, 0
    for length in lengths:
        pieces, done = [], 0
        while done < length:
            while used == rooms[rank]:
                rank, used = rank + 1, 0
            take = min(length - done, rooms[rank] - used)
            pieces.append((rank, done, done + take))
            done, used = done + take, used + take
        homes.append(pieces[0][0] if len(pieces) == 1 else pieces)
    return homes


def _offsets(rank: int, ranks, n: int) -> set[int]:
    """The ring offsets at which `rank` attends to the other members of a zigzag cut over `ranks`."""
    return {(rank - other) % n for other in ranks if other != rank}


def _window(length: int, whole: int, home: Optional[int], tokens: list[int], per_rank: int, min_chunk: int,
            projected, offsets: list[set[int]], widest: int = WINDOW_RANKS) -> Optional[list[int]]:
    """Where a document that would overload its best whole home (`home`, None: no rank has room
    for it) goes: whole on `home`, or cut over g consecutive ranks (cyclically: g ranks need ring
    offsets up to g - 1 both ways, so at most 2(g - 1) rounds, not N - 1), whichever leaves its
    slowest rank fastest by `projected(rank, tokens, work, new steps)`, which counts the steps a
    cut adds to each rank (`offsets`: those it has); ties go to the fewer ranks. g is at most
    `widest` (WINDOW_RANKS), N - 1 and length / (2 min_chunk) (over all N ranks is the k longest's cut); g
    grows only while the slowest rank gets faster (the share of work falls as 1/g, the steps grow
    with g), which also bounds the search. None: no option has room (the document fills leftover
    room)."""
    n = len(tokens)
    best = None if home is None else (projected(home, length, whole), 1, [home])
    for g in range(2, min(widest, n - 1, length // (2 * min_chunk)) + 1):
        share = -(-length // g)
        # each rank's time with its share and no new step: a lower bound that skips most windows
        bound = [projected(r, length / g, whole / g) for r in range(n)]
        limit = math.inf if best is None else best[0]
        fits, worst, ranks = False, math.inf, None
        for s in range(n):
            w = [(s + i) % n for i in range(g)]
            if any(per_rank - tokens[r] < share for r in w):
                continue
            fits = True
            if max(bound[r] for r in w) >= min(limit, worst):
                continue
            slowest = max(projected(r, length / g, whole / g, len(_offsets(r, w, n) - offsets[r])) for r in w)
            if slowest < worst:
                worst, ranks = slowest, w
        if not fits:
            continue  # no room for a 1/g share: a wider window's smaller share may fit
        if worst >= limit:
            break  # a wider window halves less work than it adds steps from here on
        best = (worst, g, ranks)
    return None if best is None else best[2]


def _merged(runs: list[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _doc_pieces(placement, doc_lens):
    """(rank, document, its start, [lo, hi)) for every piece of a document that `placement`
    (runs per rank, global positions) puts on a rank; merged runs may cross document boundaries."""
    ends, pos = [], 0
    for length in doc_lens:
        pos += length
        ends.append(pos)
    for r, runs in enumerate(placement):
        for a, b in runs:
            # (from the first document that ends after a: a run's documents by bisection, not a
            # scan of all of them per run, which cost 0.3 s a placement of 722 documents)
            i = bisect.bisect_right(ends, a)
            while i < len(ends) and ends[i] - doc_lens[i] < b:
                ds, de = ends[i] - doc_lens[i], ends[i]
                lo, hi = max(a, ds), min(b, de)
                if lo < hi:
                    yield r, i, ds, lo, hi
                i += 1


def placement_work(doc_lens: tuple[int, ...], world_size: int, min_chunk: int = MIN_CHUNK,
                   hidden_steps: int = 0) -> tuple[int, ...]:
    """Each rank's causal pairs under the document mask in `balanced_placement`."""
    return work_of_runs(balanced_placement(doc_lens, world_size, min_chunk, hidden_steps), doc_lens)


def work_of_runs(placement, doc_lens) -> tuple[int, ...]:
    """Each rank's causal pairs under the document mask of `doc_lens` in `placement` (runs per rank)."""
    work = [0] * len(placement)
    for r, _, ds, lo, hi in _doc_pieces(placement, doc_lens):
        work[r] += _causal_pairs(lo - ds, hi - ds)
    return tuple(work)


def placement_steps(doc_lens: tuple[int, ...], world_size: int, min_chunk: int = MIN_CHUNK,
                    hidden_steps: int = 0) -> tuple[int, ...]:
    """Each rank's ring steps with work under the causal document mask in `balanced_placement`:
    its local step and every offset d whose block (rank r - d's) holds a key some of its queries
    see (what `_rank_time` charges; the planner's steps with tasks, see tests/test_balanced.py)."""
    return steps_of_runs(balanced_placement(doc_lens, world_size, min_chunk, hidden_steps), doc_lens)


def steps_of_runs(placement, doc_lens) -> tuple[int, ...]:
    """The ring steps with work of every rank of `placement` (runs per rank) under the causal
    document mask of `doc_lens`: rank r works at offset d where a document has a token on r after
    one of its tokens on rank r - d."""
    n = len(placement)
    first: dict[tuple[int, int], int] = {}  # (document, rank) -> the first and last position there
    last: dict[tuple[int, int], int] = {}
    for r, i, _, lo, hi in _doc_pieces(placement, doc_lens):
        first[i, r] = min(first.get((i, r), lo), lo)
        last[i, r] = max(last.get((i, r), hi - 1), hi - 1)
    holders: dict[int, list[int]] = {}
    for i, r in first:
        holders.setdefault(i, []).append(r)
    offsets = [set() for _ in range(n)]
    for i, ranks in holders.items():
        for r in ranks:
            for s in ranks:
                if s != r and last[i, r] > first[i, s]:
                    offsets[r].add((r - s) % n)
    return tuple(1 + len(o) for o in offsets)
