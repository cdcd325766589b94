"""How cheap a wider verification pass of the 4-bit target could be on this CPU: the byte multiply-adds' own floor.

Our int4 kernel multiplies weight bytes by activation bytes (8 bits per block of 32, as llama.cpp does). Without
VNNI, each 32 of those products is one AVX2 ``vpmaddubsw`` (and an add of its 16-bit sums). A token more in a pass
adds every linear layer's products once more, so it costs at least

    (multiply-adds a token) / 32 / (vpmaddubsw a second on all threads),

whatever the kernel does around them, unless that work hides under the pass's memory traffic. This script measures
that peak with a loop of independent ``vpmaddubsw`` + ``vpaddw`` (built with the machine's C compiler), counts the
embedded target's multiply-adds a token from its layers, times the target's one-token and wider passes
(``tuning.measure_target``), and prints each width's measured cost beside that floor.

Usage: python benchmarks/floor_products.py [--threads 2] [--widths 1,2,4,6,8]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fuzzyspec.api import ModelPair
from fuzzyspec.tuning import machine, measure_target

# Eight independent sums, so the loop is bound by how many multiply-adds issue a cycle, not by their latency; the
# empty asm makes the operands opaque each time round, so the compiler cannot hoist the products out of the loop.
PEAK_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
__attribute__((noinline)) int run(long n, int seed) {
  __m256i w0 = _mm256_set1_epi8(3 + seed), w1 = _mm256_set1_epi8(2);
  __m256i a0 = _mm256_set1_epi8(5), a1 = _mm256_set1_epi8(-4);
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  for (long i = 0; i < n; ++i) {
    __asm__ volatile("" : "+x"(w0), "+x"(w1), "+x"(a0), "+x"(a1));
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w0, a0)); s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w1, a0));
    s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(w0, a1)); s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(w1, a1));
    s4 = _mm256_add_epi16(s4, _mm256_maddubs_epi16(a0, w0)); s5 = _mm256_add_epi16(s5, _mm256_maddubs_epi16(a0, w1));
    s6 = _mm256_add_epi16(s6, _mm256_maddubs_epi16(a1, w0)); s7 = _mm256_add_epi16(s7, _mm256_maddubs_epi16(a1, w1));
  }
  __m256i t = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(s0, s1), _mm256_add_epi16(s2, s3)),
                               _mm256_add_epi16(_mm256_add_epi16(s4, s5), _mm256_add_epi16(s6, s7)));
  return _mm256_extract_epi16(t, 0);
}
int main(void) {
  long n = 50000000L; double best = 0; long long sink = 0;
  for (int round = 0; round < 7; ++round) {
    double start = omp_get_wtime();
#pragma omp parallel reduction(+:sink)
    sink += run(n, omp_get_thread_num());
    double rate = 8.0 * n * omp_get_max_threads() / (omp_get_wtime() - start);
    if (rate > best) best = rate;
  }
  printf("%.6g %lld\n", best, sink);
  return 0;
}
"""


def peak_rate(threads: int) -> float:
    """``vpmaddubsw`` a second on ``threads`` threads: the best of seven rounds of the loop above."""
    with tempfile.TemporaryDirectory() as folder:
        source, program = Path(folder) / "peak.c", Path(folder) / "peak"
        source.write_text(PEAK_C)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-mavx2", "-fopenmp", str(source), "-o", str(program)],
                       check=True)
        done = subprocess.run([str(program)], capture_output=True, text=True, check=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return float(done.stdout.split()[0])


def multiply_adds(config) -> int:
    """A token's multiply-adds in a Llama's linear layers and LM head (all byte products in the embedded target: its
    layers Q4_1, its head Q8_0), from its config (the model holds its fused projections beside the separate ones)."""
    hidden, layers, head_dim = config.hidden_size, config.num_hidden_layers, config.head_dim
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)  # q, k, v, o
    return layers * (attention + 3 * hidden * config.intermediate_size) + config.vocab_size * hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--widths", default="1,2,4,6,8")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    if widths[0] != 1:
        raise SystemExit("--widths must begin with 1 (the one-token pass the others are set beside)")
    rate = peak_rate(args.threads)
    pair = ModelPair.load(draft=None)
    per_token = multiply_adds(pair.target.config)
    floor_ms = 1000 * per_token / 32 / rate
    measured, _ = measure_target(pair.step, widths, rounds=args.rounds)
    print(f"fuzzyspec floor_products: {machine()}; {args.threads} threads; {time.strftime('%Y-%m-%d')}")
    print(f"  vpmaddubsw (+ vpaddw) peak: {rate:.3g} a second; the embedded target's byte products: "
          f"{per_token / 1e6:.1f} M multiply-adds a token")
    print(f"  floor of a token more in a pass: {floor_ms:.3f} ms (its products alone, at that peak)")
    print("  width  measured (ms)  x one token  a token more (ms)  x floor  floor of the ratio (nothing hidden)")
    one = measured[1]
    for width in widths:
        extra = (measured[width] - one) / (width - 1) if width > 1 else float("nan")
        print(f"  {width:5d}  {measured[width]:13.2f}  {measured[width] / one:11.2f}  {extra:17.3f}  "
              f"{extra / floor_ms:7.2f}  {(one + (width - 1) * floor_ms) / one:.2f}")


if __name__ == "__main__":
    main()
