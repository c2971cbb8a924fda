"""bench/plot_prefill_roofline.py reads the result lines the CPU microbenchmarks print
(bench/cpu/bench_util.h's report and ceilings lines, as captured from bench_quant_gemm and
bench_skinny_gemm runs): each line's series (format and path), tokens, GFLOP/s and intensity
(GFLOP/s over GB/s), skipping validation lines and lines without T; then draws the PNG."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import plot_prefill_roofline as roofline  # noqa: E402

OUTPUT = """\
ok   Q8_0<f32,avx2> T=13 K=768 N=38 (linear, silu_mul, rmsnorm; invariance)               max abs err 8.22e-04
validation passed

ceilings (2 threads): streaming read 20.9 GB/s, memcpy 14.7 GB/s (read+write), FMA 176.9 GFLOP/s
zmm FMA 353.1 GFLOP/s; the peak below is the larger of ymm and zmm
Q8_0 llama1b o 2048x2048/avx2-int8act T=8    median     906.8 us (best     858.4)    74.0 GFLOP/s =  42% of FMA 177     4.9 GB/s =  23% of read 20.9,  33% of memcpy 14.7
Q8_0 llama1b up 8192x2048/avx2-int8act T=512 median  162546.2 us (best  161286.7)   105.7 GFLOP/s =  60% of FMA 177     0.1 GB/s =   1% of read 20.9,   1% of memcpy 14.7
Q4_K smollm2 up 1536x576/avx2 T=1              median      61.2 us (best      58.0)    28.9 GFLOP/s =  16% of FMA 177    10.2 GB/s =  49% of read 20.9,  69% of memcpy 14.7
layer smollm2 f32/avx2 T=64                  median    1200.0 us (best    1180.0)   113.2 GFLOP/s =  64% of FMA 177     3.5 GB/s =  17% of read 20.9,  24% of memcpy 14.7
all linear layers bf16/avx512bf16 T=16 (540 MB) median 30000.0 us (best 29000.0)  90.1 GFLOP/s =  51% of FMA 177    11.3 GB/s =  54% of read 20.9,  77% of memcpy 14.7
slab_write T=64 H=3 D=64                     median      10.0 us (best       9.0)     5.2 GB/s =  25% of read 20.9,  35% of memcpy 14.7
"""


def test_parse_reads_series_tokens_and_intensity():
    ceilings, points = roofline.parse(OUTPUT.splitlines())
    assert ceilings == [roofline.Ceilings(2, 20.9, 176.9, 353.1)]
    got = {(p.series, p.tokens): p for p in points}
    assert set(got) == {("Q8_0 avx2-int8act", 8), ("Q8_0 avx2-int8act", 512), ("Q4_K avx2", 1),
                        ("f32/avx2", 64), ("bf16/avx512bf16", 16)}
    p = got[("Q8_0 avx2-int8act", 8)]
    assert p.gflops == 74.0 and p.intensity == pytest.approx(74.0 / 4.9)
    assert got[("f32/avx2", 64)].intensity == pytest.approx(113.2 / 3.5)


def test_main_draws_the_png_and_refuses_empty_outputs(tmp_path):
    text = tmp_path / "quant.txt"
    text.write_text(OUTPUT)
    png = tmp_path / "roofline.png"
    assert roofline.main([str(text), "--out", str(png), "--title", "test"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.txt"
    empty.write_text("validation passed\n")
    assert roofline.main([str(empty), "--out", str(tmp_path / "none.png")]) == 1
    assert not (tmp_path / "none.png").exists()
