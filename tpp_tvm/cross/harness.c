/* Runs compiled TVM kernels from a shared library without the TVM runtime.
 *
 * usage: harness LIB.so JOB.bin OUT.bin
 *
 * JOB.bin (little-endian) holds the tensors and the calls:
 *   "TPPJOB01"
 *   u32 n_tensors; per tensor: u8 code, u8 bits, u16 lanes, u32 ndim, i64 shape[ndim],
 *                              u64 nbytes, bytes[nbytes]
 *   u32 n_calls;   per call:   u32 len, char name[len], u32 nargs, u32 tensor[nargs]
 * Each call looks up the packed-call symbol __tvm_ffi_<name> and calls it with DLTensor
 * arguments, in order (a model is a sequence of calls sharing tensors). OUT.bin receives
 * every tensor's bytes afterwards, in order, for the caller to compare with a reference.
 *
 * The library's calls into the TVM runtime go through function-pointer globals that TVM's
 * loader fills (__TVMBackendAllocWorkspace, ...); the harness fills them with its own
 * versions: workspaces are aligned malloc, parallel loops run their tasks one by one.
 * Every tensor sits between guard bytes; a kernel that writes outside its tensors fails
 * the run. stdout gets one line with the library's load address (to map traced addresses
 * to kernels). Exit status: 0 ok, 2 usage/IO, 3 missing symbol, 4 a kernel reported an
 * error, 5 a write outside a tensor.
 */
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tvm/ffi/c_api.h>

/* The one runtime entry point compiled kernels call: where they report an error. */
void TVMFFIErrorSetRaisedFromCStrParts(const char *kind, const char **parts, int32_t n) {
  fprintf(stderr, "kernel error %s:", kind ? kind : "");
  for (int32_t i = 0; i < n; ++i)
    if (parts[i]) fprintf(stderr, " %s", parts[i]);
  fputc('\n', stderr);
}

typedef struct {
  void *sync_handle;
  int32_t num_task;
} ParallelEnv;
typedef int (*ParallelLambda)(int task_id, ParallelEnv *env, void *cdata);

static void *alloc_workspace(int device_type, int device_id, uint64_t nbytes, int code, int bits) {
  (void)device_type, (void)device_id, (void)code, (void)bits;
  return aligned_alloc(64, (nbytes + 63) / 64 * 64 + 64);
}

static int free_workspace(int device_type, int device_id, void *ptr) {
  (void)device_type, (void)device_id;
  free(ptr);
  return 0;
}

static int parallel_launch(ParallelLambda lambda, void *cdata, int num_task) {
  ParallelEnv env = {NULL, num_task > 0 ? num_task : 1};
  for (int t = 0; t < env.num_task; ++t)
    if (lambda(t, &env, cdata) != 0) return -1;
  return 0;
}

static int parallel_barrier(int task_id, ParallelEnv *env) {
  (void)task_id, (void)env;
  return 0;
}

/* Point the library's runtime hooks (those it has) at the functions above. */
static void bind_runtime(void *lib) {
  const struct {
    const char *name;
    void *fn;
  } hooks[] = {
      {"__TVMBackendAllocWorkspace", (void *)alloc_workspace},
      {"__TVMBackendFreeWorkspace", (void *)free_workspace},
      {"__TVMBackendParallelLaunch", (void *)parallel_launch},
      {"__TVMBackendParallelBarrier", (void *)parallel_barrier},
  };
  for (size_t i = 0; i < sizeof hooks / sizeof hooks[0]; ++i) {
    void **slot = (void **)dlsym(lib, hooks[i].name);
    if (slot) *slot = hooks[i].fn;
  }
}

#define GUARD 64
#define GUARD_BYTE 0xA5

/* A tensor's bytes with GUARD bytes before and at least GUARD after (64-byte aligned). */
static void *alloc_guarded(uint64_t nbytes) {
  uint64_t padded = (nbytes + GUARD - 1) / GUARD * GUARD + GUARD;
  unsigned char *block = aligned_alloc(64, GUARD + padded);
  if (!block) exit(2);
  memset(block, GUARD_BYTE, GUARD + padded);
  return block + GUARD;
}

static int guards_intact(const unsigned char *data, uint64_t nbytes) {
  uint64_t padded = (nbytes + GUARD - 1) / GUARD * GUARD + GUARD;
  for (uint64_t i = 1; i <= GUARD; ++i)
    if (data[-(int64_t)i] != GUARD_BYTE) return 0;
  for (uint64_t i = nbytes; i < padded; ++i)
    if (data[i] != GUARD_BYTE) return 0;
  return 1;
}

static FILE *job;

static void read_exact(void *dst, size_t n) {
  if (n && fread(dst, 1, n, job) != n) {
    fprintf(stderr, "harness: truncated job file\n");
    exit(2);
  }
}

static uint32_t read_u32(void) {
  uint32_t v;
  read_exact(&v, sizeof v);
  return v;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s LIB.so JOB.bin OUT.bin\n", argv[0]);
    return 2;
  }
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "harness: %s\n", dlerror());
    return 2;
  }
  struct link_map *map = NULL;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map)
    printf("harness: %s loaded at 0x%lx\n", argv[1], (unsigned long)map->l_addr);
  fflush(stdout);
  bind_runtime(lib);
  job = fopen(argv[2], "rb");
  char magic[8];
  if (!job) {
    perror(argv[2]);
    return 2;
  }
  read_exact(magic, sizeof magic);
  if (memcmp(magic, "TPPJOB01", 8) != 0) {
    fprintf(stderr, "harness: %s is not a job file\n", argv[2]);
    return 2;
  }
  uint32_t n_tensors = read_u32();
  DLTensor *tensors = calloc(n_tensors, sizeof *tensors);
  uint64_t *sizes = calloc(n_tensors, sizeof *sizes);
  for (uint32_t t = 0; t < n_tensors; ++t) {
    DLTensor *x = &tensors[t];
    read_exact(&x->dtype.code, 1);
    read_exact(&x->dtype.bits, 1);
    read_exact(&x->dtype.lanes, 2);
    x->ndim = (int32_t)read_u32();
    x->shape = calloc(x->ndim ? x->ndim : 1, sizeof(int64_t));
    read_exact(x->shape, sizeof(int64_t) * x->ndim);
    read_exact(&sizes[t], sizeof sizes[t]);
    x->data = alloc_guarded(sizes[t]);
    read_exact(x->data, sizes[t]);
    x->device.device_type = kDLCPU;
  }
  uint32_t n_calls = read_u32();
  for (uint32_t c = 0; c < n_calls; ++c) {
    uint32_t len = read_u32();
    char sym[512] = "__tvm_ffi_";
    size_t prefix = strlen(sym);
    if (len + prefix >= sizeof sym) return 2;
    read_exact(sym + prefix, len);
    sym[prefix + len] = '\0';
    uint32_t nargs = read_u32();
    TVMFFIAny *args = calloc(nargs ? nargs : 1, sizeof *args);
    for (uint32_t a = 0; a < nargs; ++a) {
      uint32_t id = read_u32();
      if (id >= n_tensors) return 2;
      args[a].type_index = kTVMFFIDLTensorPtr;
      args[a].v_ptr = &tensors[id];
    }
    TVMFFISafeCallType fn = (TVMFFISafeCallType)dlsym(lib, sym);
    if (!fn) {
      fprintf(stderr, "harness: no symbol %s in %s\n", sym, argv[1]);
      return 3;
    }
    TVMFFIAny result = {.type_index = kTVMFFINone};
    if (fn(NULL, args, (int32_t)nargs, &result) != 0) {
      fprintf(stderr, "harness: call %u (%s) failed\n", c, sym);
      return 4;
    }
    free(args);
  }
  for (uint32_t t = 0; t < n_tensors; ++t)
    if (!guards_intact(tensors[t].data, sizes[t])) {
      fprintf(stderr, "harness: a kernel wrote outside tensor %u\n", t);
      return 5;
    }
  FILE *out = fopen(argv[3], "wb");
  if (!out) {
    perror(argv[3]);
    return 2;
  }
  for (uint32_t t = 0; t < n_tensors; ++t)
    if (fwrite(tensors[t].data, 1, sizes[t], out) != sizes[t]) return 2;
  return fclose(out) == 0 ? 0 : 2;
}
