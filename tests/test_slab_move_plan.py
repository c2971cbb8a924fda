"""The copy plan of the CUDA slab_move (csrc/cuda/slab_move_plan.h), run on the host without a GPU.

A small driver, compiled here with the host compiler, runs the plan with a stand-in for the device
that copies with memcpy and refuses what a device refuses: a 2-D copy whose pitch exceeds the
device's maximum (cudaDevAttrMaxPitch, 2^31 - 1 bytes on current GPUs), a width above a pitch,
a copy whose source and destination overlap, or any byte outside the pools and the scratch. The
pools it leaves behind must equal orca_ext.reference.slab_move's, byte for byte, for pools whose
pitch is below, at and above the maximum (small maxima stand in for 2 GiB pools), with and
without scratch. The GPU test of a real pool over 2 GiB is in tests/cuda/test_kernels_cuda.py."""
from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from orca_ext import reference

ROOT = Path(__file__).resolve().parent.parent
CUDA_MAX_PITCH = 2**31 - 1  # cudaDevAttrMaxPitch on Hopper and Ampere

DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "cuda/slab_move_plan.h"
using namespace orca::kernels::slab_plan;

// A device stand-in: memcpy, after the checks a device copy would fail (or silently corrupt) on.
struct HostCopier {
  size_t max_pitch;
  const char* mem[2][2];  // [pools, scratch] x [begin, end)
  long n_1d = 0, n_2d = 0;
  bool refused = false;

  bool inside(const char* p, size_t n) const {
    for (const auto& m : mem)
      if (p >= m[0] && p + n <= m[1]) return true;
    return false;
  }
  static bool overlap(const char* a, const char* b, size_t n) { return a < b + n && b < a + n; }
  bool refuse(const char* why) { std::fprintf(stderr, "refused: %s\n", why); refused = true; return false; }

  bool copy_1d(char* dst, const char* src, size_t bytes) {
    if (!inside(dst, bytes) || !inside(src, bytes)) return refuse("1-D copy outside the buffers");
    if (overlap(dst, src, bytes)) return refuse("1-D copy overlaps");
    std::memcpy(dst, src, bytes);
    ++n_1d;
    return true;
  }
  bool copy_2d(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width, size_t height) {
    if (dpitch > max_pitch || spitch > max_pitch) return refuse("2-D copy pitch above the maximum");
    if (width > dpitch || width > spitch) return refuse("2-D copy width above its pitch");
    for (size_t i = 0; i < height; ++i) {
      if (!inside(dst + i * dpitch, width) || !inside(src + i * spitch, width)) return refuse("2-D copy outside");
      for (size_t j = 0; j < height; ++j)
        if (overlap(dst + i * dpitch, src + j * spitch, width)) return refuse("2-D copy overlaps");
    }
    for (size_t i = 0; i < height; ++i) std::memcpy(dst + i * dpitch, src + i * spitch, width);
    ++n_2d;
    return true;
  }
};

// choose DPITCH SPITCH HEIGHT MAX_PITCH          -> "2d" or "rows"
// move P S ROW_BYTES MAX_PITCH SCRATCH_BYTES IN OUT SRC DST N ...
//   pools [P, S, ROW_BYTES] from IN, moved, to OUT; prints "1d=<copies> 2d=<copies>".
//   Exit 2: the plan said invalid value; 4: the stand-in refused a copy.
int main(int argc, char** argv) {
  auto num = [&](int i) { return std::strtoull(argv[i], nullptr, 10); };
  if (argc == 6 && std::strcmp(argv[1], "choose") == 0) {
    const bool two_d = choose_pitched_copy(num(2), num(3), num(4), num(5)) == PitchedCopy::kTwoD;
    std::printf("%s\n", two_d ? "2d" : "rows");
    return 0;
  }
  if (argc < 9 || std::strcmp(argv[1], "move") != 0 || (argc - 9) % 3 != 0) return 1;
  const long long p = num(2), s = num(3), row = num(4);
  const size_t scratch_bytes = num(6);
  std::vector<char> pools(p * s * row), scratch(scratch_bytes);
  std::FILE* f = std::fopen(argv[7], "rb");
  if (!f || std::fread(pools.data(), 1, pools.size(), f) != pools.size()) return 1;
  std::fclose(f);
  std::vector<long long> moves;
  for (int i = 9; i < argc; ++i) moves.push_back(std::strtoll(argv[i], nullptr, 10));
  HostCopier copier{num(5), {{pools.data(), pools.data() + pools.size()},
                             {scratch.data(), scratch.data() + scratch.size()}}};
  static_assert(sizeof(long long) == sizeof(int64_t), "moves are int64");
  const SlabMoveStatus status = slab_move(copier, pools.data(), p, s, row,
      reinterpret_cast<const int64_t*>(moves.data()), static_cast<int64_t>(moves.size() / 3),
      scratch_bytes ? scratch.data() : nullptr, scratch_bytes, num(5));
  if (status == SlabMoveStatus::kInvalidValue) return 2;
  if (status != SlabMoveStatus::kOk) return copier.refused ? 4 : 1;
  f = std::fopen(argv[8], "wb");
  std::fwrite(pools.data(), 1, pools.size(), f);
  std::fclose(f);
  std::printf("1d=%ld 2d=%ld\n", copier.n_1d, copier.n_2d);
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("needs a C++ compiler to build the slab_move plan driver")
    folder = tmp_path_factory.mktemp("slab_plan")
    (folder / "driver.cpp").write_text(DRIVER)
    proc = subprocess.run([compiler, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}",
                           str(folder / "driver.cpp"), "-o", str(folder / "driver")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return folder / "driver"


def choose(driver: Path, dpitch: int, spitch: int, height: int, max_pitch: int) -> str:
    proc = subprocess.run([str(driver), "choose", str(dpitch), str(spitch), str(height), str(max_pitch)],
                          capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.strip()


def test_pitches_up_to_the_device_maximum_take_one_2d_copy_and_larger_ones_go_pool_by_pool(driver):
    m = CUDA_MAX_PITCH
    assert choose(driver, m, m, 56, m) == "2d"
    assert choose(driver, 4096, 4096, 2, m) == "2d"
    assert choose(driver, m + 1, m + 1, 56, m) == "rows"
    assert choose(driver, 4096, m + 1, 2, m) == "rows"  # scratch -> pools: either pitch counts
    assert choose(driver, m + 1, 4096, 2, m) == "rows"
    # A Qwen3-0.6B-shaped KV cache under a 90% budget on an H200: 56 pools of ~1.1 M slots x 2 KiB.
    assert choose(driver, 1_130_000 * 2048, 1_130_000 * 2048, 56, m) == "rows"
    assert choose(driver, 4096, 4096, 1, m) == "rows"   # one pool: a plain copy, no pitch
    assert choose(driver, 4096, 4096, 56, 0) == "rows"  # maximum unknown: always safe


def random_moves(rng: random.Random, n_slots: int, count: int) -> list[tuple[int, int, int]]:
    """Disjoint and overlapping moves in both directions, some empty or in place."""
    moves = []
    for i in range(count):
        n = rng.randint(0, n_slots // 2)
        src = rng.randint(0, n_slots - n)
        if i % 3 == 0:
            dst = rng.randint(0, n_slots - n)
        elif i % 3 == 1:  # overlapping, a small shift either way
            dst = max(0, min(n_slots - n, src + rng.randint(-max(1, n // 4), max(1, n // 4))))
        else:
            dst = max(0, min(n_slots - n, src + rng.randint(-n, n)))
        moves.append((src, dst, n))
    return moves


def run_move(driver: Path, tmp_path: Path, pools: torch.Tensor, max_pitch: int, scratch_bytes: int, moves):
    n_pools, n_slots, row_bytes = pools.shape
    pools.numpy().tofile(tmp_path / "in.bin")
    args = [str(driver), "move", str(n_pools), str(n_slots), str(row_bytes), str(max_pitch), str(scratch_bytes),
            str(tmp_path / "in.bin"), str(tmp_path / "out.bin")] + [str(v) for m in moves for v in m]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr.strip()}"
    counts = dict(kv.split("=") for kv in proc.stdout.split())
    out = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.uint8)).view(pools.shape)
    return out, int(counts["1d"]), int(counts["2d"])


@pytest.mark.parametrize("shape", [(1, 40, 3), (6, 97, 8), (11, 300, 5)])
@pytest.mark.parametrize("pitch_vs_max", ["below", "equal", "above"])
@pytest.mark.parametrize("scratch_rows", [0, 3, 64])
def test_slab_moves_match_the_reference_at_every_pitch(driver, tmp_path, shape, pitch_vs_max, scratch_rows):
    """Whatever the maximum pitch, the pools end up as the reference leaves them, every copy the
    stand-in was given is one a device accepts, and pools are copied one by one only when the
    pitch exceeds the maximum."""
    n_pools, n_slots, row_bytes = shape
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    pitch = n_slots * row_bytes
    max_pitch = {"below": pitch + 1 + rng.randrange(1 << 20), "equal": pitch, "above": pitch - 1}[pitch_vs_max]
    pools = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    moves = random_moves(rng, n_slots, 12)
    expected = pools.clone()
    reference.slab_move(expected, moves)
    out, n_1d, n_2d = run_move(driver, tmp_path, pools, max_pitch, scratch_rows * n_pools * row_bytes, moves)
    assert torch.equal(out, expected), f"seed {seed}, moves {moves}"
    if pitch_vs_max == "above" and n_pools > 1:
        assert n_2d == 0, f"seed {seed}: {n_2d} 2-D copies with a pitch above the maximum"
    if pitch_vs_max != "above" and n_pools > 1:
        assert n_1d == 0, f"seed {seed}: {n_1d} 1-D copies where 2-D copies fit"
    if n_pools == 1:
        assert n_2d == 0  # one pool: plain copies


def test_a_move_outside_the_pools_is_an_invalid_value(driver, tmp_path):
    pools = torch.arange(2 * 10 * 4, dtype=torch.uint8).view(2, 10, 4)
    pools.numpy().tofile(tmp_path / "in.bin")
    for bad in [(0, 8, 3), (8, 0, 3), (-1, 0, 1), (0, 0, -1)]:
        proc = subprocess.run([str(driver), "move", "2", "10", "4", str(CUDA_MAX_PITCH), "0",
                               str(tmp_path / "in.bin"), str(tmp_path / "out.bin"), *map(str, bad)],
                              capture_output=True, timeout=60)
        assert proc.returncode == 2, (bad, proc.returncode)
