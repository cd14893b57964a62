/* The thread pool compiled TPP kernels run their parallel loops on (see runtime.py).
 *
 * TVM's generated code splits a parallel loop statically into `num_task` shares and calls
 * `TVMBackendParallelLaunch(lambda, cdata, num_task)`, which runs share k on thread k and
 * waits for all. When another process takes a core, the thread owning a share may not be
 * running, and every kernel then waits a scheduler tick for it. Here shares are *claimed*:
 * whichever thread comes first takes the next share, the calling thread included, so a
 * kernel never waits for a worker that has not started; it waits only for shares already
 * running. Idle workers spin briefly, then sleep on a futex. Where the workers keep losing
 * their cores mid-share, launches run on the calling thread alone for a while (below).
 *
 * One job is in flight at a time. A launch made while one runs (a second Python thread
 * calling a model) or from inside a share (nesting) runs its shares itself, serially.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

#define MAX_THREADS 256

/* The job: written by the launcher before it publishes `claim`, read by claimers. */
static _Atomic(FTVMParallelLambda) job_fn;
static _Atomic(void*) job_cdata;
static _Atomic int32_t job_num_task;
/* (generation << 32) | next share. A claimer that read the job's fields and then moves
 * `claim` from (g, k < num_task) to (g, k + 1) knows the fields were generation g's:
 * the launcher rewrites them only after every share of g has finished. */
static _Atomic uint64_t claim;
static _Atomic uint32_t generation; /* futex word the idle workers sleep on */
static _Atomic uint32_t done;       /* shares of the current job finished; the launcher's futex word */
static _Atomic int job_error;
static _Atomic int sleepers;
static _Atomic int launcher_waiting;
static _Atomic int busy; /* a launch is in flight */

static int pool_threads = 1;     /* threads a launch uses, the caller included */
static int started_workers = 0;
static int tasks_per_thread = 1; /* shares per thread a launch with num_task == 0 splits into */
static long spin_ns = 50000;     /* how long an idle thread spins before it sleeps */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int inside_share;
static __thread int caller_threads; /* this thread's own thread count (0: the pool's) */
static _Atomic int workers_paused;  /* tests: workers take no share while set */
static _Atomic long worker_delay_ns; /* tests: a worker is held up this long in each share */

/* Contention. A worker descheduled in the middle of a share holds the launch up until the
 * OS runs it again; the caller cannot take over a share already started. Workers measure
 * each share's wall time and their own CPU time in it: the difference is time the
 * scheduler took. When over a window of launches that exceeds a quarter of the workers'
 * share time, or in over a quarter of the launches no worker took a share though none was
 * asleep (a spinning worker claims within nanoseconds: they were not running), or the
 * caller ran over a third of the shares meant for the workers, in two windows in a row, another
 * process wants the cores: launches run on the calling thread alone for a while (20 ms,
 * doubling while it lasts, up to 1 s), then in parallel again to look. A quiet machine
 * does not get there: its workers lose microseconds of a share, and miss launches only
 * when they wake from sleep, which does not count. */
#define WINDOW 32
static _Atomic long long share_ns, lost_ns;
static int window_launches, window_missed, window_stolen, window_meant, bad_windows;
static _Atomic int running_workers; /* workers that have started running */
static _Atomic long solo_until_ns;
static long solo_period_ns = 20000000L;
static _Atomic long long solo_launches, solo_periods;
static _Atomic long long stolen;    /* shares the launching thread ran */
static _Atomic long long launches;

static long futex(_Atomic uint32_t* word, int op, uint32_t value) {
  return syscall(SYS_futex, (uint32_t*)word, op | FUTEX_PRIVATE_FLAG, value, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static long cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim and run shares of the current job until none is left; returns how many ran.
 * ``timed``: a worker's, which measures the time the scheduler took from each share. */
static int run_shares(int timed) {
  int ran = 0;
  uint64_t c = atomic_load_explicit(&claim, memory_order_acquire);
  for (;;) {
    FTVMParallelLambda fn = atomic_load_explicit(&job_fn, memory_order_relaxed);
    void* cdata = atomic_load_explicit(&job_cdata, memory_order_relaxed);
    TVMParallelGroupEnv env = {NULL, atomic_load_explicit(&job_num_task, memory_order_relaxed)};
    uint32_t next = (uint32_t)c;
    if ((int32_t)next >= env.num_task) return ran;
    if (!atomic_compare_exchange_weak_explicit(&claim, &c, c + 1, memory_order_acq_rel,
                                               memory_order_acquire))
      continue;
    inside_share = 1;
    long wall = timed ? now_ns() : 0, cpu = timed ? cpu_ns() : 0;
    long delay = atomic_load_explicit(&worker_delay_ns, memory_order_relaxed);
    if (timed && delay > 0) {
      struct timespec pause = {delay / 1000000000L, delay % 1000000000L};
      nanosleep(&pause, NULL);
    }
    int rc = fn((int)next, &env, cdata);
    if (timed) {
      wall = now_ns() - wall;
      cpu = cpu_ns() - cpu;
      atomic_fetch_add_explicit(&share_ns, wall, memory_order_relaxed);
      if (wall > cpu) atomic_fetch_add_explicit(&lost_ns, wall - cpu, memory_order_relaxed);
    }
    inside_share = 0;
    if (rc != 0) atomic_store(&job_error, rc);
    ++ran;
    if (atomic_fetch_add(&done, 1) + 1 == (uint32_t)env.num_task &&
        atomic_load(&launcher_waiting))
      futex(&done, FUTEX_WAKE, 1);
    c = atomic_load_explicit(&claim, memory_order_acquire);
  }
}

static void* worker_main(void* arg) {
  (void)arg;
  atomic_fetch_add(&running_workers, 1);
  uint32_t seen = atomic_load(&generation);
  for (;;) {
    long deadline = now_ns() + spin_ns;
    uint32_t g;
    for (int i = 0;; ++i) {
      g = atomic_load_explicit(&generation, memory_order_acquire);
      if (g != seen) break;
      if ((i & 63) == 63 && now_ns() > deadline) {
        atomic_fetch_add(&sleepers, 1);
        while ((g = atomic_load(&generation)) == seen) futex(&generation, FUTEX_WAIT, seen);
        atomic_fetch_sub(&sleepers, 1);
        break;
      }
      cpu_relax();
    }
    seen = g;
    while (atomic_load_explicit(&workers_paused, memory_order_relaxed)) usleep(1000);
    run_shares(1);
  }
  return NULL;
}

static void start_workers(int wanted) {
  pthread_mutex_lock(&start_lock);
  while (started_workers < wanted && started_workers < MAX_THREADS - 1) {
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&thread, &attr, worker_main, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) break;
    ++started_workers;
  }
  pthread_mutex_unlock(&start_lock);
}

static int run_serially(FTVMParallelLambda fn, void* cdata, int num_task) {
  TVMParallelGroupEnv env = {NULL, num_task};
  int saved = inside_share, rc = 0;
  inside_share = 1;
  for (int k = 0; k < num_task && rc == 0; ++k) rc = fn(k, &env, cdata);
  inside_share = saved;
  return rc == 0 ? 0 : -1;
}

int tpp_pool_launch(FTVMParallelLambda fn, void* cdata, int num_task) {
  int threads = caller_threads > 0 && caller_threads < pool_threads ? caller_threads
                                                                     : pool_threads;
  if (num_task <= 0) num_task = threads * tasks_per_thread;
  int expected = 0;
  if (threads <= 1 || num_task == 1 || inside_share)
    return run_serially(fn, cdata, num_task);
  if (now_ns() < atomic_load_explicit(&solo_until_ns, memory_order_relaxed)) {
    atomic_fetch_add_explicit(&solo_launches, 1, memory_order_relaxed);
    return run_serially(fn, cdata, num_task);
  }
  if (!atomic_compare_exchange_strong(&busy, &expected, 1))
    return run_serially(fn, cdata, num_task);
  if (started_workers < threads - 1) start_workers(threads - 1);
  atomic_fetch_add_explicit(&launches, 1, memory_order_relaxed);

  atomic_store_explicit(&job_fn, fn, memory_order_relaxed);
  atomic_store_explicit(&job_cdata, cdata, memory_order_relaxed);
  atomic_store_explicit(&job_num_task, num_task, memory_order_relaxed);
  atomic_store(&done, 0);
  atomic_store(&job_error, 0);
  uint32_t g = atomic_load(&generation) + 1;
  atomic_store_explicit(&claim, (uint64_t)g << 32, memory_order_release);
  atomic_store(&generation, g);
  int asleep = atomic_load(&sleepers);
  if (asleep > 0) futex(&generation, FUTEX_WAKE, asleep < num_task - 1 ? asleep : num_task - 1);

  int mine = run_shares(0);
  int theirs = num_task - num_task / threads;
  if (mine > num_task / threads)
    atomic_fetch_add_explicit(&stolen, mine - num_task / threads, memory_order_relaxed);
  if (atomic_load_explicit(&running_workers, memory_order_relaxed) >= threads - 1) {
    /* No worker asleep, yet none took a share before the caller had run them all:
     * spinning workers claim within nanoseconds, so they were not running. */
    if (asleep == 0 && mine == num_task) ++window_missed;
    window_meant += theirs;
    window_stolen += mine > num_task / threads ? mine - num_task / threads : 0;
  }
  /* Wait for the shares workers are running: spin, then sleep until the last one ends. */
  long deadline = now_ns() + spin_ns;
  uint32_t d;
  for (int i = 0; (d = atomic_load(&done)) < (uint32_t)num_task; ++i) {
    if ((i & 63) == 63 && now_ns() > deadline) {
      atomic_store(&launcher_waiting, 1);
      while ((d = atomic_load(&done)) < (uint32_t)num_task) futex(&done, FUTEX_WAIT, d);
      atomic_store(&launcher_waiting, 0);
      break;
    }
    cpu_relax();
  }
  int rc = atomic_load(&job_error);
  if (++window_launches == WINDOW) {
    long long worked = atomic_exchange(&share_ns, 0), lost = atomic_exchange(&lost_ns, 0);
    int bad = 4 * lost > worked || 4 * window_missed > WINDOW ||
              3 * window_stolen > window_meant;
    bad_windows = bad ? bad_windows + 1 : 0;
    if (bad_windows >= 2) { /* sustained, not a blip (a daemon, a page-cache flush) */
      bad_windows = 0;
      atomic_store(&solo_until_ns, now_ns() + solo_period_ns);
      atomic_fetch_add(&solo_periods, 1);
      if (solo_period_ns < 1000000000L) solo_period_ns *= 2;
    } else if (!bad) {
      solo_period_ns = 20000000L;
    }
    window_launches = window_missed = window_stolen = window_meant = 0;
  }
  atomic_store(&busy, 0);
  return rc == 0 ? 0 : -1;
}

/* Point every loaded kernel library's launch hook (the `__TVMBackendParallelLaunch` pointer
 * TVM's loader fills) at tpp_pool_launch. A library that also calls TVM's barrier keeps
 * TVM's pool: shares here are claimed, not one per thread, and a barrier among them could
 * wait forever. */
static int install_one(struct dl_phdr_info* info, size_t size, void* data) {
  (void)size;
  int* count = data;
  if (!info->dlpi_name || !info->dlpi_name[0]) return 0;
  void* handle = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
  if (!handle) return 0;
  void** hook = dlsym(handle, "__TVMBackendParallelLaunch");
  if (hook && *hook && *hook != (void*)&tpp_pool_launch &&
      !dlsym(handle, "__TVMBackendParallelBarrier")) {
    /* dlsym searches the library's dependencies too: take the hook only if it lies in this
     * library's own image. */
    Dl_info where;
    if (dladdr(hook, &where) && where.dli_fbase == (void*)info->dlpi_addr) {
      *hook = (void*)&tpp_pool_launch;
      ++*count;
    }
  }
  dlclose(handle);
  return 0;
}

int tpp_pool_install(void) {
  int count = 0;
  dl_iterate_phdr(install_one, &count);
  return count;
}

void tpp_pool_configure(int threads, int per_thread, long spin_us) {
  if (threads >= 1) pool_threads = threads < MAX_THREADS ? threads : MAX_THREADS;
  if (per_thread >= 1) tasks_per_thread = per_thread;
  if (spin_us >= 0) spin_ns = spin_us * 1000L;
}

int tpp_pool_threads(void) { return pool_threads; }
void tpp_pool_set_caller_threads(int threads) { caller_threads = threads; }
void tpp_pool_pause_workers(int paused) { atomic_store(&workers_paused, paused); }
void tpp_pool_delay_workers(long delay_us) { atomic_store(&worker_delay_ns, delay_us * 1000L); }
long long tpp_pool_solo_launches(void) { return atomic_load(&solo_launches); }
long long tpp_pool_solo_periods(void) { return atomic_load(&solo_periods); }
long long tpp_pool_stolen(void) { return atomic_load(&stolen); }
long long tpp_pool_launches(void) { return atomic_load(&launches); }
