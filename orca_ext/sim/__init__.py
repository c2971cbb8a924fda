"""A serving simulator that runs the engine's own scheduler on a virtual clock, with a roofline
cost model in place of the forward pass (docs/DESIGN.md section 7):

    trace.py    TraceRequest, synthetic(), load_jsonl() / save_jsonl()
    work.py     Work: one iteration's tokens, rows and attention context
    cost.py     ModelShape, Hardware, Roofline (FLOPs, bytes, TP/PP communication), ConstantCost
    loop.py     simulate(trace, config, cost, n_slots) -> SimResult (per request and iteration)
    fit.py      fit of a Hardware to IterationRecords of a real run (roofline max form), fit_trace()
    measure.py  replay(server, trace): the same trace on a real Server, measured
    presets.py  GPT-3-like shapes, A100 and H200 rates, JSON load/save
    plan.py     the cheapest replicas x TP x PP x max_batch_size meeting an SLO
    cli.py      `python -m orca_ext simulate`
"""
from .cost import ConstantCost, Hardware, ModelShape, Roofline
from .loop import SimResult, simulate
from .trace import TraceRequest, load_jsonl, synthetic

__all__ = ["ConstantCost", "Hardware", "ModelShape", "Roofline", "SimResult", "TraceRequest", "load_jsonl",
           "simulate", "synthetic"]
