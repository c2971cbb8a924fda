"""Benchmarks shipped with the package, so `orca-ext bench` works from an installed wheel.

throughput  orca vs static vs transformers on one offline workload (`orca-ext bench`)
serving     online load against the OpenAI-compatible server (TTFT, TPOT, ITL, goodput)

The scripts under bench/ call these and keep their results next to them.
"""
