"""Shared-memory wavefronts of the TMA decode, counted offline from its PTX, per source line.

Nsight Compute measured the four-token V layout of cd906b1 at 35% excessive shared wavefronts
against fd40bea's 16% (docs/design/int4-branch.md, twentieth session): bank conflicts decide
speed where instruction counts do not. This counts them without a GPU, so a layout can be
checked before device time is spent. Each shared access's per-lane address is evaluated over
the warp's 32 lanes by running the PTX's integer instructions in text order (one pass, branches
ignored); values the warp shares (parameters, block indices, loaded data, the loop's stage) are
taken as 0: they move every lane's address alike, so they do not change conflicts as long as
they are multiples of 128 bytes (the stage buffers are). Wavefronts of an access: its lanes in
groups of 128 requested bytes (32 lanes at 4 bytes, 16 at 8, 8 at 16; ``ldmatrix`` and
``stmatrix`` one group per 8 x 8 matrix), each group as many as the most distinct 4-byte words
in one of the 32 banks; ideal is one per group.

    python scripts/smem_bank_conflicts.py --cache int4_per_token_head --head 128 --kv-heads 2
    python scripts/smem_bank_conflicts.py ... --all      # every access, not only the main loop's
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tma_kernel_sass import CACHES, compile_kernel  # noqa: E402

LANES = np.arange(32, dtype=np.uint64)
MASK = {n: np.uint64((1 << n) - 1) for n in (8, 16, 32, 64)}
SHARED = re.compile(r"\b(ld|st)\.shared(?:\.v(\d))?\.[bsuf](\d+)|\b(ld|st)matrix\.[\w.]*?\.x(\d)")


def bits(op: str) -> int:
    """The integer width of a PTX op's type suffix (``add.s32`` -> 32; ``mul.wide.u32`` -> 64)."""
    m = re.findall(r"\.[bsu](8|16|32|64)\b", op)
    width = int(m[-1]) if m else 32
    return 64 if ".wide" in op else width


def lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """PTX ``lop3.b32``: each bit of the result is ``lut``'s bit at (a, b, c) as a 3-bit index."""
    out = np.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            ta = a if i & 4 else ~a
            tb = b if i & 2 else ~b
            tc = c if i & 1 else ~c
            out |= ta & tb & tc
    return out & MASK[32]


class Warp:
    """Integer registers over 32 lanes; ``assumed``: those that hold a value taken as 0."""

    def __init__(self) -> None:
        self.reg: dict[str, np.ndarray] = {}
        self.assumed: set[str] = set()

    def val(self, tok: str) -> tuple[np.ndarray, bool]:
        tok = tok.strip()
        if tok.startswith("%tid.x"):
            return LANES.copy(), False
        if tok.startswith("%"):
            if tok in self.reg:
                return self.reg[tok], tok in self.assumed
            return np.zeros(32, np.uint64), True
        if tok == "global_smem":
            return np.zeros(32, np.uint64), False
        try:
            return np.full(32, int(tok, 0) & ((1 << 64) - 1), np.uint64), False
        except ValueError:
            return np.zeros(32, np.uint64), True

    def run(self, op: str, args: list[str]) -> None:
        """One instruction: write its destination (``args[0]``) where the op is integer."""
        base, w = op.split(".")[0], bits(op)
        if not args or not args[0].startswith("%") or args[0].startswith("%p"):
            return self.setp(op, args) if base == "setp" else None
        vals = [self.val(a) for a in args[1:]]
        x = [v for v, _ in vals]
        assumed = any(a for _, a in vals)
        with np.errstate(over="ignore"):
            if base in ("mov", "cvt", "cvta"):
                r = x[0]
            elif base == "add":
                r = x[0] + x[1]
            elif base == "sub":
                r = x[0] - x[1]
            elif base == "mul":
                r = x[0] * x[1]
            elif base == "mad":
                r = x[0] * x[1] + x[2]
            elif base == "shl":
                r = x[0] << (x[1] & np.uint64(63))
            elif base == "shr":
                r = x[0] >> (x[1] & np.uint64(63))
            elif base == "and":
                r = x[0] & x[1]
            elif base == "or":
                r = x[0] | x[1]
            elif base == "xor":
                r = x[0] ^ x[1]
            elif base == "not":
                r = ~x[0]
            elif base == "lop3":
                r = lop3(x[0], x[1], x[2], int(args[4], 0))
            elif base == "selp":
                p, pa = self.val(args[3])
                r, assumed = np.where(p != 0, x[0], x[1]), assumed or pa
            elif base in ("min", "max"):
                r = (np.minimum if base == "min" else np.maximum)(x[0], x[1])
            else:  # float math, shuffles, loads: not an address
                r, assumed = np.zeros(32, np.uint64), True
        self.reg[args[0]] = r & MASK[min(w, 64)]
        (self.assumed.add if assumed else self.assumed.discard)(args[0])

    def setp(self, op: str, args: list[str]) -> None:
        cmp = op.split(".")[1]
        (a, aa), (b, ba) = self.val(args[1]), self.val(args[2])
        fn = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
              "gt": np.greater, "ge": np.greater_equal}.get(cmp)  # fmt: skip
        if fn is None or "|" in args[0]:
            self.reg[args[0].split("|")[0]] = np.zeros(32, np.uint64)
            self.assumed.add(args[0].split("|")[0])
            return
        self.reg[args[0]] = fn(a, b).astype(np.uint64)
        (self.assumed.add if aa or ba else self.assumed.discard)(args[0])


def wavefronts(addr: np.ndarray, width: int, groups: list[np.ndarray]) -> int:
    """Wavefronts of one access: per lane group, the most distinct 4-byte words in one bank."""
    total = 0
    for lanes in groups:
        words = {int(a) // 4 + k for a in addr[lanes] for k in range(max(1, width // 4))}
        per_bank = collections.Counter(w % 32 for w in words)
        total += max(per_bank.values())
    return total


def lane_groups(width: int, matrices: int) -> list[np.ndarray]:
    if matrices:  # ldmatrix / stmatrix: lanes 8i..8i+7 give matrix i's 8 row addresses
        return [LANES[8 * i : 8 * i + 8] for i in range(matrices)]
    per = max(1, min(32, 128 // max(width, 4)))
    return [LANES[i : i + per] for i in range(0, 32, per)]


def analyse(ptx: str) -> list[dict]:
    """Every shared access of ``ptx``: line, source line, op, wavefronts, ideal, in the loop."""
    files = dict(re.findall(r"\.file\s+(\d+)\s+\"([^\"]+)\"", ptx))
    lines = ptx.splitlines()
    # the page loop: of the spans from a label to the last branch back to it, the one with the
    # most TMA copies and barrier waits (the epilogue's loops have none), then the most MMAs
    labels = {m.group(1): i for i, t in enumerate(lines) if (m := re.match(r"(\$L__BB\w+):", t))}
    spans: dict[str, int] = {}
    for i, line in enumerate(lines):
        if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\w+);", line)) and labels[m.group(1)] < i:
            spans[m.group(1)] = max(spans.get(m.group(1), 0), i)

    def weight(lo: int, hi: int) -> tuple[int, int]:
        body = lines[lo : hi + 1]
        tma = sum("cp.async.bulk.tensor" in t or "mbarrier.try_wait" in t for t in body)
        return tma, sum("mma.sync" in t for t in body)

    lo, hi = max(
        ((labels[k], v) for k, v in spans.items()), key=lambda s: weight(*s), default=(0, -1)
    )
    loop = range(lo, hi + 1)
    warp, src, out = Warp(), "?", []
    # two passes in text order, the second recording: it sees what the first defined later in the
    # text (a rotated loop's body before its header)
    for record, (i, line) in ((r, il) for r in (False, True) for il in enumerate(lines)):
        text = line.strip()
        if text.startswith(".loc"):
            f, ln = text.split()[1:3]
            src = f"{Path(files.get(f, f)).name}:{ln}"
            continue
        text = re.sub(r"^@!?%p\d+\s+", "", text).rstrip(";")
        if not text or text.startswith(("//", ".", "$", "{", "}")):
            continue
        op, _, rest = text.partition(" ")
        m = SHARED.search(op)
        if m and "[" in rest:
            inner = re.search(r"\[([^\]]+)\]", rest).group(1)
            reg, _, off = inner.partition("+")
            a, assumed = warp.val(reg)
            addr = a + np.uint64(int(off, 0) if off else 0)
            if m.group(5):
                width, mats = 16, int(m.group(5))
            else:
                width, mats = int(m.group(2) or 1) * int(m.group(3)) // 8, 0
            groups = lane_groups(width, mats)
            if record:
                out.append(dict(
                    ptx_line=i + 1, src=src, op=op, width=width, ideal=len(groups),
                    wavefronts=wavefronts(addr, width, groups), in_loop=i in loop, assumed=assumed,
                ))  # fmt: skip
            if op.startswith("ld") and "{" in rest:  # the loaded registers: data, not addresses
                for r in re.findall(r"%\w+", rest.split("[")[0]):
                    warp.reg[r] = np.zeros(32, np.uint64)
                    warp.assumed.add(r)
            continue
        args = [t.strip() for t in re.split(r",(?![^{]*\})", rest) if t.strip()]
        if args and not args[0].startswith("{"):
            warp.run(op, args)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", choices=CACHES, default="int4_per_token_head")
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--group", type=int, default=4, help="q heads per kv head")
    ap.add_argument("--stages", type=int, default=6)
    ap.add_argument("--ppi", type=int, default=1)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=1, help="kv heads per program (int4: 1 or 2)")
    ap.add_argument("--lazy", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--all", action="store_true", help="every access, not only the main loop's")
    a = ap.parse_args()
    kernel = compile_kernel(a.head, a.group, a.ppi, a.stages, 1, a.lazy, cache=a.cache,
                            page=a.page, kv_heads=a.kv_heads)  # fmt: skip
    rows = analyse(kernel.asm["ptx"])
    shown = [r for r in rows if a.all or r["in_loop"]]
    by_src: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for r in shown:
        s = by_src[(r["src"], r["op"])]
        s[0], s[1], s[2] = s[0] + 1, s[1] + r["wavefronts"], s[2] + r["ideal"]
    print(f"{a.cache} head {a.head} kv heads {a.kv_heads} ppi {a.ppi} page {a.page}: "
          f"{'all' if a.all else 'main-loop'} shared accesses")  # fmt: skip
    print(f"{'source':<22} {'op':<48} {'n':>4} {'wavefronts':>10} {'ideal':>6}")
    for (src, op), (n, w, ideal) in sorted(by_src.items()):
        flag = "  <- conflicts" if w > ideal else ""
        print(f"{src:<22} {op:<48} {n:>4} {w:>10} {ideal:>6}{flag}")
    loads = [r for r in shown if r["op"].startswith("ld")]
    w, ideal = sum(r["wavefronts"] for r in loads), sum(r["ideal"] for r in loads)
    print(f"loads: {w} wavefronts, {ideal} ideal, {w - ideal} excessive "
          f"({(w - ideal) / max(w, 1):.0%}); addresses with a value taken as 0: "
          f"{sum(r['assumed'] for r in shown)}")  # fmt: skip


if __name__ == "__main__":
    main()
