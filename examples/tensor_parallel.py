"""Tensor parallelism: one model split over N processes, each holding N-th of every layer's KV heads.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py --device cpu     # gloo, 2 CPU ranks
    torchrun --nproc-per-node 2 examples/tensor_parallel.py --device cuda    # NCCL, 2 GPUs
    python examples/tensor_parallel.py [--tp 2]    # starts torchrun itself (CPU)

Every rank builds the same Llama-style model (random weights from one seed) with ``tp=``: q/k/v
and gate/up column-parallel, o_proj and down_proj row-parallel with an all-reduce, embeddings and
LM head replicated; FP8 KV cache, first and last layers kept in the model dtype. The specs are
resolved from the global config on every rank (and checked equal across ranks); only the head
counts differ. The step is compiled with the kvq passes; rank 0 prints what each rank holds, the
pass report, and checks the logits against the same model run whole in one process.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from torch_kvq.distributed import gather, init_tensor_parallel, relaunch, under_torchrun
from torch_kvq.models import build_model, generate
from torch_kvq.spec import KVCacheConfig
from torch_kvq.spec_table import format_spec_table

PROMPTS = [[5, 9, 14, 3, 7, 2, 11], [8, 2, 4], [19, 3, 3, 27]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tp", type=int, default=2, help="ranks to start when not run by torchrun")
    ap.add_argument("--preset", choices=("llama-tiny", "gemma3-tiny"), default="llama-tiny")
    ap.add_argument("--new-tokens", type=int, default=4)
    args = ap.parse_args()
    if not under_torchrun():  # plain `python examples/tensor_parallel.py`: start the ranks
        print(f"starting {args.tp} ranks with torchrun --standalone ...", flush=True)
        return relaunch(args.tp, [__file__, *sys.argv[1:]])

    tp = init_tensor_parallel(device=args.device)
    cuda = args.device == "cuda"

    def kernel():  # one per model; FlashInfer on the GPU (head size 128: it serves 64/128/256)
        from torch_kvq.attention.kernels import FlashInferKernel, ReferenceKernel

        return FlashInferKernel() if cuda else ReferenceKernel()

    kv = KVCacheConfig("fp8", skip_layers=(0, -1), page_size=16, default_k_scale=0.05,
                       default_v_scale=0.05)  # fmt: skip
    build = dict(num_pages=32, dtype=torch.bfloat16 if cuda else torch.float32,
                 device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")  # fmt: skip
    if cuda:
        build |= dict(
            head_dim=128, **({"query_pre_attn_scalar": 128} if "gemma" in args.preset else {})
        )
    model = build_model(args.preset, kv, seed=0, tp=tp, kernel=kernel(), **build)
    from torch_kvq.passes import last_report, make_kvq_backend

    backend = make_kvq_backend(inner="inductor" if cuda else "eager")  # eager: a quick CPU compile
    out = generate(model, PROMPTS, args.new_tokens, forward=torch.compile(model, backend=backend))
    fused = sorted(last_report().layers_fused("quant+write"))
    seen = gather(tp, (tp.rank, model.kv_specs[1].num_kv_heads, fused))
    if tp.rank == 0:
        whole = build_model(args.preset, kv, seed=0, prefix="whole", kernel=kernel(), **build)
        ref = generate(whole, PROMPTS, args.new_tokens, force_tokens=out.tokens)
        diff = (ref.logits - out.logits).abs().max().item()
        print(f"{tp.size} ranks ({torch.distributed.get_backend()}), preset {args.preset}, "
              f"{model.config.num_kv_heads} KV heads per layer in all")  # fmt: skip
        print(format_spec_table(model.kv_specs))
        for rank, heads, layers in seen:
            print(f"rank {rank}: {heads} KV heads of every layer's cache; fused quant+write on "
                  f"{len(layers)} layers {layers}")  # fmt: skip
        same = all(layers == seen[0][2] for _, _, layers in seen)
        print(f"every rank fused the same layers: {same}")
        print(f"tokens {out.tokens}")
        print(f"max |logit diff| vs the whole model in one process: {diff:.2e}")
        # fp32 on the CPU: the same tokens; bf16 on the GPU may flip a near-tie
        if not same or (not cuda and out.tokens != ref.logits.argmax(-1).tolist()):
            return 1
    torch.distributed.barrier()  # leave together: a rank that exited while rank 0 still worked
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    if under_torchrun():
        # A rank leaves without the interpreter's teardown: three CPU suite runs (2026-12-03 to
        # -07, docs/performance.md) saw a rank abort after this point, after correct results
        # ("terminate called without an active exception": a C++ thread still joinable when
        # its static destructor ran).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
