// The pybind11 module orca_ext._C. This is the only translation unit that includes the
// (slow to compile) torch/pybind glue; everything else sees ATen or raw pointers only.
// Entry points: ops.h (checks and device dispatch); the KV slot allocator: ../slab_allocator.h.
#include <torch/csrc/utils/pybind.h>

#include <c10/util/Exception.h>

#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "ops.h"
#include "slab_allocator.h"

namespace py = pybind11;

// The kernels run without the GIL: they touch no Python object (pybind converts the arguments
// before and the result after), and the HTTP server's event loop shares the process. Holding
// the GIL through a kernel would stop that loop for the kernel's duration, and any Python work
// of the loop (answering connections) would stop the whole OpenMP team for its duration instead
// of sharing the cores with it.
static const auto kernel_call = py::call_guard<py::gil_scoped_release>();

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

  m.def("rms_norm", &orca::rms_norm, kernel_call, py::arg("x"), py::arg("weight"), py::arg("eps"),
        "rms_norm(x[T,H], weight[H], eps) -> [T,H]; the norm in float32.");
  m.def("rmsnorm_qkv", &orca::rmsnorm_qkv, kernel_call, py::arg("x"), py::arg("norm_weight"), py::arg("qkv_weight"),
        py::arg("qkv_bias"), py::arg("eps"), py::arg("batch_invariant") = false,
        "rmsnorm_qkv(x[T,H], norm_weight[H], qkv_weight[N,H], qkv_bias[N] or None, eps, batch_invariant=False) "
        "-> [T,N]; batch_invariant keeps one T-independent code path (CPU: our kernel at every T; CUDA: "
        "fixed-chunk cuBLAS)");
  m.def("slab_write", &orca::slab_write, kernel_call, py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"),
        py::arg("slots"), "slab_write(k_cache[S,Hkv,D], v_cache, k[T,Hkv,D], v, slots[T]): cache[slots[t]] = k[t]");
  m.def("row_argmax", &orca::row_argmax, kernel_call, py::arg("x"),
        "row_argmax(x[R,V] float32) -> (index[R] int64, value[R] float32): each row's maximum and the first "
        "column holding it (NaN and its first column for a row with a NaN); CPU only");
  m.def("rope_slab_write", &orca::rope_slab_write, kernel_call, py::arg("qkv"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("n_q_heads"), py::arg("n_kv_heads"),
        "rope_slab_write(qkv[T,(Hq+2Hkv)*D], cos[T,D/2] f32, sin[T,D/2] f32, k_cache[S,Hkv,D], v_cache, slots[T], "
        "n_q_heads, n_kv_heads) -> q[T,Hq,D]; rotates q and k (half-split rope, float32), writes rotated k and v "
        "to the caches at slots[t]; CPU only");
  using orca::RaggedAttentionPlan;
  py::class_<RaggedAttentionPlan, std::shared_ptr<RaggedAttentionPlan>>(
      m, "RaggedAttentionPlan",
      "The attention work list of one set of per-request indices (ragged_attention_plan); pass it to "
      "ragged_attention(..., plan=) of every layer that shares those indices.")
      .def_property_readonly("n_tokens", [](const RaggedAttentionPlan& p) { return p.n_tokens; })
      .def_property_readonly("n_requests", [](const RaggedAttentionPlan& p) { return p.n_requests; })
      .def_property_readonly("n_slots", [](const RaggedAttentionPlan& p) { return p.n_slots; })
      .def_property_readonly("n_q_heads", [](const RaggedAttentionPlan& p) { return p.n_q_heads; })
      .def_property_readonly("n_kv_heads", [](const RaggedAttentionPlan& p) { return p.n_kv_heads; })
      .def_property_readonly("head_dim", [](const RaggedAttentionPlan& p) { return p.head_dim; })
      .def_property_readonly("dtype", [](const RaggedAttentionPlan& p) { return p.dtype; })
      .def_property_readonly("device", [](const RaggedAttentionPlan& p) { return p.device; })
      .def_property_readonly("items_per_sm", [](const RaggedAttentionPlan& p) { return p.items_per_sm; })
      .def_property_readonly("decode_stages", [](const RaggedAttentionPlan& p) { return p.decode_stages; })
      .def_property_readonly("batch_invariant", [](const RaggedAttentionPlan& p) { return p.batch_invariant; })
      .def_property_readonly(
          "nbytes", [](const RaggedAttentionPlan& p) { return p.workspace.defined() ? p.workspace.numel() : 0; },
          "Bytes of the device work list (0 where none is needed: CPU, the CUDA-core path, an empty batch).")
      .def("__repr__", [](const RaggedAttentionPlan& p) {
        std::ostringstream os;
        os << "RaggedAttentionPlan(n_tokens=" << p.n_tokens << ", n_requests=" << p.n_requests
           << ", n_slots=" << p.n_slots << ", heads=" << p.n_q_heads << "/" << p.n_kv_heads << "x" << p.head_dim
           << ", dtype=" << p.dtype << ", device=" << p.device << ", items_per_sm=" << p.items_per_sm
           << ", decode_stages=" << p.decode_stages
           << ", batch_invariant=" << (p.batch_invariant ? "True" : "False") << ")";
        return os.str();
      });
  m.def("ragged_attention_plan", &orca::ragged_attention_plan, py::arg("q_start"), py::arg("q_len"),
        py::arg("kv_start"), py::arg("kv_len"), py::arg("n_tokens"), py::arg("n_slots"), py::arg("n_q_heads"),
        py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("dtype"), py::arg("items_per_sm") = 16,
        py::arg("decode_stages") = 0, py::arg("batch_invariant") = false,
        "ragged_attention_plan(q_start[B], q_len[B], kv_start[B], kv_len[B], n_tokens, n_slots, n_q_heads, "
        "n_kv_heads, head_dim, dtype, items_per_sm=16, decode_stages=0, batch_invariant=False) -> "
        "RaggedAttentionPlan; build once per forward pass, pass to every layer's ragged_attention "
        "(with the same batch_invariant)");
  m.def(
      "ragged_attention",
      [](const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_start,
         const at::Tensor& q_len, const at::Tensor& kv_start, const at::Tensor& kv_len, double scale,
         const std::shared_ptr<RaggedAttentionPlan>& plan, bool batch_invariant) {
        return orca::ragged_attention(q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, scale, plan.get(),
                                      batch_invariant);
      },
      kernel_call, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("q_start"), py::arg("q_len"),
      py::arg("kv_start"), py::arg("kv_len"), py::arg("scale"), py::arg("plan") = py::none(), py::arg("batch_invariant") = false,
      "ragged_attention(q[T,Hq,D], k_cache[S,Hkv,D], v_cache, q_start[B], q_len[B], kv_start[B], kv_len[B], "
      "scale, plan=None, batch_invariant=False) -> [T,Hq,D]; causal per request, GQA, softmax in float32; "
      "batch_invariant: a row's result depends only on its own request (no decode splits on CUDA, the tile "
      "path on CPU)");
  m.def("linear", &orca::linear, kernel_call, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none(), py::arg("batch_invariant") = false,
        "linear(x[T,K], weight[N,K], bias[N] or None, residual[T,N] or None, batch_invariant=False) -> [T,N] = "
        "x W^T + bias + residual; batch_invariant: each row's result depends only on that row (CPU: our kernels "
        "at every T; CUDA: cuBLAS on fixed-shape row chunks)");
  m.def("linear_silu_mul", &orca::linear_silu_mul, kernel_call, py::arg("x"), py::arg("gate_up_weight"),
        py::arg("gate_up_bias") = py::none(), py::arg("batch_invariant") = false,
        "linear_silu_mul(x[T,K], gate_up_weight[2I,K], gate_up_bias[2I] or None, batch_invariant=False) -> [T,I] "
        "= silu(gate) * up");
  // Quantized weights in ggml block formats (docs/DESIGN.md section 4).
  m.def("quant_linear", &orca::quant_linear, kernel_call, py::arg("x"), py::arg("qweight"), py::arg("qtype"), py::arg("k"),
        py::arg("bias") = py::none(), py::arg("residual") = py::none(), py::arg("batch_invariant") = false,
        py::arg("int8_activations") = false,
        "quant_linear(x[T,K], qweight[N,row_bytes] uint8, qtype, k, bias[N] or None, residual[T,N] or None, "
        "batch_invariant=False, int8_activations=False) -> [T,N] = x W^T + bias + residual, W in ggml type "
        "qtype (quant_types()); int8_activations: CPU products on int8-quantized activations (quant_int8_types())");
  m.def("quant_linear_silu_mul", &orca::quant_linear_silu_mul, kernel_call, py::arg("x"), py::arg("qweight"), py::arg("qtype"),
        py::arg("k"), py::arg("bias") = py::none(), py::arg("batch_invariant") = false,
        py::arg("int8_activations") = false,
        "quant_linear_silu_mul(x[T,K], qweight[2I,row_bytes] uint8, qtype, k, bias[2I] or None, "
        "batch_invariant=False, int8_activations=False) -> [T,I] = silu(gate) * up");
  m.def("quant_rmsnorm_qkv", &orca::quant_rmsnorm_qkv, kernel_call, py::arg("x"), py::arg("norm_weight"), py::arg("qweight"),
        py::arg("qtype"), py::arg("k"), py::arg("bias"), py::arg("eps"), py::arg("batch_invariant") = false,
        py::arg("int8_activations") = false,
        "quant_rmsnorm_qkv(x[T,K], norm_weight[K], qweight[N,row_bytes] uint8, qtype, k, bias[N] or None, eps, "
        "batch_invariant=False, int8_activations=False) -> [T,N] = quant_linear(rms_norm(x) * norm_weight, "
        "qweight, bias)");
  m.def("quant_embedding", &orca::quant_embedding, kernel_call, py::arg("qweight"), py::arg("qtype"), py::arg("k"),
        py::arg("token_ids"), py::arg("dtype"),
        "quant_embedding(qweight[V,row_bytes] uint8, qtype, k, token_ids[T] int64, dtype) -> [T,K]: the "
        "dequantized rows");
  m.def("quant_types", &orca::quant_types, "The ggml type ids the quant_* ops accept.");
  m.def("quant_int8_types", &orca::quant_int8_types,
        "The ggml type ids whose CPU products int8_activations=True changes (int8-quantized activations).");
  m.def("cpu_quant_path", &orca::cpu_ops::quant_path, "The instruction path of the CPU quantized kernels.");
  m.def("set_cpu_quant_path", &orca::cpu_ops::set_quant_path, py::arg("path"),
        "avx2, or avx512 where the CPU has AVX-512F (they round differently).");
  m.def("cpu_quant_paths", &orca::cpu_ops::quant_paths, "The quantized paths this CPU can run.");
  m.def("slab_move", &orca::slab_move, kernel_call, py::arg("pools"), py::arg("moves"),
        "slab_move(pools[P,S,...], moves[M,3] int64 CPU): for each (src, dst, n) in order, rows [src, src+n) "
        "of every pool go to [dst, dst+n) as if through a temporary (slab compaction)");
  // CPU projections: the crossover from our weight-streaming kernels to ATen, per dtype.
  m.def("cpu_stream_max_tokens", &orca::cpu_ops::stream_max_tokens, py::arg("dtype"),
        "Largest T that CPU rmsnorm_qkv / linear / linear_silu_mul run on our kernels (\"float32\" or \"bfloat16\").");
  m.def("set_cpu_stream_max_tokens", &orca::cpu_ops::set_stream_max_tokens, py::arg("dtype"), py::arg("max_tokens"));
  m.def("cpu_bf16_path", &orca::cpu_ops::bf16_path, "The instruction path of the CPU bf16 kernels.");
  m.def("set_cpu_bf16_path", &orca::cpu_ops::set_bf16_path, py::arg("path"),
        "avx2, avx512_bf16 (where the CPU has it) or avx512_bf16_emulated (a slow scalar emulation, for tests).");
  m.def("cpu_bf16_paths", &orca::cpu_ops::bf16_paths, "The bf16 paths this CPU can run.");
  m.def("cpu_f32_path", &orca::cpu_ops::f32_path, "The instruction path of the CPU float32 kernels.");
  m.def("set_cpu_f32_path", &orca::cpu_ops::set_f32_path, py::arg("path"),
        "avx2, or avx512 where the CPU has AVX-512 F/BW/VL/DQ (they round differently).");
  m.def("cpu_f32_paths", &orca::cpu_ops::f32_paths, "The float32 paths this CPU can run.");
  m.def("stream_read", &orca::cpu_ops::stream_read, kernel_call, py::arg("words"),
        "Reads a contiguous int64 tensor once with all threads (the streaming-read bandwidth probe); "
        "returns the XOR of its words.");
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
