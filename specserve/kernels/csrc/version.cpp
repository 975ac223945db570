// Smallest op of the extension: lets tests and setup check that the build loads.
#include <torch/library.h>

namespace {
int64_t kernels_version() { return 1; }
}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("kernels_version() -> int", &kernels_version);
}
