// The pybind11 module orca_ext._C. This is the only translation unit that includes the
// (slow to compile) torch/pybind glue; everything else sees ATen or raw pointers only.
// Entry points: ops.h (checks and device dispatch); the KV slot allocator: ../slab_allocator.h.
#include <torch/csrc/utils/pybind.h>

#include <c10/util/Exception.h>

#include <stdexcept>

#include "cpu_ops.h"
#include "ops.h"
#include "slab_allocator.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "orca_ext kernels (CPU; CUDA when built with a CUDA torch) and the KV slab allocator";

  // Clean Python exceptions: the message without the C++ backtrace, ValueError for bad input.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  m.def("rms_norm", &orca::rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        "rms_norm(x[T,H], weight[H], eps) -> [T,H]; the norm in float32.");
  m.def("rmsnorm_qkv", &orca::rmsnorm_qkv, py::arg("x"), py::arg("norm_weight"), py::arg("qkv_weight"),
        py::arg("qkv_bias"), py::arg("eps"), py::arg("batch_invariant") = false,
        "rmsnorm_qkv(x[T,H], norm_weight[H], qkv_weight[N,H], qkv_bias[N] or None, eps, batch_invariant=False) "
        "-> [T,N]; batch_invariant keeps one code path for every T");
  m.def("linear", &orca::linear, py::arg("x"), py::arg("weight"), py::arg("bias"),
        "linear(x[T,K], weight[N,K], bias[N] or None) -> [T,N] = x W^T + b, batch-invariant: each row's "
        "result depends only on that row");
  m.def("slab_write", &orca::slab_write, py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"),
        py::arg("slots"), "slab_write(k_cache[S,Hkv,D], v_cache, k[T,Hkv,D], v, slots[T]): cache[slots[t]] = k[t]");
  m.def("ragged_attention", &orca::ragged_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("q_start"), py::arg("q_len"), py::arg("kv_start"), py::arg("kv_len"), py::arg("scale"),
        py::arg("batch_invariant") = false,
        "ragged_attention(q[T,Hq,D], k_cache[S,Hkv,D], v_cache, q_start[B], q_len[B], kv_start[B], kv_len[B], "
        "scale, batch_invariant=False) -> [T,Hq,D]; causal per request, GQA, softmax in float32");
  m.def("silu_mul", &orca::silu_mul, py::arg("gate_up"),
        "silu_mul(gate_up[T,2I]) -> [T,I] = silu(gate) * up, batch-invariant (each row computed whole)");
  m.def("slab_move", &orca::slab_move, py::arg("pools"), py::arg("moves"),
        "slab_move(pools[P,S,...], moves[M,3] int64 CPU): for each (src, dst, n) in order, rows [src, src+n) "
        "of every pool go to [dst, dst+n) as if through a temporary (slab compaction)");
  py::dict fused_max;  // rmsnorm_qkv on CPU: largest T that runs the fused kernel, per dtype
  fused_max["float32"] = orca::cpu_ops::kCpuFusedMaxTokensFloat;
  fused_max["bfloat16"] = orca::cpu_ops::kCpuFusedMaxTokensBf16;
  fused_max["wide_outputs"] = orca::cpu_ops::kCpuWideOutputs;  // float32 with at least this many outputs ...
  fused_max["float32_wide"] = orca::cpu_ops::kCpuFusedMaxTokensWide;  // ... stays fused up to this many tokens
  m.attr("CPU_FUSED_MAX_TOKENS") = fused_max;
  m.def("built_with_cuda", &orca::built_with_cuda,
        "True when CUDA tensors dispatch to the CUDA kernels (the extension was built against a CUDA torch).");

  // std::invalid_argument becomes ValueError through pybind11's default translation.
  py::class_<orca::SlabAllocator>(m, "SlabAllocator",
                                  "Best-fit allocator of contiguous KV slot runs; O(log n) allocate/free.")
      .def(py::init<int64_t>(), py::arg("n_slots"))
      .def("allocate", &orca::SlabAllocator::allocate, py::arg("n"),
           "Start slot of a free contiguous run of n slots, or -1 if none exists.")
      .def("free", &orca::SlabAllocator::free, py::arg("start"), "Return the slab that starts at `start`.")
      .def("compact", [](orca::SlabAllocator& a) {
             py::list moves;
             for (const auto& m : a.compact()) moves.append(py::make_tuple(m[0], m[1], m[2]));
             return moves;
           },
           "Slide every slab toward slot 0; returns [(old_start, new_start, length)] of the moved "
           "slabs in address order.")
      .def_property_readonly("n_slots", &orca::SlabAllocator::n_slots)
      .def_property_readonly("n_used", &orca::SlabAllocator::n_used)
      .def_property_readonly("n_free", &orca::SlabAllocator::n_free)
      .def_property_readonly("largest_free", &orca::SlabAllocator::largest_free)
      .def_property_readonly("n_free_runs", &orca::SlabAllocator::n_free_runs)
      .def("__repr__", [](const orca::SlabAllocator& a) {
        return "SlabAllocator(n_slots=" + std::to_string(a.n_slots()) + ", n_used=" + std::to_string(a.n_used()) +
               ", largest_free=" + std::to_string(a.largest_free()) + ")";
      });
}
