/* LD_PRELOAD shim for the llama.cpp peer benchmark: refuse the AMX tile permission.
 *
 * Why: some cloud Intel Xeons advertise AMX in CPUID but fault on its tile
 * instructions (llama-bench dies with SIGSEGV/SIGILL, exit 139). ggml asks the
 * kernel for the permission first, syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA), and falls back to its AVX-512/AVX2 kernels when that
 * fails; this shim makes exactly that request fail (EPERM) and forwards every
 * other call untouched. On a CPU without AMX (e.g. AMD EPYC) ggml never makes the
 * request, so the shim changes nothing there.
 *
 * Built by scripts/build_llama_cpp.sh:  cc -O2 -shared -fPIC -o noamx.so llama_cpp_noamx.c -ldl
 * Used as:  LD_PRELOAD=noamx.so OMP_WAIT_POLICY=passive llama-bench ...
 * Set PICOMPILE_NOAMX_VERBOSE=1 to print one line to stderr when a request is refused.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NOAMX_ARCH_REQ_XCOMP_PERM 0x1023

static int refuse(long code) {
    if (code != NOAMX_ARCH_REQ_XCOMP_PERM) return 0;
    const char *v = getenv("PICOMPILE_NOAMX_VERBOSE");
    if (v && *v && *v != '0') fprintf(stderr, "noamx: refused arch_prctl(ARCH_REQ_XCOMP_PERM)\n");
    errno = EPERM;
    return 1;
}

long syscall(long number, ...) {
    va_list ap;
    long a[6];
    va_start(ap, number);
    for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);  /* syscalls take at most 6 words */
    va_end(ap);
#ifdef SYS_arch_prctl
    if (number == SYS_arch_prctl && refuse(a[0])) return -1;
#endif
    static long (*real)(long, ...) = NULL;
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}

/* glibc >= 2.35 also exports arch_prctl(); cover callers that use it directly. */
int arch_prctl(int code, unsigned long addr) {
    if (refuse(code)) return -1;
#ifdef SYS_arch_prctl
    return (int)syscall(SYS_arch_prctl, (long)code, (long)addr);
#else
    errno = ENOSYS;
    return -1;
#endif
}
