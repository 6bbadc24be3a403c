"""The float32 FMA rate of this machine's cores: a C loop of independent vector FMAs.

Twelve independent accumulators (AVX-512, else AVX2) hide the FMA latency, so the loop runs at
the cores' issue rate: the ceiling any float32 matmul on these cores can reach. One process per
core (`threads` of them, inheriting the caller's CPU affinity) run at once; their rates add up.
Needs a C compiler (`cc`); returns None without one.

    python benchmarks/fma_rate.py [--threads 2] [--iters 50000000] [--repeats 3]

prints one JSON object: `gflops` (2 flops per FMA lane; null without a C compiler), the settings
and the CPUs the loops may run on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile

_SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
static float first(vec v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
static float first(vec v) { float out[8]; _mm256_storeu_ps(out, v); return out[0]; }
#endif
int main(int argc, char **argv) {
  long iters = atol(argv[1]);
  vec b = SET1(0.999999f), c = SET1(1e-7f), a[12];
  for (int i = 0; i < 12; i++) a[i] = SET1(1.0f + i);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long n = 0; n < iters; n++)
    for (int i = 0; i < 12; i++) a[i] = FMA(a[i], b, c);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  vec s = a[0];
  for (int i = 1; i < 12; i++) s = ADD(s, a[i]);
  double secs = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  printf("%.6f %.3f\n", 2.0 * 12 * LANES * iters / secs / 1e9, first(s));
  return 0;
}
"""


def fma_gflops(threads: int, iters: int = 50_000_000, repeats: int = 3) -> float | None:
  """Summed float32 GFLOP/s of `threads` concurrent FMA loops (best of `repeats`), or None."""
  cc = shutil.which("cc") or shutil.which("gcc")
  if cc is None:
    return None
  with tempfile.TemporaryDirectory() as tmp:
    src, exe = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma")
    with open(src, "w") as f:
      f.write(_SOURCE)
    if subprocess.run([cc, "-O2", "-march=native", src, "-o", exe], capture_output=True).returncode:
      return None
    best = 0.0
    for _ in range(repeats):
      procs = [subprocess.Popen([exe, str(iters)], stdout=subprocess.PIPE, text=True) for _ in range(threads)]
      best = max(best, sum(float(p.communicate()[0].split()[0]) for p in procs))
    return best


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--iters", type=int, default=50_000_000, help="loop iterations of each process")
  ap.add_argument("--repeats", type=int, default=3, help="the best of this many runs")
  args = ap.parse_args()
  gflops = fma_gflops(args.threads, args.iters, args.repeats)
  print(
      json.dumps(
          dict(
              gflops=gflops,
              threads=args.threads,
              iters=args.iters,
              repeats=args.repeats,
              cpus=sorted(os.sched_getaffinity(0)),
          )
      )
  )
