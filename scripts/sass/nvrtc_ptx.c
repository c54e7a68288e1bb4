// nvrtc_ptx KERNEL.cu OUT.ptx INCLUDE_DIR: compiles a kernel source as the CUDA
// executor does (NVRTC, compute_90, no contraction) into PTX, for ptxas and cuobjdump.
#include <stdio.h>
#include <stdlib.h>
#include "nvrtc.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: nvrtc_ptx KERNEL.cu OUT.ptx INCLUDE_DIR\n");
    return 2;
  }
  FILE* f = fopen(argv[1], "rb");
  if (!f) {
    fprintf(stderr, "%s: cannot open\n", argv[1]);
    return 2;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char* src = malloc(n + 1);
  if (fread(src, 1, n, f) != (size_t)n) {
    fprintf(stderr, "%s: short read\n", argv[1]);
    return 2;
  }
  src[n] = 0;
  fclose(f);
  char include[4096];
  snprintf(include, sizeof include, "-I%s", argv[3]);
  const char* opts[] = {"--gpu-architecture=compute_90", "--fmad=false", include};
  nvrtcProgram p;
  nvrtcCreateProgram(&p, src, "k.cu", 0, NULL, NULL);
  nvrtcResult r = nvrtcCompileProgram(p, 3, opts);
  size_t log_size;
  nvrtcGetProgramLogSize(p, &log_size);
  char* log = malloc(log_size);
  nvrtcGetProgramLog(p, log);
  if (log_size > 1) fprintf(stderr, "%s: %s\n", argv[1], log);
  if (r != NVRTC_SUCCESS) return 1;
  size_t ptx_size;
  nvrtcGetPTXSize(p, &ptx_size);
  char* ptx = malloc(ptx_size);
  nvrtcGetPTX(p, ptx);
  FILE* o = fopen(argv[2], "wb");
  fwrite(ptx, 1, ptx_size - 1, o);
  fclose(o);
  return 0;
}
