// gather_rows on the CPU: the rows data[ids], as index_select gives them; the twin of
// csrc/cuda/gather_rows_cuda.cu, which also reads pinned host rows from a GPU.
#include <torch/library.h>

#include "../core/checks.h"

namespace grnnd {
namespace cpu {
namespace {

at::Tensor gather_rows_cpu(const at::Tensor& data, const at::Tensor& ids) {
  check_gather_rows(data, ids);
  return data.index_select(0, ids);
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) { m.impl("gather_rows", &gather_rows_cpu); }

}  // namespace cpu
}  // namespace grnnd
