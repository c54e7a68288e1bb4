// Runs the attention kernels of several builds on the same inputs (q, k, v, do
// [B, S, H, 64], unpacked, bf16; f16 built with -DHALF), each module's k_fwd, k_dq and
// k_dkv in blocks of ROWS rows (16 a warp): times each (median of 21 launches), checks
// o, dq, dk and dv against a float64 host reference on two heads (without dropout) and
// against the first build given (with dropout: rate 0.2, the same mask), printing the
// first elements and the rows that differ.
//
//   AMPGRAPH_DUMP_KERNELS=DIR cargo test -p ampgraph-exec --lib -- dump_kernels_when_asked
//   (on the GPU machine) nvcc -cubin --fmad=false -gencode=arch=compute_90a,code=sm_90a \
//       -o new.cubin DIR/attention_bf16_64_narrow_false_false_false_sm90a.cu
//   nvcc -O2 -o attention_check attention_check.cu -lcuda
//   ./attention_check 16 12 512 512 0  old.cubin 64 old  new.cubin 64 new
//
// Module sources of an earlier commit come from the same dump in a worktree of it.
// The SASS can be read on the development machine too: NVRTC, ptxas and nvdisasm come
// as pip wheels (nvidia-cuda-nvrtc, nvidia-cuda-nvcc, nvidia-cuda-nvdisasm,
// nvidia-cuda-cuobjdump; their bin/ files need chmod +x), and `cuobjdump -sass -fun
// k_fwd` shows each HGMMA's registers (how the dropout forward's fault was found).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#ifdef HALF
typedef __half T;
float f(T x) { return __half2float(x); }
T tf(float x) { return __float2half(x); }
#else
typedef __nv_bfloat16 T;
float f(T x) { return __bfloat162float(x); }
T tf(float x) { return __float2bfloat16(x); }
#endif
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s_; cuGetErrorString(r_, &s_); printf("%s: %s\n", #x, s_); exit(1); } } while (0)
const int D = 64;
const double SCALE = 0.125;
CUdeviceptr alloc(size_t n) { CUdeviceptr p; CK(cuMemAlloc(&p, n)); CK(cuMemsetD8(p, 0, n)); return p; }
int main(int argc, char** argv) {
  const int B = atoi(argv[1]), H = atoi(argv[2]), SQ = atoi(argv[3]), SK = atoi(argv[4]), DROP = atoi(argv[5]);
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuCtxCreate(&ctx, NULL, 0, dev));
  const size_t nq = (size_t)B * SQ * H * D, nk = (size_t)B * SK * H * D;
  std::vector<T> hq(nq), hk(nk), hv(nk), hdo(nq);
  srand(7);
  auto rnd = [](float lo, float hi) { return lo + (hi - lo) * (rand() / (float)RAND_MAX); };
  for (size_t i = 0; i < nq; i++) { hq[i] = tf(rnd(-2, 2)); hdo[i] = tf(rnd(-1, 1)); }
  for (size_t i = 0; i < nk; i++) { hk[i] = tf(rnd(-2, 2)); hv[i] = tf(rnd(-1, 1)); }
  CUdeviceptr q = alloc(nq * 2), k = alloc(nk * 2), v = alloc(nk * 2), o = alloc(nq * 2), d_o = alloc(nq * 2), dq = alloc(nq * 2),
              dk = alloc(nk * 2), dv = alloc(nk * 2), lse = alloc((size_t)B * H * SQ * 4), delta = alloc((size_t)B * H * SQ * 4), count = alloc(4);
  const float three = 3.f;
  CK(cuMemcpyHtoD(count, &three, 4));
  CK(cuMemcpyHtoD(q, hq.data(), nq * 2)); CK(cuMemcpyHtoD(k, hk.data(), nk * 2)); CK(cuMemcpyHtoD(v, hv.data(), nk * 2)); CK(cuMemcpyHtoD(d_o, hdo.data(), nq * 2));
  auto qat = [&](int b, int s, int h, int c) { return (((size_t)b * SQ + s) * H + h) * D + c; };
  auto kat = [&](int b, int s, int h, int c) { return (((size_t)b * SK + s) * H + h) * D + c; };
  // Host reference on heads (0, 0) and (B-1, H-1).
  const int checks[2][2] = {{0, 0}, {B - 1, H - 1}};
  std::vector<double> ref[4][2];
  for (int c = 0; c < 2 && !DROP; c++) {
    int b = checks[c][0], h = checks[c][1];
    std::vector<double> P((size_t)SQ * SK), dS((size_t)SQ * SK);
    for (auto& r : ref) r[c].assign((size_t)std::max(SQ, SK) * D, 0);
    std::vector<double>&ro = ref[0][c], &rdq = ref[1][c], &rdk = ref[2][c], &rdv = ref[3][c];
    for (int i = 0; i < SQ; i++) {
      double mx = -1e300;
      for (int j = 0; j < SK; j++) { double s = 0; for (int e = 0; e < D; e++) s += (double)f(hq[qat(b, i, h, e)]) * f(hk[kat(b, j, h, e)]); P[(size_t)i * SK + j] = s * SCALE; mx = std::max(mx, s * SCALE); }
      double sum = 0; for (int j = 0; j < SK; j++) { P[(size_t)i * SK + j] = exp(P[(size_t)i * SK + j] - mx); sum += P[(size_t)i * SK + j]; }
      for (int j = 0; j < SK; j++) P[(size_t)i * SK + j] /= sum;
      for (int j = 0; j < SK; j++) for (int e = 0; e < D; e++) ro[i * D + e] += P[(size_t)i * SK + j] * f(hv[kat(b, j, h, e)]);
      double dl = 0; for (int e = 0; e < D; e++) dl += (double)f(hdo[qat(b, i, h, e)]) * ro[i * D + e];
      for (int j = 0; j < SK; j++) { double dp = 0; for (int e = 0; e < D; e++) dp += (double)f(hdo[qat(b, i, h, e)]) * f(hv[kat(b, j, h, e)]); dS[(size_t)i * SK + j] = P[(size_t)i * SK + j] * (dp - dl); }
    }
    for (int i = 0; i < SQ; i++) for (int j = 0; j < SK; j++) {
      double ds = dS[(size_t)i * SK + j], p = P[(size_t)i * SK + j];
      for (int e = 0; e < D; e++) {
        rdq[i * D + e] += SCALE * ds * f(hk[kat(b, j, h, e)]);
        rdk[j * D + e] += SCALE * ds * f(hq[qat(b, i, h, e)]);
        rdv[j * D + e] += p * f(hdo[qat(b, i, h, e)]);
      }
    }
  }
  std::vector<T> first[4];
  for (int a = 6; a + 2 < argc; a += 3) {
    const int rows = atoi(argv[a + 1]);
    const char* label = argv[a + 2];
    CUmodule m; CK(cuModuleLoad(&m, argv[a]));
    CUfunction fwd, fdq, fdkv; CK(cuModuleGetFunction(&fwd, m, "k_fwd")); CK(cuModuleGetFunction(&fdq, m, "k_dq")); CK(cuModuleGetFunction(&fdkv, m, "k_dkv"));
    int h_ = H, xs = H * D, sq = SQ, sk = SK, bs = 0; CUdeviceptr nul = 0, cnt = DROP ? count : 0;
    double sc = SCALE, ds = DROP ? 1.25 : 1.0; long long seed = DROP ? 1234 : 0, thr = DROP ? (long long)(0.2 * 4294967296.0) : 0;
    void* afwd[] = {&q, &k, &v, &o, &lse, &h_, &xs, &sq, &sk, &nul, &bs, &sc, &seed, &cnt, &thr, &ds};
    void* adq[] = {&q, &k, &v, &o, &lse, &d_o, &dq, &delta, &h_, &xs, &sq, &sk, &nul, &bs, &sc, &seed, &cnt, &thr, &ds};
    void* adkv[] = {&q, &k, &v, &lse, &delta, &d_o, &dk, &dv, &h_, &xs, &sq, &sk, &nul, &bs, &sc, &seed, &cnt, &thr, &ds};
    const unsigned block = rows * 2;
    struct K { const char* name; CUfunction f; unsigned grid; void** args; } ks[3] = {
      {"k_fwd", fwd, (unsigned)(B * H * ((SQ + rows - 1) / rows)), afwd},
      {"k_dq", fdq, (unsigned)(B * H * ((SQ + rows - 1) / rows)), adq},
      {"k_dkv", fdkv, (unsigned)(B * H * ((SK + rows - 1) / rows)), adkv}};
    for (auto& kk : ks) {
      int regs; CK(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, kk.f));
      int blocks; CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kk.f, block, 0));
      CK(cuLaunchKernel(kk.f, kk.grid, 1, 1, block, 1, 1, 0, 0, kk.args, 0));
      CK(cuCtxSynchronize());
      CUevent e0, e1; CK(cuEventCreate(&e0, 0)); CK(cuEventCreate(&e1, 0));
      std::vector<float> ts;
      for (int r = 0; r < 21; r++) {
        CK(cuEventRecord(e0, 0)); CK(cuLaunchKernel(kk.f, kk.grid, 1, 1, block, 1, 1, 0, 0, kk.args, 0)); CK(cuEventRecord(e1, 0));
        CK(cuEventSynchronize(e1)); float ms; CK(cuEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000);
      }
      std::sort(ts.begin(), ts.end());
      printf("%s %s: %.1f us (regs %d, %d blocks/SM)\n", label, kk.name, ts[10], regs, blocks);
    }
    std::vector<T> got[4] = {std::vector<T>(nq), std::vector<T>(nq), std::vector<T>(nk), std::vector<T>(nk)};
    CUdeviceptr outs[4] = {o, dq, dk, dv};
    const char* names[4] = {"o", "dq", "dk", "dv"};
    for (int x = 0; x < 4; x++) {
      CK(cuMemcpyDtoH(got[x].data(), outs[x], got[x].size() * 2));
      double err = 0, mag = 0, diff = 0;
      const int len = x < 2 ? SQ : SK;
      for (int c = 0; c < 2 && !DROP; c++) for (int i = 0; i < len; i++) for (int e = 0; e < D; e++) {
        double r = ref[x][c][i * D + e], g = f(got[x][x < 2 ? qat(checks[c][0], i, checks[c][1], e) : kat(checks[c][0], i, checks[c][1], e)]);
        err = std::max(err, fabs(g - r)); mag = std::max(mag, fabs(r));
      }
      if (first[x].empty()) first[x] = got[x];
      int shown = 0;
      std::vector<int> bad_rows(len, 0);
      for (size_t i = 0; i < got[x].size(); i++) {
        double e = fabs(f(got[x][i]) - f(first[x][i]));
        diff = std::max(diff, e);
        if (e > 0.01) {
          const int c = i % D, hh = (i / D) % H, ss = (i / D / H) % len, bb = i / D / H / len;
          bad_rows[ss]++;
          if (shown++ < 4) printf("  %s[b%d s%d h%d c%d] %g vs %g\n", names[x], bb, ss, hh, c, f(got[x][i]), f(first[x][i]));
        }
      }
      if (shown) { printf("  rows with errors:"); for (int r = 0; r < len; r++) if (bad_rows[r]) printf(" %d", r); printf("\n"); }
      printf("%s %s: max error %.3g of max %.3g; against the first build %.3g\n", label, names[x], err, mag, diff);
      CK(cuMemsetD8(outs[x], 0, got[x].size() * 2));
    }
    CK(cuModuleUnload(m));
  }
}
