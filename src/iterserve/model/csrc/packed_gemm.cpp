// Multi-row float32 projections on a weight packed once by MKL (cblas_sgemm_pack).
//
// A decode batch multiplies 2-256 rows by each weight. MKL's sgemm repacks the weight
// into its panel layout on every call, which costs as much as the multiply at these
// sizes; a weight packed at load skips that (1.1-1.6x on the 56M and 0.5B shapes,
// 16-256 rows, measured here). torch exposes the packed path only for one batch size
// fixed at packing time (aten::_mkl_linear falls back to the unpacked sgemm for any
// other); the packed B panels do not depend on the row count, so this op calls
// cblas_sgemm_compute for any number of rows (the loader checks the result against
// F.linear once before using it).
//
// MKL is linked into libtorch_cpu on x86 wheels; its symbols are looked up at run time,
// so a torch built without MKL still loads these kernels and just reports the packed
// path unavailable.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <dlfcn.h>

namespace {

// CBLAS constants (mkl_cblas.h).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

using PackSizeFn = size_t (*)(int, int, int, int);
using PackFn = void (*)(int, int, int, int, int, int, float, const float*, int, float*);
using ComputeFn = void (*)(int, int, int, int, int, int, const float*, int, const float*, int, float, float*,
                           int);

struct Mkl {
  PackSizeFn pack_size = nullptr;
  PackFn pack = nullptr;
  ComputeFn compute = nullptr;
  Mkl() {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    auto find = [&](const char* name) {
      void* p = dlsym(RTLD_DEFAULT, name);
      if (!p && lib) p = dlsym(lib, name);
      return p;
    };
    pack_size = reinterpret_cast<PackSizeFn>(find("cblas_sgemm_pack_get_size"));
    pack = reinterpret_cast<PackFn>(find("cblas_sgemm_pack"));
    compute = reinterpret_cast<ComputeFn>(find("cblas_sgemm_compute"));
  }
  bool ok() const { return pack_size && pack && compute; }
};

const Mkl& mkl() {
  static const Mkl m;
  return m;
}

bool mkl_pack_available() { return mkl().ok(); }

// w: [out, in] float32 -> an opaque float32 buffer holding W^T in MKL's packed layout.
at::Tensor mkl_pack_weight(const at::Tensor& w, int64_t rows_hint) {
  TORCH_CHECK(mkl().ok(), "mkl_pack_weight: MKL's packed sgemm is not available in this torch");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "mkl_pack_weight: w must be float32 [out, in]");
  at::Tensor wc = w.contiguous();
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  const int m = static_cast<int>(std::max<int64_t>(1, rows_hint));
  const size_t bytes = mkl().pack_size(kBMatrix, m, n, k);
  at::Tensor out = at::empty({static_cast<int64_t>((bytes + 3) / 4)}, w.options());
  mkl().pack(kRowMajor, kBMatrix, kTrans, m, n, k, 1.0f, wc.data_ptr<float>(), k, out.data_ptr<float>());
  return out;
}

// y = x @ W^T (+ bias): x [rows, in] float32 (rows contiguous), packed from mkl_pack_weight.
at::Tensor mkl_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(mkl().ok(), "mkl_packed_linear: MKL's packed sgemm is not available in this torch");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "mkl_packed_linear: x must be float32 [rows, in]");
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int m = static_cast<int>(xc.size(0)), k = static_cast<int>(xc.size(1));
  const int n = static_cast<int>(out_features);
  at::Tensor y;
  if (bias.has_value() && bias->defined()) {
    // beta = 1 over a copy of the bias: the add rides in the GEMM's write-back.
    // (A fresh tensor: a one-row expand would be the bias itself.)
    y = at::empty({m, n}, xc.options());
    y.copy_(bias->to(at::kFloat).expand({m, n}));
  } else {
    y = at::empty({m, n}, xc.options());
  }
  if (m == 0) return y;
  const float beta = bias.has_value() && bias->defined() ? 1.f : 0.f;
  mkl().compute(kRowMajor, kNoTrans, kPacked, m, n, k, xc.data_ptr<float>(), static_cast<int>(xc.stride(0)),
                packed.data_ptr<float>(), k, beta, y.data_ptr<float>(), n);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("mkl_pack_available() -> bool", mkl_pack_available);
  m.def("mkl_pack_weight(Tensor w, int rows_hint) -> Tensor");
  m.def("mkl_packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) {
  m.impl("mkl_pack_weight", mkl_pack_weight);
  m.impl("mkl_packed_linear", mkl_packed_linear);
}
