"""bench_model_decode's kernel kinds (names as torch.profiler reported them on the H200) and the
kernel-time bound it derives from them."""

from __future__ import annotations

import pytest
from bench_model_decode import kernel_gaps, kernel_kind, kernel_time_bound  # noqa: E402

NAMES = {
    "kernel_mha(unsigned int, float, float const*, Vec<__nv_bfloat16, 128u>*, Vec<__n": "attention_fp8_kv",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<(fl, __nv_fp8_e4m3": "attention_fp8_kv",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<(fl": "attention_bf16_kv",
    "void flashinfer::MergeStatesKernel<8u, 16u, 8u, 4u, __nv_bfloat16>": "attention_bf16_kv",
    "nvjet_sm90_tst_64x32_64x16_4x1_v_bz_splitK_TNT": "gemm",
    "_decode_pages": "attention_fp8_kv",  # our Triton kernel: the split grid
    "_decode_balanced": "attention_fp8_kv",  # the balanced schedule (run 43 counted it "other")
    "_combine_balanced": "attention_fp8_kv",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<a": "other",
    "triton_red_fused_add_mean_mul_pow_rsqrt_0": "other",
    "kv_write_tc_kernel": "kv_write",  # the quantized layers' cache writes (before: "other")
    "kv_write_int4_kernel": "kv_write",
    "basis_qk_kernel": "other",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_reduce",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NAMES))
def test_kernel_kind(name):
    assert kernel_kind(name) == NAMES[name]


def test_kernel_time_bound():
    fp8 = {"gpu_kernel_ms_per_step": 2.5, "gpu_ms_by_kind": {"attention_fp8_kv": 1.0,
           "attention_bf16_kv": 0.5, "gemm": 0.6, "other": 0.4}}  # fmt: skip
    bf16 = {"gpu_kernel_ms_per_step": 3.4, "gpu_ms_by_kind": {"attention_bf16_kv": 2.4,
            "gemm": 0.6, "other": 0.4}}  # fmt: skip
    b = kernel_time_bound(fp8, bf16, weight_bytes=3 * 10**9, copy_gbps=3000.0)  # 1 ms of weights
    assert b["weights_at_copy_bw_ms"] == pytest.approx(1.0)
    assert b["attention_ms"] == {"fp8": 1.5, "bf16": 2.4}
    assert b["measured_kernel_ratio"] == pytest.approx(3.4 / 2.5)
    assert b["ratio_if_rest_at_bound"] == pytest.approx((2.4 + 1.0) / (1.5 + 1.0))


def test_kernel_gaps_splits_launch_gaps_from_host_waits():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(start, end, device=DeviceType.CUDA):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))

    # two steps: kernels 0-10, 12-20 (2 us gap), overlap 19-25, then the host: 25 -> 100
    # (75 us wait), 100-110, 113-120 (3 us); a CPU event in between is not a kernel
    events = [ev(0, 10), ev(12, 20), ev(19, 25), ev(100, 110), ev(113, 120),
              ev(30, 90, DeviceType.CPU)]  # fmt: skip
    got = kernel_gaps(events, n=2)
    assert got == {
        "launch_gap_ms_per_step": round(5 / 1e3 / 2, 4),
        "launch_gaps_per_step": 1.0,
        "host_wait_ms_per_step": round(75 / 1e3 / 2, 4),
    }
    assert kernel_gaps([], n=1)["host_wait_ms_per_step"] == 0.0
