// A CUDA_INJECTION64_PATH tracer (Nsight Systems is not on the GPU machine): every
// kernel, memset and memcpy, with start and end in ns on the GPU's clock, one CSV
// line each in $TRACE_OUT (kind,start,end,stream,grid or bytes,block or copy kind,name);
// with TRACE_API set, the driver API calls too (D,start,end,thread,callback id,0,name).
// Built by build.sh; KREC is the newest CUpti_ActivityKernel record of the headers.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
static FILE *out;
static void CUPTIAPI req(uint8_t **b, size_t *s, size_t *m) { *s = 16 << 20; *b = aligned_alloc(8, *s); *m = 0; }
static void CUPTIAPI done(CUcontext c, uint32_t sid, uint8_t *b, size_t s, size_t valid) {
  CUpti_Activity *r = NULL;
  while (cuptiActivityGetNextRecord(b, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      KREC *k = (KREC *)r;
      fprintf(out, "K,%llu,%llu,%u,%u,%u,%s\n", (unsigned long long)k->start, (unsigned long long)k->end, k->streamId, k->gridX * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ, k->name);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      CUpti_ActivityMemset4 *k = (CUpti_ActivityMemset4 *)r;
      fprintf(out, "S,%llu,%llu,%u,%llu,0,memset\n", (unsigned long long)k->start, (unsigned long long)k->end, k->streamId, (unsigned long long)k->bytes);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)r;
      const char *nm = "?";
      cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &nm);
      fprintf(out, "D,%llu,%llu,%u,%u,0,%s\n", (unsigned long long)a->start, (unsigned long long)a->end, a->threadId, a->cbid, nm);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      CUpti_ActivityMemcpy6 *k = (CUpti_ActivityMemcpy6 *)r;
      fprintf(out, "C,%llu,%llu,%u,%llu,%u,memcpy\n", (unsigned long long)k->start, (unsigned long long)k->end, k->streamId, (unsigned long long)k->bytes, (unsigned)k->copyKind);
    }
  }
  free(b);
}
static void fin(void) { cuptiActivityFlushAll(1); fclose(out); }
int InitializeInjection(void) {
  out = fopen(getenv("TRACE_OUT"), "w");
  cuptiActivityRegisterCallbacks(req, done);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  if (getenv("TRACE_API")) cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER);
  atexit(fin);
  return 1;
}
