"""GPU clocks, power and clock-event reasons sampled through NVML while a benchmark times steps.

Runs 36-39 of 2026-12-01 (``bench_decode_at_scale``) saw the same pattern in every timed run: a
slow first step and, ~0.35 s after timing starts, a stretch of steps 10-20% slower than the
median, so the mean step lags the median. A clock or power event would show here as a lower SM
clock and a reason bit (power cap, thermal, power brake) at those steps' times.

    with ClockSampler(device_index=0, every_s=0.005) as clocks:
        ...timed steps...
    row["clocks"] = clocks.summary()

NVML is ``pynvml`` (the ``nvidia-ml-py`` package, on the H200 image). Without it, or without a
CUDA device, ``summary()`` says why and holds no samples; nothing is guessed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

# NVML's clock-event (formerly "throttle") reason bits
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def reason_names(mask: int) -> list[str]:
    """The names of the bits set in an NVML clock-event reason mask (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


class ClockSampler:
    """A thread that reads SM / memory clock (MHz), power (W) and the clock-event reasons every
    ``every_s`` seconds between ``__enter__`` and ``__exit__``; sample times are seconds from
    ``__enter__``."""

    def __init__(self, device_index: int = 0, every_s: float = 0.005, nvml: Any = None) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, int, int, float, int]] = []
        self.unavailable = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self._nvml, self._handle = nvml, nvml.nvmlDeviceGetHandleByIndex(device_index)
            self._reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
                nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            )
        except Exception as e:  # noqa: BLE001 - recorded in the summary, not hidden
            self.unavailable = f"NVML unavailable: {e!r:.200}"

    def _read(self) -> tuple[int, int, float, int]:
        n, h = self._nvml, self._handle
        return (
            n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
            n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
            n.nvmlDeviceGetPowerUsage(h) / 1000.0,
            int(self._reasons(h)),
        )

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - t0, *self._read()))
            self._stop.wait(self.every_s)

    def __enter__(self) -> ClockSampler:
        if not self.unavailable:
            self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        """SM clock min / median / max, peak power, every reason seen with its share of samples,
        and the samples themselves as [t_s, sm_mhz, mem_mhz, power_w, reason_mask]."""
        if self.unavailable:
            return {"available": False, "why": self.unavailable}
        if not self.samples:
            return {"available": True, "n": 0}
        sm = sorted(s[1] for s in self.samples)
        seen: dict[str, int] = {}
        for s in self.samples:
            for name in reason_names(s[4]):
                seen[name] = seen.get(name, 0) + 1
        n = len(self.samples)
        return {
            "available": True,
            "n": n,
            "every_s": self.every_s,
            "sm_mhz_min": sm[0],
            "sm_mhz_median": sm[n // 2],
            "sm_mhz_max": sm[-1],
            "mem_mhz": sorted({s[2] for s in self.samples}),
            "power_w_max": max(s[3] for s in self.samples),
            "reasons_share": {k: round(v / n, 3) for k, v in sorted(seen.items())},
            "samples": [[round(s[0], 4), s[1], s[2], round(s[3], 1), s[4]] for s in self.samples],
        }
