"""The CPU's own ceilings for the int8 and float32 tiles: how many `vpdpbusd` (VNNI, 64 int8
multiply-adds at 512 bits) and float32 FMAs a core retires per nanosecond, every core busy at
once, so a kernel's rate can be read against a measured roofline, not a port table.

Each row is a loop of independent chains (an instruction's latency hidden behind the others),
compiled here with `cc -O2 -march=native` and run on every core at once (OpenMP, one thread a
core); the figure is the slowest core's. Rows:
  - 12 chains, register operands: the instruction's issue rate (Golden Cove: two 512-bit
    VNNI or FMA ports; the clock is whatever the cores run at under that load);
  - 6 chains: what a tile with 6 accumulators (6 tokens) can reach, latency-bound;
  - 12 chains, one operand a 4-byte broadcast from memory per instruction: the int8 tiles' shape
    (a token's 4 activations against 16 rows' codes).
Then a memory-read loop for the DRAM roofline (`read_bandwidth.py` has the finer one).

    python benchmarks/cpu_peak.py [--seconds 0.5]

x86-64 with AVX-512 VNNI only (prints why not otherwise).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int32_t xs[8][256] __attribute__((aligned(64)));
static volatile long sink;

#define BAR12 __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), \
                                    "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11))
#define ALL12(OP) OP(a0, 0); OP(a1, 1); OP(a2, 2); OP(a3, 3); OP(a4, 4); OP(a5, 5); \
                  OP(a6, 6); OP(a7, 7); OP(a8, 8); OP(a9, 9); OP(a10, 10); OP(a11, 11)
#define ALL6(OP) OP(a0, 0); OP(a1, 1); OP(a2, 2); OP(a3, 3); OP(a4, 4); OP(a5, 5)

/* ns per instruction of `ops` instructions a pass, `passes` passes. */
#define LOOP(NAME, T, INIT, BODY, OPS)                                                  \
    static double NAME(long passes) {                                                   \
        T a0 = INIT, a1 = INIT, a2 = INIT, a3 = INIT, a4 = INIT, a5 = INIT, a6 = INIT,  \
          a7 = INIT, a8 = INIT, a9 = INIT, a10 = INIT, a11 = INIT;                      \
        const __m512i w = _mm512_set1_epi8(3), v = _mm512_set1_epi8(5);                 \
        const __m512 s = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);            \
        (void)w, (void)v, (void)s, (void)b;                                             \
        const double t0 = now();                                                        \
        for (long i = 0; i < passes; i++) {                                             \
            const int32_t *x = xs[i & 7];                                               \
            (void)x;                                                                    \
            BODY;                                                                       \
            BAR12;                                                                      \
        }                                                                               \
        const double t = now() - t0;                                                    \
        char tmp[64];                                                                   \
        memcpy(tmp, &a0, sizeof tmp < sizeof a0 ? sizeof tmp : sizeof a0);              \
        sink += tmp[0];                                                                 \
        return t / passes / (OPS) * 1e9;                                                \
    }

#define DP(a, i) a = _mm512_dpbusd_epi32(a, w, v)
#define DPM(a, i) a = _mm512_dpbusd_epi32(a, w, _mm512_set1_epi32(x[i]))
#define DPN(a, i) a = _mm512_dpbusd_epi32(a, w, _mm512_set1_epi32(x[16 + (i)]))
#define FMA(a, i) a = _mm512_fmadd_ps(a, s, b)
LOOP(dp12, __m512i, _mm512_setzero_si512(), ALL12(DP); ALL12(DP), 24)
LOOP(dp6, __m512i, _mm512_setzero_si512(), ALL6(DP); ALL6(DP); ALL6(DP); ALL6(DP), 24)
LOOP(dp12m, __m512i, _mm512_setzero_si512(), ALL12(DPM); ALL12(DPN), 24)
LOOP(fma12, __m512, _mm512_set1_ps(1.0f), ALL12(FMA); ALL12(FMA), 24)
LOOP(fma6, __m512, _mm512_set1_ps(1.0f), ALL6(FMA); ALL6(FMA); ALL6(FMA); ALL6(FMA), 24)

static double read_gbs(size_t bytes) {
    char *p = aligned_alloc(1 << 21, bytes);
    memset(p, 1, bytes);
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        const double t0 = now();
        long total = 0;
#pragma omp parallel reduction(+ : total)
        {
            const size_t share = bytes / omp_get_num_threads(), from = share * omp_get_thread_num();
            __m512i a = _mm512_setzero_si512(), b = a;
            for (size_t i = from; i + 256 <= from + share; i += 256) {
                a = _mm512_add_epi64(a, _mm512_load_si512(p + i));
                b = _mm512_add_epi64(b, _mm512_load_si512(p + i + 64));
                a = _mm512_add_epi64(a, _mm512_load_si512(p + i + 128));
                b = _mm512_add_epi64(b, _mm512_load_si512(p + i + 192));
            }
            total += _mm512_reduce_add_epi64(_mm512_add_epi64(a, b));
        }
        sink += total;
        const double t = now() - t0;
        if (t < best) best = t;
    }
    free(p);
    return bytes / best / 1e9;
}

int main(int argc, char **argv) {
    const double seconds = argc > 1 ? atof(argv[1]) : 0.5;
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < 256; i++) xs[r][i] = (r * 256 + i) * 77;
    struct { const char *name; double (*fn)(long); double macs; } rows[] = {
        {"vpdpbusd zmm, 12 chains, registers", dp12, 64},
        {"vpdpbusd zmm, 6 chains, registers", dp6, 64},
        {"vpdpbusd zmm, 12 chains, broadcast from memory", dp12m, 64},
        {"vfmadd zmm fp32, 12 chains, registers", fma12, 16},
        {"vfmadd zmm fp32, 6 chains, registers", fma6, 16},
    };
    const int cores = omp_get_max_threads();
    for (unsigned r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        const double calib = rows[r].fn(100000); /* ns an instruction, roughly */
        const long passes = (long)(seconds / (calib * 24e-9)) + 1;
        double worst = 0;
#pragma omp parallel reduction(max : worst)
        worst = rows[r].fn(passes);
        printf("%s|%.3f|%.2f|%.0f\n", rows[r].name, worst, 1.0 / worst,
               rows[r].macs / worst * cores);
    }
    printf("read 1 GiB, every core|%.1f\n", read_gbs((size_t)1 << 30));
    return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="per row")
    args = parser.parse_args()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_vnni" not in flags or "avx512bw" not in flags:
        print("cpu_peak.py measures AVX-512 VNNI and FMA loops: this CPU has no AVX-512 VNNI")
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(SOURCE)
        build = ["cc", "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)]
        subprocess.run(build, check=True)
        run = [str(exe), str(args.seconds)]
        out = subprocess.run(run, capture_output=True, text=True, check=True)
    cores = os.cpu_count()
    load = os.getloadavg()
    print(f"{cores} cores, every one running the loop; load average {load[0]:.1f} {load[1]:.1f}")
    print()
    print("| loop | ns an instruction (slowest core) | per ns a core | G MAC/s, all cores |")
    print("|---|---:|---:|---:|")
    lines = out.stdout.strip().splitlines()
    for line in lines[:-1]:
        name, ns, per_ns, gmacs = line.split("|")
        print(f"| {name} | {ns} | {per_ns} | {gmacs} |")
    name, gbs = lines[-1].split("|")
    print()
    print(f"{name}: {gbs} GB/s")
    print()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
