"""Playing the engine around a scheduler in tests: what happens to a returned batch, and a
random mix of arrivals, selections, returns and aborts (the property tests' workload)."""
from __future__ import annotations

import random
from typing import Callable, Optional


def advance(batch: list) -> None:
    """What the engine does to a returned batch: its inputs are cached, then one more token each
    (none after a prompt chunk that is not the last), finish at max_tokens."""
    for r in batch:
        if r.finished:
            continue
        r.num_cached += len(r.next_inputs()[0])
        if r.prompt_remaining:
            continue
        r.output_token_ids.append(0)
        if len(r.output_token_ids) >= r.params.max_tokens:
            r.mark_finished("length")


def random_operations(s, rng: random.Random, steps: int, new_request: Callable[[], Optional[object]],
                      run_batch: Callable, on_batch: Callable[[list], None],
                      check: Callable[[list, list], None]) -> tuple[list, list]:
    """`steps` random operations on scheduler `s`: an arrival (`new_request()`, None to skip),
    a selection (`on_batch(batch)` sees it), the return of a random batch in flight
    (`run_batch(s, batch)`), or an abort; `check(inflight, all_requests)` after each.
    Returns (all requests, batches still in flight)."""
    all_reqs: list = []
    inflight: list = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.3:
            r = new_request()
            if r is not None:
                s.add(r)
                all_reqs.append(r)
        elif op < 0.65:
            batch = s.schedule()
            on_batch(batch)
            if batch:
                inflight.append(batch)
        elif op < 0.9 and inflight:
            run_batch(s, inflight.pop(rng.randrange(len(inflight))))
        elif all_reqs:
            victim = rng.choice(all_reqs)
            if not victim.finished:
                victim.mark_finished("abort")
                s.remove(victim)
        check(inflight, all_reqs)
    return all_reqs, inflight
