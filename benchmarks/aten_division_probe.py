"""How aten divides a CUDA tensor by a Python float, against five candidate forms (see
benchmarks/results/h200_2026-11-30_aten_division_probe.txt). GPU only: ``python3 benchmarks/aten_division_probe.py``."""

import torch

print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
g = torch.Generator().manual_seed(0)
x = torch.cat(
    [
        torch.tensor([169.0, 1.5, -3.0, 48.0, 0.09375, 1.0, 3.0]),
        torch.randn(1 << 20, generator=g) * 40,
    ]
)
xb = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
xb = xb[torch.isfinite(xb)]


def f32(v):
    return float(torch.tensor(v, dtype=torch.float32))


for name, xs in (("randn", x), ("allbf16", xb)):
    for s in (13.0, 0.03, 0.0341, 0.3, 1 / 3, 7.7e-3, 123.456, 0.02, 0.37, 0.1, 3.0):
        got = (xs.cuda() / s).cpu()
        x64 = xs.double()
        cands = {
            "div32": (x64 / f32(s)).float(),
            "rcp32": (
                x64 * float((torch.tensor(1.0, dtype=torch.float64) / f32(s)).float())
            ).float(),
            "div64": (x64 / s).float(),
            "mul64": (x64 * (1.0 / s)).float(),
            "rcp64": (x64 * f32(1.0 / s)).float(),
        }
        res = {
            k: int((got.view(torch.int32) != v.view(torch.int32)).sum()) for k, v in cands.items()
        }
        # and tensor/tensor on cuda for reference
        tt = (xs.cuda() / torch.tensor(s, dtype=torch.float32, device="cuda")).cpu()
        res["cuda_t/t_vs_div32"] = int(
            (tt.view(torch.int32) != cands["div32"].view(torch.int32)).sum()
        )
        print(name, s, "mismatches:", res, "n", xs.numel())
    # first few mismatching values for 0.03
s = 0.03
got = (x.cuda() / s).cpu()
c = (x.double() / f32(s)).float()
d = got != c
print("examples x, got, div32:", x[d][:5].tolist(), got[d][:5].tolist(), c[d][:5].tolist())
