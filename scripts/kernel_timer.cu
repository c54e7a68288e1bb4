// Times one kernel of a cubin on the GPU machine, apart from any step: the generated
// sources (`AMPGRAPH_DUMP_KERNELS=DIR cargo test -p ampgraph-exec --lib -- parse_check`
// writes one of every kind; sizes are the kernels' arguments, not their sources) are
// compiled there with `nvcc -cubin -arch=sm_90`, and this launches the named kernel
// with the arguments given and prints its registers, resident blocks a multiprocessor
// and the median time of its launches. A variant is timed by editing the source: each
// try costs seconds of device time, not a bundle and a bench.
//
//   nvcc -O3 -o kernel_timer kernel_timer.cu -lcuda
//   ./kernel_timer FILE.cubin KERNEL GRID BLOCK ARG...
//
// GRID and BLOCK are block and thread counts (GRID `wave` asks for one wave of resident
// blocks). Each ARG is `buf:BYTES` (a device buffer of bf16 values from 1/128 to 2),
// `zero:BYTES` (zeroed), `ones:N` (N f32 ones: a scale), `i64:V`, `i32:V`, `f64:V` or
// `f32:V`. REPS (default 20) launches are timed after 3. A `.ptx` (`nvcc -ptx
// -arch=compute_90 --fmad=false`) loads as the executor's kernels do, the driver
// compiling it.
//
// A number from here is a lead, not a result: check it in the step (a trace). GPT-2's
// causal k_dkv ran 341 us here unbounded and 260 in its step, and a register bound
// that made it 20% faster here did nothing there (benchmark-history, fifty-sixth
// session); the inputs here are not the step's (unpacked, synthetic values).
#include <cuda.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void check(CUresult e, const char* what) {
  if (e == CUDA_SUCCESS) return;
  const char* m = "unknown";
  cuGetErrorString(e, &m);
  fprintf(stderr, "kernel_timer: %s: %s\n", what, m);
  exit(1);
}

// One kernel argument: its bytes as cuLaunchKernel reads them.
struct Arg {
  unsigned char bytes[8];
};

static Arg parse(const std::string& spec) {
  Arg a{};
  const size_t colon = spec.find(':');
  if (colon == std::string::npos) {
    fprintf(stderr, "kernel_timer: argument '%s' is not KIND:VALUE\n", spec.c_str());
    exit(2);
  }
  const std::string kind = spec.substr(0, colon), value = spec.substr(colon + 1);
  if (kind == "buf" || kind == "zero" || kind == "ones") {
    const size_t n = strtoull(value.c_str(), nullptr, 10);
    const size_t bytes = kind == "ones" ? 4 * n : n;
    CUdeviceptr p;
    check(cuMemAlloc(&p, std::max<size_t>(bytes, 1)), "allocation");
    if (kind == "zero") {
      check(cuMemsetD8(p, 0, bytes), "zeroing");
    } else {
      std::vector<unsigned char> host(bytes);
      if (kind == "ones") {
        const float one = 1.0f;
        for (size_t i = 0; i < n; ++i) memcpy(&host[4 * i], &one, 4);
      } else {
        // bf16 0x3f80 with its low 10 bits flipped by a hash: positive values from
        // 1/128 to 2, no infinities or NaNs whatever the kernel reads them as.
        for (size_t i = 0; i < bytes; ++i) {
          const unsigned short v = 0x3f80 ^ (unsigned short)(((i / 2) * 2654435761u) >> 20 & 0x3ff);
          host[i] = (unsigned char)(i % 2 ? v >> 8 : v & 0xff);
        }
      }
      check(cuMemcpyHtoD(p, host.data(), bytes), "upload");
    }
    memcpy(a.bytes, &p, sizeof p);
  } else if (kind == "i64") {
    const long long v = strtoll(value.c_str(), nullptr, 10);
    memcpy(a.bytes, &v, 8);
  } else if (kind == "i32") {
    const int v = atoi(value.c_str());
    memcpy(a.bytes, &v, 4);
  } else if (kind == "f64") {
    const double v = atof(value.c_str());
    memcpy(a.bytes, &v, 8);
  } else if (kind == "f32") {
    const float v = (float)atof(value.c_str());
    memcpy(a.bytes, &v, 4);
  } else {
    fprintf(stderr, "kernel_timer: unknown argument kind '%s'\n", kind.c_str());
    exit(2);
  }
  return a;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: kernel_timer FILE.cubin KERNEL GRID|wave BLOCK ARG...\n");
    return 2;
  }
  check(cuInit(0), "init");
  CUdevice dev;
  check(cuDeviceGet(&dev, 0), "device");
  CUcontext ctx;
  check(cuCtxCreate(&ctx, nullptr, 0, dev), "context");
  CUmodule module;
  check(cuModuleLoad(&module, argv[1]), argv[1]);
  CUfunction f;
  check(cuModuleGetFunction(&f, module, argv[2]), argv[2]);
  const unsigned block = (unsigned)atoi(argv[4]);
  int regs = 0, per_sm = 0, sms = 0;
  check(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, f), "registers");
  check(cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, f, block, 0), "occupancy");
  check(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "multiprocessors");
  const unsigned grid = strcmp(argv[3], "wave") == 0 ? (unsigned)(per_sm * sms) : (unsigned)atoi(argv[3]);
  std::vector<Arg> args;
  for (int i = 5; i < argc; ++i) args.push_back(parse(argv[i]));
  std::vector<void*> pointers;
  for (auto& a : args) pointers.push_back(a.bytes);
  const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 20;
  CUevent start, end;
  check(cuEventCreate(&start, 0), "event");
  check(cuEventCreate(&end, 0), "event");
  std::vector<float> times;
  for (int r = -3; r < reps; ++r) {
    check(cuEventRecord(start, 0), "record");
    check(cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, 0, pointers.data(), nullptr), "launch");
    check(cuEventRecord(end, 0), "record");
    check(cuEventSynchronize(end), "kernel");
    float ms = 0;
    check(cuEventElapsedTime(&ms, start, end), "elapsed");
    if (r >= 0) times.push_back(ms * 1000);
  }
  std::sort(times.begin(), times.end());
  printf("%s %s grid %u block %u: %d registers, %d blocks a multiprocessor (%d); median %.1f us, min %.1f\n",
         argv[1], argv[2], grid, block, regs, per_sm, sms, times[times.size() / 2], times[0]);
  return 0;
}
