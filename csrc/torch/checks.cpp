#include "checks.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

namespace orca::checks {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

void rank(const at::Tensor& t, int64_t rank, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.defined(), name, " is undefined");
  TORCH_CHECK_VALUE(t.dim() == rank, name, " must be ", rank, "-D ", layout, ", got shape ", shape_str(t));
}

void same_device(const at::Tensor& ref, const at::Tensor& t, const char* ref_name, const char* name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ",
                    ref.device(), "; all tensors must be on one device");
}

void same_dtype(const at::Tensor& ref, const at::Tensor& t, const char* ref_name, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(), " but ",
                    ref_name, " has ", ref.scalar_type(), "; they must match");
}

void float_dtype(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  if (t.is_cpu()) {
    TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16, name, " has dtype ", st,
                      "; on CPU only float32 and bfloat16 are supported");
  } else if (t.is_cuda()) {
#ifdef ORCA_WITH_CUDA
    TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, name, " has dtype ", st,
                      "; on CUDA only float32, float16 and bfloat16 are supported");
#else
    TORCH_CHECK(false, name, " is a CUDA tensor but orca_ext._C was built without CUDA support; "
                "reinstall with a CUDA build of torch (pip install --no-build-isolation .)");
#endif
  } else {
    TORCH_CHECK_VALUE(false, name, " is on unsupported device ", t.device(), " (expected cpu or cuda)");
  }
}

void index_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " is undefined");
  TORCH_CHECK_VALUE(t.dim() == 1, name, " must be a 1-D index tensor, got shape ", shape_str(t));
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
                    " must be int32 or int64, got ", t.scalar_type());
}

void eps(double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0.0, "eps must be finite and > 0, got ", eps);
}

std::vector<at::Tensor> with_common_index_type(const std::vector<at::Tensor>& index) {
  bool all_int32 = true;
  for (const at::Tensor& t : index) all_int32 = all_int32 && t.scalar_type() == at::kInt;
  const at::ScalarType common = all_int32 ? at::kInt : at::kLong;
  std::vector<at::Tensor> out;
  out.reserve(index.size());
  for (const at::Tensor& t : index) out.push_back(t.to(common).contiguous());
  return out;
}

}  // namespace orca::checks
