"""Does a bf16 GEMM give the same bits inside a CUDA graph as outside it?

The graph runner's map test compares an uncapturing and a capturing runner bit for bit; on an H100
its later modes part by one bf16 step in a few logits (docs/design/int4-branch.md, forty-eighth
and forty-ninth sessions). This takes the runner's capture recipe (two warm-ups on a side stream,
then ``torch.cuda.graph``) to a small projection + GELU + RMS + projection at 4 rows, eager and
compiled by Inductor (static; dynamic with a first call of 4 rows; dynamic with a first call of 29
rows, as a process's later modes compile), and prints per variant whether the replay equals an
uncaptured call and whether two uncaptured calls agree. GPU only.

    python3 scripts/capture_gemm_probe.py
"""

from __future__ import annotations

import torch


def _f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1), approximate="tanh")
    h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
    return torch.nn.functional.linear(h, w2).float()


def _captured(fn, x: torch.Tensor) -> torch.Tensor:
    """As ``DecodeGraphRunner._capture``: two warm-ups on a side stream, capture, one replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(512, 128, device="cuda", generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(512, 512, device="cuda", generator=g) * 0.1).bfloat16()
    x29 = torch.randn(29, 128, device="cuda", generator=g).bfloat16()
    x4 = torch.randn(4, 128, device="cuda", generator=g).bfloat16()

    def f(x: torch.Tensor) -> torch.Tensor:
        return _f(x, w1, w2)

    for name in ("eager", "static", "dynamic, first 4 rows", "dynamic, first 29 rows"):
        torch._dynamo.reset()
        fn = (
            f
            if name == "eager"
            else torch.compile(f, dynamic=name != "static", options={"deterministic": True})
        )
        if "29" in name:
            fn(x29)
        a = fn(x4).clone()
        b = _captured(fn, x4)
        c = fn(x4).clone()
        print(f"{name}: replay == uncaptured {torch.equal(a, b)} (max {(a - b).abs().max().item():.3g}); "
              f"uncaptured twice equal {torch.equal(a, c)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
