"""The tables scripts/bench_kernels.py prints: decode (us and TB/s per backend) and prefill (us and TFLOP/s)."""
from __future__ import annotations


def us(x):
    return f"{x * 1e6:9.1f}" if x else "      n/a"


DECODE_COLUMNS = (("xla", "XLA"), ("pallas", "Pallas"), ("pallas_qkv", "engine"), ("cudnn", "cuDNN"),
                  ("triton", "Triton"), ("triton_jt", "Triton jt"), ("mosaic", "Mosaic"))
PREFILL_COLUMNS = (("xla", "XLA"), ("pallas", "Pallas"), ("cudnn", "cuDNN"), ("triton", "Triton"),
                   ("mosaic", "Mosaic"), ("cudnn_dense", "cuDNN dense"))


def print_decode(rows):
    print("\nDecode (paged, page 16): time in us, then TB/s = K+V bytes needed / time; 'engine' = the engine's "
          "Pallas kernel (paged_attention_qkv: + q/k norm, rope and the K/V write); 'Triton jt' = the Triton kernel "
          "through jax-triton's triton_call; fp8: the Pallas kernels on fp8 pages, TB/s = bytes actually read")
    names = [c for c, _ in DECODE_COLUMNS if any(r.get(c + "_s") for r in rows)]
    labels = dict(DECODE_COLUMNS)
    plain = any(r.get("fp8_qkv_plain_s") for r in rows)          # (only when named in --impls)
    print(f"{'B':>4} {'ctx':>5} | " + " ".join(f"{labels[c]:>9}" for c in names) + " | "
          + " ".join(f"{labels[c][:6]:>6}" for c in names) + f" | {'%copy':>5} | {'fp8':>9} {'fp8 eng':>9}"
          + (f" {'eng plain':>9}" if plain else ""))
    for r in rows:
        print(f"{r['batch']:>4} {r['ctx']:>5} | " + " ".join(us(r.get(c + "_s")) for c in names) + " | "
              + " ".join(f"{r.get(c + '_tbps') or 0:6.2f}" for c in names)
              + f" | {r.get('pct_copy_bw', 0):4.0f}% | {us(r.get('fp8_s'))} {us(r.get('fp8_qkv_s'))}"
              + (f" {us(r.get('fp8_qkv_plain_s'))}" if plain else ""))


def print_prefill(rows):
    print("\nPrefill (causal varlen over the paged cache): time in us, then TFLOP/s (visible scores only); "
          "'Triton' = the raw Triton prefill kernel (pallas_kernels/triton_prefill.py); 'cuDNN dense' = contiguous "
          "equal-length inputs, no pages (uniform cases only)")
    names = [c for c, _ in PREFILL_COLUMNS if any(r.get(c + "_s") for r in rows)]
    labels = dict(PREFILL_COLUMNS)
    print(f"{'case':>14} {'tokens':>6} | " + " ".join(f"{labels[c]:>11}" for c in names) + " | "
          + " ".join(f"{labels[c][:7]:>7}" for c in names) + f" | {'%mm':>5}")
    for r in rows:
        print(f"{r['case']:>14} {r['tokens']:>6} | " + " ".join(f"{us(r.get(c + '_s')):>11}" for c in names)
              + " | " + " ".join(f"{r.get(c + '_tflops') or 0:7.1f}" for c in names)
              + f" | {r.get('pct_matmul_peak', 0):4.0f}%")
