"""q / k / v handed over as Hugging Face attention modules hand them: [1, H, T, D] tensors
``.transpose(1, 2).reshape(T, H, D)``, non-contiguous views. Compiled with Inductor and the kvq
passes, the graph runs (the custom ops' fakes give the strides the kernels really return, so
Inductor's stride assertions hold) and matches eager. One small compile (CPU, reference kernel)."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.passes import (
    batch_plan,
    caches,
    fill_caches,
    make_batch,
    make_specs,
    no_compile_caches,
    pages_for,
    restore,
)
from torch_kvq.attention import Attention, ReferenceKernel, forward_context
from torch_kvq.passes import last_report, make_kvq_backend

HEADS, D = (8, 2), 32


class HFStyleLayers(nn.Module):
    """Attention layers fed heads-first [1, H, T, D] q / k / v: layer 0 gets views of the graph
    inputs, later layers views of a computed tensor (as after RoPE), so Inductor picks the layout."""

    def __init__(self, specs, num_pages: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Attention(s, num_pages) for s in specs)

    def forward(self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> list[torch.Tensor]:
        t = q4.shape[2]
        outs = []
        for i, attn in enumerate(self.layers):
            q, k, v = (x if i == 0 else x * 0.5 for x in (q4, k4, v4))
            q, k, v = (x.transpose(1, 2).reshape(t, x.shape[1], D) for x in (q, k, v))
            outs.append(attn(q, k, v).reshape(t, -1))
        return outs


def test_transposed_hf_views_compile_with_inductor_and_match_eager() -> None:
    specs = make_specs(2, "fp8", skip=(0,), heads=HEADS, head_size=D)
    plan = batch_plan(7)
    num_pages = pages_for(plan)
    model = HFStyleLayers(specs, num_pages)
    md = make_batch(plan, num_pages)
    fill_caches(model)
    start = caches(model)
    g = torch.Generator().manual_seed(3)
    q4, k4, v4 = (
        torch.randn(1, h, md.num_tokens, D, generator=g).bfloat16()
        for h in (HEADS[0], HEADS[1], HEADS[1])
    )
    assert not q4.transpose(1, 2).reshape(md.num_tokens, HEADS[0], D).is_contiguous()
    kernel = ReferenceKernel()
    with torch.no_grad():
        with forward_context(md, specs, kernel):
            eager = model(q4, k4, v4)
        eager_caches = caches(model)
        restore(model, start)
        compiled = torch.compile(model, backend=make_kvq_backend(inner="inductor"), fullgraph=True)
        with no_compile_caches(), forward_context(md, specs, kernel):
            out = compiled(q4, k4, v4)
    rep = last_report()
    assert rep.layers_fused("quant+write") == (specs[1].name,), rep.format()
    assert rep.layers_fused("dequant+attn") == (specs[1].name,), rep.format()
    # layer 0 (bf16 cache) is the same math; layer 1's fused attention reads the FP8 cache in
    # fp32 where eager dequantizes it to bf16 first
    torch.testing.assert_close(out[0], eager[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[1].float(), eager[1].float(), atol=2e-2, rtol=2e-2)
    for c, e in zip(caches(model), eager_caches):
        assert torch.equal(c.view(torch.uint8), e.view(torch.uint8))
