"""Client-aware admission: fair shares of admission and of prefill chunks between clients, in the
manner of the Virtual Token Counter (Sheng et al., OSDI '24, "Fairness in Serving Large Language
Models"), and a per-client cap on reserved KV slots (docs/DESIGN.md section 6).

Each client (`Request.client`; None is one shared anonymous client) has a counter of the service
it has received, charged when the tokens are scheduled: for a generated token's decode row,
OUTPUT_WEIGHT scaled up by the context the row attends to (`decode_cost`), and for a prompt chunk
its cost in prompt tokens (`chunk_cost`: PROMPT_WEIGHT per token, scaled up the same way). The
requests that want prompt tokens (waiting ones, and admitted ones with part of their prompt
left) are taken client by client, always from the client whose counter (with what this
selection already gave it) is smallest, and in arrival order within a client. A client that
becomes active is lifted to the smallest counter of the active clients, or to the last such
minimum when none is active, so time spent idle banks no credit. A client that
is ahead by more than one token budget takes at most as many weighted tokens of prompt in an
iteration as the least any other present client takes in it (no more than any other's share): on a CPU an
iteration's time grows with its tokens and with the context its prompt tokens attend to, so a
long prefill would otherwise slow every other client's decodes. A client whose request just
finished (a stop or its length) counts as present for RETURN_GRACE_SELECTIONS selections: clients
that stream back to back leave the pool for a moment between two requests, and in that moment
neither may the floor jump to the counter of the client that is ahead nor may that client take a
whole token budget (the one iteration that every returning client would then wait through).

A client that is ahead in the same sense takes decode rows worth, over time, what the least any
other client with an admitted request takes per iteration (its ready rows' `decode_cost`, at
least one decode's at position 0), its running requests in turn, when the scheduler shares decode
rows (`EngineConfig.share_decode_rows`, on for CPU): on a CPU every row lengthens the iteration,
by more the longer its context, so a client with several running requests, or with streams deep
into long contexts, would otherwise slow the others as much as several clients would, however
far ahead its counter is. What it may take but a row does not use carries to the next
iteration (`row_credit`), so a row costlier than that share still runs, every few iterations.

The scheduler keeps Algorithm 1's no-skip rule over this order: a request that does not fit in
the KV cache blocks every admission after it (admitted requests' prompt chunks still run), so
the client with the least service is never overtaken while it waits for space, and nothing
starves. The per-client cap is the one way past it: while another client is present, a client
whose next admission would take its reserved slots above the cap is left out of the selection
(its requests wait, the others go ahead), and its counter is lifted to the smallest of the other
present clients': the cap, not the fair order, holds it back, so it banks no credit, and the
others are never "ahead" of it (their prompts cut to one decode's weight) because it waits. The
cap is `max_kv_per_client` resolved against the cache (`kv_cap_slots`: by default
DEFAULT_KV_SHARE of the slots). It is work-conserving: a client alone (no other client present)
may fill the whole cache, so a single-user deployment keeps its full batch capacity; without
preemption, slots it took while alone stay its own until those requests end. A request larger
than the cap is admitted when its client holds no other slots, so no request waits forever.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Iterator, Optional, Union

from .request import RequestState

ADMISSION_POLICIES = ("fcfs", "fair")  # fcfs: Algorithm 1's arrival order; fair: this module
# max_kv_per_client='auto': this share of the KV slots under fair admission (no cap under fcfs).
# Half: two present clients can each hold a full half, and a hog leaves at least half the cache
# to the others (bench/RESULTS.md, "Isolation with every attack").
DEFAULT_KV_SHARE = 0.5
# Weights of the counters: a generated token costs twice a prompt token, as in the VTC paper (a
# decode step streams the weights for one token, a prefill shares that cost over its chunk).
PROMPT_WEIGHT = 1
OUTPUT_WEIGHT = 2
# A prompt token at context position L costs (1 + L / CONTEXT_COST_TOKENS) tokens at position 0:
# its attention reads L cached keys, its projections cost the same at any L. Measured on the
# default model in float32 on a 2-core CPU (bench/chunk_cost.py, bench/RESULTS.md): a chunk of
# 8-32 tokens adds ~1.0-1.2 ms per token at L=0 and ~1.4 ms more per token per 1,000 positions
# to an iteration of decodes, a slope that doubles the cost at L ~ 720. Larger chunks (64-128)
# attend more cheaply per token (double at L ~ 2,000), so for them the estimate errs high, on
# the side of the other clients.
CONTEXT_COST_TOKENS = 720
# A decode row at context L costs OUTPUT_WEIGHT x (1 + L / DECODE_CONTEXT_COST_TOKENS): its
# projections cost the same at any L, its attention reads L cached keys for its one query. Measured
# on the default model as a server runs it (Q4_1 blocks, float32 activations, batch-invariant) on a
# 2-core CPU (bench/chunk_cost.py --decode-rows, bench/RESULTS.md): rows beside 4 decodes add
# 2.0-2.6 ms each at L = 0 and 1.9-2.4 ms more per 1,000 positions, a slope that doubled a row's
# cost at L = 970-1,360 in five runs.
# Larger models spend more on projections per cached key, so for them the estimate errs high, on
# the side of the other clients: on the Llama-3.2-1B shape (Q8_0 blocks, int8 activations) a row's
# cost doubles at L = 2,300-2,800. Scaling by projection FLOPs per KV byte would predict ~7,400
# there, right for float activations but 3x too late for the int8 products, which run at twice
# the FLOP rate: the balance depends on the kernels as much as on the shape.
DECODE_CONTEXT_COST_TOKENS = 1150
# A client whose request just finished (a stop or its length) usually sends its next one at once:
# for this many selections after it leaves it still counts as present, so the gap between two of
# its requests neither lifts the floor to the other clients' counters (which would erase their
# lead) nor leaves another client that is ahead alone with a whole token budget (an iteration
# many times longer than a decode, which every returning client then waits through).
RETURN_GRACE_SELECTIONS = 16
# Counters of clients with nothing in the pool are kept (so a heavy client cannot shed its
# counter by pausing) up to this many; past it the smallest are forgotten first.
MAX_IDLE_COUNTERS = 4096


def check_kv_cap(name: str, value) -> None:
    """`value` must be 'auto', None, a share of the KV slots (a float in (0, 1]) or a slot
    count (an int >= 1); ValueError naming `name` and the limits otherwise."""
    if value == "auto" or value is None:
        return
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    raise ValueError(f"{name} must be 'auto', None, a share of the KV slots in (0, 1] (a float) or a "
                     f"slot count >= 1 (an int), got {value!r}")


def kv_cap_slots(value: Union[int, float, str, None], n_slots: int) -> Optional[int]:
    """The per-client cap in slots of a cache of n_slots: a slot count as given, a share of the
    slots rounded down (at least 1), 'auto' as DEFAULT_KV_SHARE, None as no cap."""
    if value is None:
        return None
    if value == "auto":
        value = DEFAULT_KV_SHARE
    if isinstance(value, float):
        return max(1, int(value * n_slots))
    return value


class FairShares:
    """The counters of one scheduler, and the order in which it takes prompt tokens.
    `max_kv_per_client`: the cap in slots (`kv_cap_slots`), None for none."""

    def __init__(self, max_kv_per_client: Optional[int] = None, token_budget: Optional[int] = None,
                 context_cost_tokens: int = CONTEXT_COST_TOKENS,
                 decode_context_cost_tokens: int = DECODE_CONTEXT_COST_TOKENS):
        self.max_kv_per_client = max_kv_per_client
        self.token_budget = token_budget  # the scheduler's max_num_batched_tokens (None: whole prompts)
        self.context_cost_tokens = context_cost_tokens  # context that doubles a prompt token's cost
        self.decode_context_cost_tokens = decode_context_cost_tokens  # ... and a decode row's
        self.counters: dict = {}   # client -> weighted tokens received
        self.taken: dict = {}      # client -> weighted tokens in the batch being selected
        self.active: set = set()   # clients with a request in the pool at the last selection
        self.floor = 0             # the smallest active counter when last seen (never decreases)
        self.selection = 0         # selections begun so far
        self.returning: dict = {}  # client -> last selection in which it counts as present
        self.row_turn: dict = {}   # client -> where its next share of decode rows starts (decode_rows)
        self.row_credit: dict = {}  # client ahead -> decode cost it may still take (decode_rows)
        self.held: list = []       # each held client's next row in turn, from the last decode_rows

    def order(self, pool: list, admit: Callable[[object], bool]) -> Iterator:
        """The pool's prompt work in fair-share order, each waiting request admitted (`admit`,
        the scheduler's) before it is yielded. Once one does not fit, no later one is admitted,
        but admitted requests' chunks still come. The caller asks for the next request only
        when it has room for it, after taking the last one (`num_scheduled` prompt tokens)."""
        queues: dict = {}
        reserved: dict = {}
        for index, req in enumerate(pool):
            if req.slab_start >= 0:
                reserved[req.client] = reserved.get(req.client, 0) + req.reservation
            if req.state is not RequestState.RUNNING and req.prompt_remaining:
                queues.setdefault(req.client, deque()).append((index, req))
        self._track({req.client for req in pool})
        heap = [(self.counters[c], q[0][0], c) for c, q in queues.items()]
        heapq.heapify(heap)
        blocked = False  # a request did not fit: no later one may skip ahead of it
        while heap:
            _, _, client = heapq.heappop(heap)
            queue = queues[client]
            req = queue[0][1]
            if req.slab_start < 0:
                if blocked:
                    continue
                if self._over_cap(client, reserved.get(client, 0), req):
                    self._hold_at_cap(client)
                    continue  # this client waits; the others go ahead
                if not admit(req):
                    blocked = True
                    continue
                reserved[client] = reserved.get(client, 0) + req.reservation
            yield req
            queue.popleft()
            if queue and req.num_scheduled == req.prompt_remaining:  # a cut chunk: its share is used
                heapq.heappush(heap, (self.counters[client], queue[0][0], client))

    def decode_rows(self, ready: list, pool: list) -> list:
        """The requests of `ready` (those of `pool` whose next input is one generated token, in
        arrival order) that this selection takes: all, except those of a client that is ahead
        (its counter more than one token budget above that of another client with an admitted
        request, or between two requests). That client may take, in this iteration and what it
        left unused before, the least decode cost any such other client has ready (`decode_cost`
        of its rows, at least one decode's at position 0 for each: a client whose next input is
        a prompt chunk, or who is between two requests, takes an iteration's time too). Its
        requests take rows in turn from one selection to the next while that credit covers the
        next one's cost, so a row deep into a long context runs only every few iterations. A
        client whose requests all wait for KV slots is no rival: it takes no time in the
        iteration, and holding rows back would only keep the slots it waits for taken longer."""
        self.held = []
        if self.token_budget is None:
            return ready
        rows: dict = {}  # client -> its ready requests in arrival order, each with its row's cost
        for req in ready:
            rows.setdefault(req.client, []).append((req, self.decode_cost(req.num_cached)))
        costs = {client: sum(cost for _, cost in mine) for client, mine in rows.items()}
        present = {req.client for req in pool if req.slab_start >= 0} | set(self._returning())
        held = set()
        for client, mine in rows.items():
            rivals = [c for c in present if c != client]
            if not rivals or not self._ahead(client, rivals):
                self.row_credit.pop(client, None)
                continue
            share = min(max(OUTPUT_WEIGHT, costs.get(c, 0)) for c in rivals)
            start = self.row_turn.get(client, 0) % len(mine)
            in_turn = mine[start:] + mine[:start]
            credit = self.row_credit.get(client, 0) + share
            taken = 0
            for _, cost in in_turn:  # rows go in turn: none after the first that the credit cannot cover
                if cost > credit:
                    break
                credit -= cost
                taken += 1
            waiting = [req for req, _ in in_turn[taken:]]
            held.update(id(req) for req in waiting)
            self.held += waiting[:1]
            self.row_turn[client] = start + taken
            # What is left carries only while a row waits for it (less than that row's cost): a
            # client whose every row ran banks nothing toward a later burst.
            self.row_credit[client] = credit if waiting else 0
        return [req for req in ready if id(req) not in held] if held else ready

    def release_held(self) -> Optional[object]:
        """The first held row of the last `decode_rows`, now taken after all (its client's turn
        moves past it), or None: the scheduler asks when nothing else runs in the iteration,
        where holding it back would only leave the iteration empty."""
        if not self.held:
            return None
        req = self.held.pop(0)
        self.row_turn[req.client] = self.row_turn.get(req.client, 0) + 1
        return req

    def _ahead(self, client, rivals: list) -> bool:
        """client's counter is more than one token budget above the smallest of `rivals`'."""
        least = min(self.counters.get(c, self.floor) for c in rivals)
        return self.counters.get(client, self.floor) > least + self.token_budget

    def begin(self) -> None:
        """A new selection: nothing taken yet."""
        self.taken = {}
        self.selection += 1

    def finished(self, req) -> None:
        """req left the pool after a stop or its length: its client counts as present for the next
        RETURN_GRACE_SELECTIONS selections (not after an abort or an error: that client is gone)."""
        if req.finish_reason in ("stop", "length"):
            self.returning[req.client] = self.selection + RETURN_GRACE_SELECTIONS

    def take(self, req, n_tokens: int) -> int:
        """Charge req's client for the `n_tokens` of its next input the scheduler wants to take,
        and return how many it may: all, except for a prompt chunk of a client that is ahead
        (its counter more than one token budget above another present client's: one in this
        batch, or one between two requests). That chunk may cost only as many weighted tokens as
        the least any other present client takes in this iteration (one decode's for a client
        between requests; at least one token): no more than any other client's share of the
        iteration, so one heavy client cannot slow everyone's iteration more than one more
        ordinary client would. (With the busiest other client's take instead, a client ahead
        matched every other client's prompt in turn: four clients whose prompts arrive in
        different iterations gave it four prompts' worth to their one each.)"""
        client = req.client
        context = req.num_cached  # the chunk's first position: prompt tokens already cached
        if req.prompt_remaining and self.token_budget is not None:
            others = [c for c in self.taken if c != client]
            away = [c for c in self._returning() if c != client and c not in self.taken]
            rivals = others + away
            if rivals and self._ahead(client, rivals):
                least = min([self.taken[c] for c in others] + ([OUTPUT_WEIGHT] if away else []))
                share = least - self.taken.get(client, 0)
                n_tokens = max(1, min(n_tokens, self.chunk_fitting(share, context)))
        cost = self.chunk_cost(n_tokens, context) if req.prompt_remaining else n_tokens * self.decode_cost(context)
        self.taken[client] = self.taken.get(client, 0) + cost
        self.counters[client] = self.counters.get(client, self.floor) + cost
        return n_tokens

    def _returning(self) -> list:
        """Clients between two requests that still count as present (see `finished`)."""
        return [c for c, last in self.returning.items() if last >= self.selection]

    def chunk_cost(self, n_tokens: int, context: int) -> int:
        """Weighted cost of a prompt chunk of n_tokens whose first token is at position
        `context`: PROMPT_WEIGHT per token, times (1 + context / context_cost_tokens), rounded
        up. A chunk at position 0 (a whole short prompt) costs exactly its tokens."""
        scale = self.context_cost_tokens
        return -(-PROMPT_WEIGHT * n_tokens * (scale + context) // scale)

    def decode_cost(self, context: int) -> float:
        """Weighted cost of a decode row whose token sits at position `context` (it attends to the
        `context` cached keys before it): OUTPUT_WEIGHT x (1 + context / decode_context_cost_tokens)."""
        scale = self.decode_context_cost_tokens
        return OUTPUT_WEIGHT * (scale + context) / scale

    def chunk_fitting(self, cost: int, context: int) -> int:
        """The most tokens of a prompt chunk at position `context` whose cost is at most `cost`."""
        scale = self.context_cost_tokens
        return int(max(0, cost) * scale // (PROMPT_WEIGHT * (scale + context)))

    def _hold_at_cap(self, client) -> None:
        """The cap, not the fair order, holds `client` back: its counter banks no credit for the
        service it cannot take, as a client's idle time banks none. It is lifted to the smallest
        counter of the other present clients, so they are never "ahead" of it (and their
        prompts cut into chunks) merely because it waits at its cap."""
        least = min(self.counters[c] for c in self.active if c != client)
        self.counters[client] = max(self.counters[client], least)

    def _over_cap(self, client, held: int, req) -> bool:
        """req would take its client (holding `held` slots) past the cap while another client
        is present (`active`: a request in the pool, or between two requests). Alone, a client
        is never capped: holding it back would leave slots idle that nobody else wants."""
        cap = self.max_kv_per_client
        if cap is None or held == 0 or held + req.reservation <= cap:
            return False
        return any(c != client for c in self.active)

    def _track(self, clients: set) -> None:
        """Lift clients that became present to the present minimum; keep the idle ones' counters.
        Present: a request in the pool, or between two requests (`finished`)."""
        self.returning = {c: last for c, last in self.returning.items() if last >= self.selection}
        clients = clients | self.returning.keys()
        self.row_turn = {c: turn for c, turn in self.row_turn.items() if c in clients}
        self.row_credit = {c: credit for c, credit in self.row_credit.items() if c in clients}
        staying = clients & self.active
        if staying:
            self.floor = max(self.floor, min(self.counters[c] for c in staying))
        for c in clients - self.active:
            self.counters[c] = max(self.counters.get(c, 0), self.floor)
        self.active = clients
        idle = len(self.counters) - len(clients)
        if idle > MAX_IDLE_COUNTERS:
            # Counters at or below the floor carry nothing: a returning client is lifted to it.
            forget = sorted((v, c) for c, v in self.counters.items() if c not in clients)
            for _, c in forget[:idle - MAX_IDLE_COUNTERS]:
                del self.counters[c]
