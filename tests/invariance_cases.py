"""Shared by the CPU and CUDA batch-invariance tests: an engine driver that records every emitted
token's logits row, the probe requests whose outputs are compared, and random crowds."""
from __future__ import annotations

import random

import torch

from orca_ext.config import EngineConfig
from orca_ext.engine import Engine
from orca_ext.executor import LocalExecutor
from orca_ext.request import Request
from orca_ext.sampling import Sampler, SamplingParams
from orca_ext.scheduler import make_scheduler


class RecordingSampler(Sampler):
    """Keeps the logits row of every token a request emits."""

    def __init__(self):
        self.rows: dict[str, list[torch.Tensor]] = {}

    def __call__(self, logits, requests):
        for i, req in enumerate(requests):
            if req.emits_token:
                self.rows.setdefault(req.request_id, []).append(logits[i].clone())
        return super().__call__(logits, requests)


def run(model, jobs: list[tuple[str, list[int], SamplingParams, int]], budget) -> dict:
    """jobs: (request id, prompt, params, arrival step). Returns {id: (tokens, [steps, V] logits)}."""
    sampler = RecordingSampler()
    engine = Engine(LocalExecutor(model, sampler),
                    make_scheduler(EngineConfig(max_batch_size=32, max_num_batched_tokens=budget), 6000))
    pending = sorted(jobs, key=lambda j: j[3])
    reqs, step = [], 0
    while pending or engine.has_work():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            reqs.append(Request(rid, prompt, params))
            engine.add_request(reqs[-1])
        engine.step()
        step += 1
    return {r.request_id: (r.output_token_ids, torch.stack(sampler.rows[r.request_id])) for r in reqs}


def probes(rng: random.Random) -> list[tuple[str, list[int], SamplingParams, int]]:
    """The requests whose outputs are compared: greedy, and seeded sampling with top-k / top-p."""
    def prompt(n):
        return [rng.randrange(1000) for _ in range(n)]

    return [("greedy", prompt(45), SamplingParams(max_tokens=10, ignore_eos=True), 0),
            ("seeded", prompt(23), SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=7,
                                                  ignore_eos=True), 0)]


def crowd(rng: random.Random, size: int) -> list[tuple[str, list[int], SamplingParams, int]]:
    jobs = []
    for i in range(size):
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(1000))
        jobs.append((f"other{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 60))], params,
                     rng.randint(0, 6)))
    return jobs
