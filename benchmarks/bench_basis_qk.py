"""A tc4 layer's K-basis products (P k and P^-T q) on one GPU: ``k_basis.basis_qk``'s einsums
with fp32 products (fp32 P: the form before the thirty-second session) and in the 16-bit form
(``k_basis.basis_operand``'s pair, built once: P as two matrices of the model's dtype, one
product of twice the length), against ``kvq.basis_qk`` (the layer's op since the thirty-third
session: one Triton launch for both, the pair without ``cat(x, x)``). Llama-3.1-8B's layer (QH 32, KH 8, D 128), bf16 q and
k, at a decode batch of 32 tokens and one 16k-token prompt; median ms per call of a CUDA graph
of ``--calls`` calls over ``--rounds`` replays, both through ``torch.compile`` as the layer runs
them.

    python benchmarks/bench_basis_qk.py [--tokens 32 16384]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from bench_kv_write import graph_ms
    from gpu_common import environment

    import torch_kvq.attention.ops_tc  # noqa: F401  (registers kvq.basis_qk)
    from torch_kvq.attention.k_basis import basis_operand, basis_qk, inverse_transpose

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 16384])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(environment())
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.linalg.qr(torch.randn(8, 128, 128, device="cuda", generator=g))[0]
    p_inv_t = inverse_transpose(p)
    # basis_qk's two forms by the matrices it is given (fp32 P: fp32 products), built once
    mats = {
        "fp32": (p, p_inv_t),
        "16-bit": [basis_operand(m, torch.bfloat16) for m in (p, p_inv_t)],
    }
    forms = {  # (name, the matrices, the function)
        "einsum fp32": (mats["fp32"], torch.compile(basis_qk)),
        "einsum 16-bit": (mats["16-bit"], torch.compile(basis_qk)),
        "kvq.basis_qk 16-bit": (mats["16-bit"], torch.compile(torch.ops.kvq.basis_qk)),
    }
    for t in args.tokens:
        q = torch.randn(t, 32, 128, device="cuda", generator=g).bfloat16()
        k = torch.randn(t, 8, 128, device="cuda", generator=g).bfloat16()
        for name, (m, fn) in forms.items():
            call = lambda q=q, k=k, m=m, fn=fn: fn(q, k, *m)  # noqa: E731
            ms = statistics.median(graph_ms(call, args.calls, args.rounds))
            print(f"basis_qk tokens {t} {name}: {ms:.4f} ms")


if __name__ == "__main__":
    main()
