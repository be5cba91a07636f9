"""benchmarks/clock_sampler.py against a fake NVML (no GPU here): the thread samples, the summary
reports clocks, power and the reason bits it saw, and a missing NVML is said, not guessed."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
from clock_sampler import ClockSampler, reason_names  # noqa: E402


def fake_nvml(clocks: list[int], reasons: list[int]) -> SimpleNamespace:
    """SM clocks and reason masks in turn (the last repeats); memory 3201 MHz, 500.5 W."""
    i = {"sm": 0, "r": 0}

    def clock(handle, kind):
        if kind == "mem":
            return 3201
        i["sm"] += 1
        return clocks[min(i["sm"] - 1, len(clocks) - 1)]

    def reason(handle):
        i["r"] += 1
        return reasons[min(i["r"] - 1, len(reasons) - 1)]

    return SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: ("gpu", index),
        NVML_CLOCK_SM="sm",
        NVML_CLOCK_MEM="mem",
        nvmlDeviceGetClockInfo=clock,
        nvmlDeviceGetPowerUsage=lambda handle: 500_500,
        nvmlDeviceGetCurrentClocksEventReasons=reason,
    )


def test_summary_of_sampled_clocks_and_reasons() -> None:
    nvml = fake_nvml([1980, 1980, 1755], [0, 0x4, 0x4 | 0x80])
    with ClockSampler(0, every_s=0.001, nvml=nvml) as sampler:
        time.sleep(0.05)
    s = sampler.summary()
    assert s["available"] and s["n"] >= 3 and len(s["samples"]) == s["n"]
    assert (s["sm_mhz_min"], s["sm_mhz_max"]) == (1755, 1980)
    assert s["mem_mhz"] == [3201] and s["power_w_max"] == 500.5
    assert set(s["reasons_share"]) == {"sw_power_cap", "hw_power_brake_slowdown"}
    assert s["reasons_share"]["sw_power_cap"] > s["reasons_share"]["hw_power_brake_slowdown"] > 0
    times = [row[0] for row in s["samples"]]
    assert times == sorted(times) and times[-1] < 5.0


def test_reason_names_keep_unknown_bits() -> None:
    assert reason_names(0) == []
    assert reason_names(0x1 | 0x40) == ["gpu_idle", "hw_thermal_slowdown"]
    assert reason_names(0x400 | 0x8) == ["hw_slowdown", "0x400"]


def test_without_nvml_the_summary_says_why() -> None:
    broken = SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(RuntimeError("no driver")))
    with ClockSampler(0, nvml=broken) as sampler:
        pass
    s = sampler.summary()
    assert s["available"] is False and "no driver" in s["why"] and "samples" not in s
