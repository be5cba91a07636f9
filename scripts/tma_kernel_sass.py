"""Compile the TMA decode kernel for sm90 on a machine without a GPU and print what the GPU runs.

Triton compiles for a target it is told (``GPUTarget("cuda", 90, 32)``) with the ptxas and
cuobjdump it ships, so the kernel's registers, shared memory and main-loop instruction mix can be
read here, before spending device time: run 30 of 2026-12-01 found this way that the V operand
was gathered one byte at a time (LDS.U8, 64 per Llama page), then measured that moving it
through shared memory, though 21% fewer instructions, ran slower (docs/design/fp8_decode_paths.md).

    python scripts/tma_kernel_sass.py                      # the TUNED configs
    python scripts/tma_kernel_sass.py --head 128 --ppi 2 --stages 6 --lazy --dump k.sass
    python scripts/tma_kernel_sass.py --cache int4_per_token_head --head 128 --lines  # per line
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# opcodes (their first word) that issue to the SM's ALU pipe, 16 lanes a scheduler: half an
# instruction a cycle (Nsight Compute's ``pipe_alu`` on tc4's decode, docs/design/int4-branch.md,
# thirty-eighth session); the FMA pipe takes FFMA / FMUL / FADD / IMAD / HADD2 / HMUL2 / HFMA2
ALU_OPS = frozenset({"LOP3", "PRMT", "SHF", "IADD3", "ISETP", "FSETP", "FMNMX", "IMNMX", "SEL",
                     "FSEL", "LEA", "PLOP3", "VIADD", "I2FP", "F2FP", "MOV", "P2R", "R2P"})  # fmt: skip
LOOP_OPS = ("LDS.U8", "LDS.64", "LDS.128", "LDSM.16.M88.4", "LDSM.16.MT88.4", "STS.128",
            "F2FP.F16.E4M3.UNPACK_B", "HMMA.16816.F32", "FMUL", "IMAD.MOV.U32", "UTMALDG.2D",
            "UTMALDG.3D")  # fmt: skip


# FP8 per tensor; codes per (token, head): int8, e4m3, int4 (two per byte, rotated: int4.py),
# k int8 / v int4 (k8v4.py)
CACHES = ("fp8", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head",
          "k8v4_per_token_head", "tc4_per_token_head")  # fmt: skip
# the arguments the JIT specializes as divisible by 16 at a launch on torch tensors (16-byte
# aligned allocations, strides and the table's row a multiple of 16, window 0)
ALIGNED = ("q_ptr", "block_table_ptr", "seq_lens_ptr", "part_o_ptr", "part_lse_ptr", "out_ptr",
           "kv_scale_ptr", "rot_ptr", "stride_qb", "stride_qh", "stride_ob", "stride_oh",
           "stride_bt", "window")  # fmt: skip


def compile_kernel(
    head: int, group: int, ppi: int, stages: int, warps: int, lazy: bool,
    balanced: bool = False, max_registers: int | None = None, cache: str = "fp8", page: int = 16,
    align: bool = True, kv_heads: int = 1,
):  # fmt: skip
    """The compiled ``_decode_pages`` for pages of ``page`` tokens, fp16 products, split-K
    (``balanced``: ``_decode_balanced``, the balanced schedule, for up to 128 sequences); ``cache``
    one of ``CACHES``: FP8 per tensor, or codes with per-(token, head) scales. ``align``: the
    pointers and ints of ``ALIGNED`` divisible by 16, as a launch specializes them (without:
    other registers and loop lengths than what runs)."""
    import triton
    import triton.language as tl

    from torch_kvq.attention.triton import decode_tma as tma

    if balanced:
        from torch_kvq.attention.triton import decode_balanced

    fn = decode_balanced._decode_balanced if balanced else tma._decode_pages
    from torch_kvq.attention.rotation import hadamard_block

    scales, int4, k8v4 = cache != "fp8", cache.startswith("int4"), cache.startswith("k8v4")
    packed = int4 or k8v4  # uint8, D / 2 bytes a head (k8v4: 3 slots)
    code = {"int8": "i8", "int4": "u8", "k8v4": "u8"}.get(cache[:4], "fp8e4nv")
    width = head // 2 if packed else head
    sig = {
        "q_ptr": "*fp16", "kv_desc": f"tensordesc<{code}[{page}, {width}]>", "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*fp16",
        # the 4-bit caches' scales come as a TMA descriptor (int4.scale_descriptor)
        "kv_scale_ptr": f"tensordesc<fp32[1, 2, {kv_heads * page}]>" if packed else "*fp32" if scales else "constexpr",
        "rot_ptr": "*fp16" if packed else "constexpr",
        "qk_scale_log2": "fp32", "soft_cap": "fp32", "out_scale": "fp32", "window": "i32",
        "stride_qb": "i32", "stride_qh": "i32", "stride_ob": "i32", "stride_oh": "i32",
        "stride_bt": "i32",
    }  # fmt: skip
    import torch

    code_dtype = {"i8": torch.int8, "u8": torch.uint8}.get(code, torch.float8_e4m3fn)
    pv = 2.0 ** tma.pv_shift(code_dtype, torch.float16, lazy)
    const = dict(QH=group * 8, G=group, BLOCK_G=max(8 if packed else 16, triton.next_power_of_2(group)), D=head,
                 PAGE=page, NUM_SPLITS=8, STAGES=stages, PPI=ppi, USE_WINDOW=False,
                 USE_SOFT_CAP=False, DOT=tl.float16, DIRECT=False, LAZY=lazy, SCALES=scales,
                 PV_SCALE=pv if scales else 1.0, INT4=int4, K8V4=k8v4,
                 RSQRT_B=hadamard_block(head) ** -0.5 if packed else 1.0)  # fmt: skip
    if not balanced:  # the balanced schedule holds one kv head per program
        const["NH"] = kv_heads
    if not scales:
        const["kv_scale_ptr"] = None  # a None argument is a constexpr: no kernel parameter
    if not packed:
        const["rot_ptr"] = None
    if balanced:
        sig = {**{k: v for k, v in sig.items() if k != "stride_qb"}, "B": "i32", "stride_qb": "i32"}
        del const["QH"], const["NUM_SPLITS"], const["DIRECT"]
        const.update(KH=8, BLOCK_B=128)
    opts = dict(num_warps=warps, num_stages=stages)
    if max_registers:
        opts["maxnreg"] = max_registers
    return _compile(fn, sig, const, align, opts)


def _compile(fn, sig: dict, const: dict, align: bool, opts: dict):
    """``fn`` compiled for sm90 with ``sig``'s argument types, ``const``'s constexprs and (with
    ``align``) ``ALIGNED``'s arguments divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: the interpreter compiles nothing; unset it")
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    attrs = {
        (fn.arg_names.index(n),): [["tt.divisibility", 16]]
        for n in ALIGNED
        if align and n in sig and sig[n] != "constexpr"
    }
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
        attrs=attrs,
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def compile_tc4(
    head: int, group: int, stages: int, warps: int, lazy: bool, page: int = 16,
    max_registers: int | None = None,
):  # fmt: skip
    """The compiled ``decode_tc4_tma._decode_tc4_tma`` (tc4's TMA decode; no TUNED entry: the
    arguments are the config; ``max_registers`` a cap, none by default as in the launcher),
    split-K (8 splits), fp16 q, 16-divisible pointers and strides."""
    import triton

    from torch_kvq.attention.rotation import hadamard_block
    from torch_kvq.attention.triton import decode_tc4_tma as tc4
    from torch_kvq.attention.triton import fold_logits, tc4_aux

    fn = tc4._decode_tc4_tma
    step = tc4.step_tokens(head, page)  # the boxes' tokens
    sig = {
        "q_ptr": "*fp16", "k_desc": f"tensordesc<i16[{step}, {head // 4}]>",
        "v_desc": f"tensordesc<u8[{step}, {head // 2}]>", "slot_desc": f"tensordesc<fp16[8, {step}]>",
        "bit_desc": f"tensordesc<i32[{tc4_aux.bit_box_rows(head, step)}, {step // 4}]>", "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*fp16",
        "rot_ptr": "*fp16", "qk_scale_log2": "fp32", "window": "i32",
        "stride_qb": "i32", "stride_qh": "i32", "stride_ob": "i32", "stride_oh": "i32",
        "stride_bt": "i32",
    }  # fmt: skip
    const = dict(KH=8, QH=group * 8, G=group, BLOCK_G=max(8, triton.next_power_of_2(group)),
                 D=head, PAGE=page, NUM_SPLITS=8, STAGES=stages, USE_WINDOW=False, DIRECT=False,
                 RSQRT_B=hadamard_block(head // 2) ** -0.5, LAZY=lazy,
                 PV_SCALE=tc4.PV_LAZY if lazy else tc4.PV_EAGER,
                 BIT_BOX=tc4_aux.bit_box_rows(head, step), STEP=step,
                 FOLD=fold_logits.fold_tokens(group, step))  # fmt: skip
    opts = dict(num_warps=warps, num_stages=stages)
    if max_registers:
        opts["maxnreg"] = max_registers
    return _compile(fn, sig, const, True, opts)


def tma_buffers(kernel) -> list[int]:
    """Buffers per TMA copy's destination (the leading dim of each multi-buffered shared
    allocation in the TTGIR, ``memdesc<N x tile>``; 1 where a loop's loads were given none): how
    many pages the pipeliner keeps in flight, which the stage count sets only through its split
    between the page table's load and the copies that hang off it."""
    allocs = re.findall(
        r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([0-9x]+)x[a-z]", kernel.asm["ttgir"]
    )
    tiles = [dims.split("x") for dims in allocs if not dims.endswith("x1")]  # not the mbarriers
    return sorted({int(d[0]) if len(d) >= 3 else 1 for d in tiles}) or [1]


def dot_k_short(kernel) -> list[str]:
    """The MMA operands (the TTGIR's ``dot_op`` types, m16n8k16) whose K is shorter than the 4
    kWidth that a quad of lanes spans: Triton 3.6 gave tc4's fifth bits kWidth 8 at a page of 16
    tokens, and the products came out wrong on the GPU (docs/design/int4-branch.md)."""
    found = re.findall(
        r"tensor<(\d+)x(\d+)x(\w+), #ttg\.dot_op<\{opIdx = (\d), parent = #mma, kWidth = (\d+)\}>>",
        kernel.asm["ttgir"],
    )
    return sorted(
        {f"{a}x{b}x{t} opIdx {i} kWidth {w}" for a, b, t, i, w in found
         if 4 * int(w) > int(b if i == "0" else a)}
    )  # fmt: skip


def tma_misaligned(kernel) -> list[int]:
    """The shared offsets (constant ones: the prologue's copies) of TMA copies' destinations that
    are not 128-byte aligned, as a copy's must be: Triton 3.6 packed the pipeliner's buffers of a
    64-byte box back to back (a misaligned-address fault on the GPU)."""
    pattern = (
        r'cp\.async\.bulk\.tensor.*?"b,r,l,r,r,r"\(i1 %\d+, ptr addrspace\(3\) '
        r"getelementptr \(i8, ptr addrspace\(3\) @global_smem, i32 (\d+)\)"
    )
    return sorted({int(o) for o in re.findall(pattern, kernel.asm["llir"]) if int(o) % 128})


def main_loop(ins: list[tuple[int, str]], target) -> tuple[int, int]:
    """(first, last) address of the main loop in ``ins`` [(address, instruction)]: the backward
    branch (``target(instruction)``: its destination address, or None) whose span holds the most
    tensor-core ops; a loop's back edge is predicated (the unpredicated backward jumps are
    mbarrier-wait retries, out of line)."""
    loop, most = (0, 0), -1
    for addr, text in ins:
        lo = target(text)
        if lo is not None and lo < addr and text.startswith("@"):
            n = sum("HMMA" in t for a, t in ins if lo <= a <= addr)
            if n > most or (n == most and addr - lo < loop[1] - loop[0]):
                loop, most = (lo, addr), n
    return loop


def sass_stats(kernel) -> tuple[dict[str, int], list[str], str]:
    """Registers, shared bytes, main-loop length; the loop's instruction counts; the SASS."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
        usage = subprocess.run(
            [tool, "--dump-resource-usage", cubin], capture_output=True, text=True
        ).stdout
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]

    def target(text: str) -> int | None:
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        return int(m.group(1), 16) if m else None

    loop = main_loop(ins, target)
    body = [t for a, t in ins if loop[0] <= a <= loop[1]]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    head = {
        "registers": regs,
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),  # > 0: spills
        "shared_bytes": kernel.metadata.shared,
        "loop_instructions": len(body),
        "tma_buffers": tma_buffers(kernel),
        "dot_k_short": dot_k_short(kernel),
        "tma_misaligned": tma_misaligned(kernel),
        "alu_pipe": sum(n for op, n in ops.items() if op.split(".")[0] in ALU_OPS),
    }
    return {**head, **{op: ops[op] for op in LOOP_OPS if ops[op]}}, body, sass


def loop_lines(kernel) -> tuple[int, list[tuple[int, str]]]:
    """The main loop's length and its instructions per source line (``file:line``, most first),
    from ``nvdisasm -g`` (its line table): where a page's instructions come from."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([tool, "-g", "-c", cubin], capture_output=True, text=True).stdout
    ins, labels, pending, line = [], {}, [], None
    for text in out.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", text.strip()):
            pending.append(m.group(1))
        elif m := re.search(r'//## File "([^"]+)", line (\d+)', text):
            line = f"{Path(m.group(1)).name}:{m.group(2)}"
        elif m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", text):
            ins.append((int(m.group(1), 16), m.group(2), line))
            labels.update(dict.fromkeys(pending, int(m.group(1), 16)))
            pending = []

    def target(text: str) -> int | None:
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        return labels.get(m.group(1)) if m else None

    loop = main_loop([(a, t) for a, t, _ in ins], target)
    body = [src or "?" for a, _, src in ins if loop[0] <= a <= loop[1]]
    return len(body), collections.Counter(body).most_common()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", type=int, help="head size (default: every TUNED one of the cache)")
    ap.add_argument(
        "--group", type=int, help="query heads per kv head (Gemma's 2 at head 256, else 4)"
    )
    ap.add_argument("--ppi", type=int)
    ap.add_argument("--stages", type=int)
    ap.add_argument("--warps", type=int)
    ap.add_argument("--lazy", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--dump", type=Path, help="write the whole SASS here")
    ap.add_argument("--json", action="store_true", help="one JSON object per config")
    ap.add_argument("--lines", action="store_true",
                    help="also the loop's instructions per source line (nvdisasm -g)")  # fmt: skip
    ap.add_argument("--balanced", action="store_true",
                    help="the balanced schedule's kernel (at BALANCED's register cap for the cache kind, if any)")  # fmt: skip
    ap.add_argument("--max-registers", type=int,
                    help="Triton's maxnreg (0: none; default: the TUNED config's)")  # fmt: skip
    ap.add_argument("--cache", choices=CACHES, default="fp8",
                    help="FP8 per tensor (default), or codes with per-(token, head) scales")  # fmt: skip
    ap.add_argument("--page", type=int, default=16, help="tokens per cache page")
    ap.add_argument("--kv-heads", type=int, default=1, help="kv heads per program (int4: 1 or 2)")
    ap.add_argument("--align", action=argparse.BooleanOptionalAction, default=True,
                    help="16-divisible pointers and strides, as a launch specializes them")  # fmt: skip
    args = ap.parse_args()
    from torch_kvq.attention.triton.decode_config import BALANCED, TUNED, mode_cache_kind, tuned

    if args.cache == "tc4_per_token_head":  # no TUNED entry: the arguments, else the launcher's
        for head in [args.head] if args.head else [64, 128, 256]:
            cfg = dict(head=head, group=args.group or (2 if head == 256 else 4),
                       stages=args.stages or 6, warps=args.warps or 1,
                       lazy=True if args.lazy is None else args.lazy, page=args.page,
                       max_registers=args.max_registers)  # fmt: skip
            kernel = compile_tc4(**cfg)
            stats, _, sass = sass_stats(kernel)
            print(json.dumps({**cfg, **stats}) if args.json else f"{cfg} {stats}")
            if args.lines:
                n, per_line = loop_lines(kernel)
                print(f"loop {n}: " + ", ".join(f"{src} {k}" for src, k in per_line if k >= 4))
            if args.dump:
                args.dump.write_text(sass)
        return
    kind = mode_cache_kind(args.cache)
    for head in [args.head] if args.head else sorted(TUNED[kind]):
        t = tuned(head, kind, page=args.page)
        regs = t["max_registers"] if args.max_registers is None else args.max_registers or None
        cfg = dict(
            head=head, group=args.group or (2 if head == 256 else 4),
            ppi=args.ppi or t["pages_per_iter"], stages=args.stages or t["num_stages"],
            warps=args.warps or t["num_warps"],
            lazy=t["lazy_rescale"] if args.lazy is None else args.lazy,
            balanced=args.balanced, max_registers=regs, cache=args.cache, page=args.page,
            align=args.align, kv_heads=args.kv_heads,
        )  # fmt: skip
        balanced = BALANCED.get(kind, {}).get(head)
        if args.balanced and args.max_registers is None and balanced is not None:
            cfg["max_registers"] = balanced[1]
        kernel = compile_kernel(**cfg)
        stats, _, sass = sass_stats(kernel)
        print(json.dumps({**cfg, **stats}) if args.json else f"{cfg} {stats}")
        if args.lines:
            n, per_line = loop_lines(kernel)
            print(f"loop {n}: " + ", ".join(f"{src} {k}" for src, k in per_line if k >= 4))
        if args.dump:
            args.dump.write_text(sass)


if __name__ == "__main__":
    main()
