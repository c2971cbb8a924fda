// Argument checks shared by the tensor-level ops (csrc/torch/ops.cpp), and the one place where
// index tensors get a common type. Every failed check raises c10::ValueError (Python ValueError)
// with a message that names the argument and the limit, except a CUDA tensor given to a build
// without CUDA, which raises c10::Error (Python RuntimeError): the input is fine, the build is not.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace orca::checks {

std::string shape_str(const at::Tensor& t);

// t is defined and has `rank` dimensions; `layout` names them in the message ("[T, H]").
void rank(const at::Tensor& t, int64_t rank, const char* name, const char* layout);

void same_device(const at::Tensor& ref, const at::Tensor& t, const char* ref_name, const char* name);
void same_dtype(const at::Tensor& ref, const at::Tensor& t, const char* ref_name, const char* name);

// A float dtype that t's backend implements: float32/bfloat16 on CPU, plus float16 on CUDA.
void float_dtype(const at::Tensor& t, const char* name);

// A 1-D int32 or int64 tensor.
void index_tensor(const at::Tensor& t, const char* name);

void eps(double eps);

// The kernels take one index type per call. Returns `index` contiguous and in that type: int32
// when every tensor is int32, otherwise all widened to int64 (values are never narrowed).
std::vector<at::Tensor> with_common_index_type(const std::vector<at::Tensor>& index);

}  // namespace orca::checks
