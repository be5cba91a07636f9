"""The tc4 math of ``attention/quant_tc.py``: its group quantization is the study's
``kv_formats.uniform_fake`` (fp16 scales) bit for bit, K's and V's rows pack the codes where the
format says (checked by an unpacker over Python ints), and pages hold token t of kv head h where
the cache layout says."""

from __future__ import annotations

import kv_formats as kf
import kv_transform_coding as tc
import pytest
import torch

from torch_kvq.attention import quant, rotation
from torch_kvq.attention import quant_tc as q
from torch_kvq.attention.v_layout import v_positions


def _rows(*shape: int, seed: int = 0, heavy: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if heavy:  # heavy tails: a few coordinates far outside the bulk
        x = x * torch.randn(*shape, generator=g).mul(1.5).exp()
    return x * torch.linspace(0.2, 3.0, shape[-1])


def _bits(row: torch.Tensor, start: int, stop: int, width: int, n: int) -> list[int]:
    """n values of ``width`` bits from bytes [start, stop) of a uint8 row, read as one
    little-endian bit stream (value j at bits width * j): the format's packing, independently."""
    stream = int.from_bytes(bytes(row[start:stop].tolist()), "little")
    assert stop - start == n * width // 8
    return [(stream >> (width * j)) & ((1 << width) - 1) for j in range(n)]


@pytest.mark.parametrize("bits", [3, 4, 5, 6])
@pytest.mark.parametrize("heavy", [False, True])
def test_group_round_trip_is_the_studys_uniform_math(bits: int, heavy: bool) -> None:
    y = _rows(64, 3, 32, seed=bits, heavy=heavy)
    codes, scale, zp = q.quantize_group(y, bits)
    assert codes.dtype == zp.dtype == torch.uint8 and scale.dtype == torch.float16
    assert codes.shape == y.shape and scale.shape == zp.shape == y.shape[:-1]
    assert int(codes.max()) <= 2**bits - 1 and int(zp.max()) <= 2**bits - 1
    assert float(scale.float().min()) > q.HALF_SCALE_MIN  # no row at the floor
    out = q.dequantize_group(codes, scale, zp)
    assert torch.equal(out, kf.uniform_fake(y, 2**bits - 1, half_scale=True))
    # the fp16 scale is stored as used: the same value as the fp32 range over the clip ratio,
    # rounded once to fp16 (for some ratio of the list), per row
    lo, hi = y.amin(-1).clamp(max=0.0), y.amax(-1).clamp(min=0.0)
    cands = torch.stack(
        [((hi - lo) * r * (1.0 / (2**bits - 1))).half() for r in quant.INT4_CLIP_RATIOS], -1
    )
    assert bool((cands == scale.unsqueeze(-1)).any(-1).all())
    assert not torch.equal(out, kf.uniform_fake(y, 2 ** (bits - 1) - 1, half_scale=True))


def test_clipping_picks_a_ratio_below_one_on_heavy_rows() -> None:
    y = _rows(256, 64, heavy=True)
    _, scale, _ = q.quantize_group(y, 4)
    full = ((y.amax(-1).clamp(min=0) - y.amin(-1).clamp(max=0)) * (1.0 / 15)).half()
    assert bool((scale < full).any())


def test_group_of_zeros_and_constant_rows() -> None:
    codes, scale, zp = q.quantize_group(torch.zeros(2, 16), 5)
    assert float(scale.float().min()) == q.HALF_SCALE_MIN == float(scale.float().max())
    assert torch.equal(q.dequantize_group(codes, scale, zp), torch.zeros(2, 16))
    for value in (2.5, -0.75):
        y = torch.full((3, 16), value)
        for bits in (3, 6):
            codes, scale, zp = q.quantize_group(y, bits)
            out = q.dequantize_group(codes, scale, zp)
            assert torch.equal(out, kf.uniform_fake(y, 2**bits - 1, half_scale=True))
            assert bool((out - y).abs().max() <= scale.float().max() / 2)
            assert codes.unique().numel() == 1


def _codes_from_stored(y: torch.Tensor, bits: int, scale: torch.Tensor, zp: torch.Tensor):
    """The codes the stored fp16 scale and zero point give y (the format's code formula)."""
    s, z = scale.float().unsqueeze(-1), zp.float().unsqueeze(-1)
    return quant.round_half_away(y * torch.reciprocal(s) + z).clamp(0, 2**bits - 1)


@pytest.mark.parametrize("bits", [3, 6])
def test_stored_scale_is_the_one_used_also_at_the_floor(bits: int) -> None:
    """Rows of random sizes and rows so small their scale sits at ``HALF_SCALE_MIN`` (values
    about half a step apart there): the codes are those of the stored fp16 scale and zero point."""
    big = _rows(32, 24, seed=bits, heavy=True)
    tiny = (torch.arange(min(24, 2**bits - 2)) + 0.5) * q.HALF_SCALE_MIN  # range < levels * floor
    tiny = torch.stack((tiny, -tiny))
    for y in (big, tiny):
        codes, scale, zp = q.quantize_group(y, bits)
        assert torch.equal(codes.float(), _codes_from_stored(y, bits, scale, zp))
    assert float(scale.float().max()) == q.HALF_SCALE_MIN


def test_half_scale_min_is_an_fp16_value_by_six_point_two_e_minus_five() -> None:
    assert torch.tensor(q.HALF_SCALE_MIN).half().float().item() == q.HALF_SCALE_MIN
    assert abs(q.HALF_SCALE_MIN - 6.2e-5) < 2**-25 and q.HALF_SCALE_MIN > 2**-14


@pytest.mark.parametrize("d", [64, 128])
def test_k_round_trip_is_each_group_unrotated(d: int) -> None:
    y = _rows(5, 2, d, seed=d, heavy=True)
    codes, aux = q.quantize_k(y)
    assert codes.shape == (5, 2, d // 2) and aux.shape == (5, 2, 9)
    assert codes.dtype == aux.dtype == torch.uint8
    ref = [
        q.dequantize_group(*q.quantize_group(y[..., s:e], b))
        for s, e, b in [(0, d // 4, 6), (d // 4, d // 2, 4), (d // 2, d, 3)]
    ]
    assert q.group_bounds(d, q.K_PLAN) == [(0, d // 4, 6), (d // 4, d // 2, 4), (d // 2, d, 3)]
    assert torch.equal(q.dequantize_k(codes, aux), torch.cat(ref, -1))
    # the same as the study's uniform math on each group
    study = [
        kf.uniform_fake(y[..., s:e], 2**b - 1, True) for s, e, b in q.group_bounds(d, q.K_PLAN)
    ]
    assert torch.equal(q.dequantize_k(codes, aux), torch.cat(study, -1))


def test_k_row_and_aux_hold_the_codes_where_the_format_says() -> None:
    d = 64
    y = _rows(3, 2, d, seed=7, heavy=True)
    codes, aux = q.quantize_k(y)
    for i in range(3):
        for h in range(2):
            a, sa, za = q.quantize_group(y[i, h, : d // 4], 6)
            b, sb, zb = q.quantize_group(y[i, h, d // 4 : d // 2], 4)
            c, sc, zc = q.quantize_group(y[i, h, d // 2 :], 3)
            # the row as D/4 16-bit lanes: lane j holds a_j, b_j, c_2j, c_2j+1 from bit 0 up
            fields = _bits(codes[i, h], 0, d // 2, 16, d // 4)
            assert [f & 63 for f in fields] == a.tolist()
            assert [f >> 6 & 15 for f in fields] == b.tolist()
            assert [f >> 10 & 7 for f in fields] == c[0::2].tolist()
            assert [f >> 13 for f in fields] == c[1::2].tolist()
            r = aux[i, h].tolist()
            scales = [int.from_bytes(bytes(r[j : j + 2]), "little") for j in (0, 2, 4)]
            assert scales == [int(s.view(torch.int16)) & 0xFFFF for s in (sa, sb, sc)]
            assert r[6:9] == [int(za), int(zb), int(zc)]
    assert int(codes.max()) > 0


@pytest.mark.parametrize("d", [64, 128])
def test_v_round_trip_is_per_half_rotate_quant_unrotate(d: int) -> None:
    v = _rows(6, 2, d, seed=d + 1, heavy=True)
    codes, aux = q.quantize_v(v)
    assert codes.shape == (6, 2, d // 2) and aux.shape == (6, 2, 6 + d // 16)
    h = d // 2
    ref = [
        rotation.unrotate(
            q.dequantize_group(*q.quantize_group(rotation.rotate(v[..., s : s + h]), b))
        )
        for s, b in ((0, 5), (h, 4))
    ]
    out = q.dequantize_v(codes, aux)
    assert torch.equal(out, torch.cat(ref, -1))
    # the study's "tcvih54" (V's channels, each half rotated, fp16 scales), bit for bit
    assert torch.equal(out, tc.alloc_fake(v, "tcvih54", 0, kf.uniform_fake))


def test_v_row_and_aux_hold_the_codes_where_the_format_says() -> None:
    d = 64
    v = _rows(2, 3, d, seed=3)
    codes, aux = q.quantize_v(v)
    for i in range(2):
        for h in range(3):
            c1, s1, z1 = q.quantize_group(rotation.rotate(v[i, h, : d // 2]), 5)
            c2, s2, z2 = q.quantize_group(rotation.rotate(v[i, h, d // 2 :]), 4)
            row, r = codes[i, h], aux[i, h]
            # byte j: half 1's channel j (low nibble: its low 4 bits) and half 2's (high)
            lo, h2 = _bits(row, 0, d // 2, 4, d)[0::2], _bits(row, 0, d // 2, 4, d)[1::2]
            # half 1's fifth bits, D 64 (U = D/16 = 4): channel c = 4 g + i at bit 4 (g % 2) + i
            # of side byte g // 2 (the decode's operand order)
            hi = [int(r[6 + c // 8]) >> (4 * (c // 4 % 2) + c % 4) & 1 for c in range(d // 2)]
            assert [a | b << 4 for a, b in zip(lo, hi)] == c1.tolist()
            assert h2 == c2.tolist()
            scales = [int.from_bytes(bytes(r[j : j + 2].tolist()), "little") for j in (0, 2)]
            assert scales == [int(s.view(torch.int16)) & 0xFFFF for s in (s1, s2)]
            assert r[4:6].tolist() == [int(z1), int(z2)]
            assert int(c1.max()) >= 16  # the fifth bit is exercised


def test_aux_join_split_and_byte_totals() -> None:
    assert 128 // 2 * 2 + q.aux_width(128) == 152 and 64 // 2 * 2 + q.aux_width(64) == 84
    k_codes, aux_k = q.quantize_k(_rows(4, 128))
    v_codes, aux_v = q.quantize_v(_rows(4, 128, seed=1))
    aux = q.join_aux(aux_k, aux_v)
    assert aux.shape == (4, q.aux_width(128)) and k_codes.shape[-1] + v_codes.shape[-1] == 128
    back_k, back_v = q.split_aux(aux)
    assert torch.equal(back_k, aux_k) and torch.equal(back_v, aux_v)
    assert q.AUX_V_HIGH + 128 // 16 == q.aux_width(128) == q.K_SIDE + q.v_side(128) + 1
    # the record: fp16 slots k's 3 scales, v's 2, then the zero points (k's 3, v's 2, a 0)
    slots = aux[:, : 2 * q.AUX_SLOTS].contiguous().view(torch.float16)
    assert torch.equal(slots[:, :3], aux_k[:, :6].contiguous().view(torch.float16))
    assert torch.equal(slots[:, 3:5], aux_v[:, :4].contiguous().view(torch.float16))
    assert torch.equal(aux[:, 10:13], aux_k[:, 6:9]) and torch.equal(aux[:, 13:15], aux_v[:, 4:6])
    assert not aux[:, 15].any() and torch.equal(aux[:, 16:], aux_v[:, 6:])


@pytest.mark.parametrize("page,d", [(4, 32), (16, 64)])
def test_pages_hold_each_token_where_the_layout_says(page: int, d: int) -> None:
    """k's rows a token a row; v's bytes where ``v_layout`` puts them (pages of 16, D / 2 of 32);
    each page's aux block per kv head: the fp16 slots as [8, page] fp16, then the fifth bits'
    rows [D / 16, page]."""
    pages, kh = 3, 2
    k, v = _rows(pages, page, kh, d, seed=11), _rows(pages, page, kh, d, seed=12, heavy=True)
    kv_cache, kv_aux = q.quantize_pages(k, v)
    assert kv_cache.shape == (pages, 2, page, kh, d // 2)
    assert kv_aux.shape == (pages, kh, q.aux_width(d), page) and kv_aux.is_contiguous()
    out = q.dequantize_pages(kv_cache, kv_aux)
    assert out.shape == (pages, 2, page, kh, d) and out.dtype == torch.float32
    moved = 0
    for p in range(pages):
        for t in range(page):
            rows, cols = v_positions(torch.tensor([t]), d // 2, page)
            moved += int((rows != t).any())
            for h in range(kh):
                kc, ak = q.quantize_k(k[p, t, h])
                vc, av = q.quantize_v(v[p, t, h])
                assert torch.equal(kv_cache[p, 0, t, h], kc)
                assert torch.equal(kv_cache[p, 1, rows[0], h, cols[0]], vc)
                rec = q.join_aux(ak, av)
                slots = kv_aux[p, h, : 2 * q.AUX_SLOTS].reshape(-1).view(torch.float16)
                want = rec[:16].view(torch.float16)
                assert torch.equal(slots.view(q.AUX_SLOTS, page)[:, t], want)
                assert torch.equal(kv_aux[p, h, 16:, t], rec[16:])
                a_rows, a_cols = q.aux_positions(torch.tensor([t]), q.aux_width(d), page)
                assert torch.equal(kv_aux[p, h, a_rows[0], a_cols[0]], rec)
                assert torch.equal(out[p, 0, t, h], q.dequantize_k(kc, ak))
                assert torch.equal(out[p, 1, t, h], q.dequantize_v(vc, av))
    assert moved == (0 if page == 4 else pages * page)  # v_layout spreads every token's bytes
    with pytest.raises(ValueError, match="aux"):
        q.dequantize_pages(kv_cache, kv_aux[:, :, 1:])


def test_inputs_of_any_float_dtype_are_taken_as_fp32() -> None:
    y = _rows(3, 64).bfloat16()
    assert torch.equal(q.dequantize_k(*q.quantize_k(y)), q.dequantize_k(*q.quantize_k(y.float())))
    assert torch.equal(q.dequantize_v(*q.quantize_v(y)), q.dequantize_v(*q.quantize_v(y.float())))


def test_head_size_not_a_multiple_of_16_is_refused() -> None:
    for fn in (q.quantize_k, q.quantize_v):
        with pytest.raises(ValueError, match="multiple of 16, got 40"):
            fn(torch.zeros(2, 40))
    with pytest.raises(ValueError, match="40"):
        q.dequantize_k(torch.zeros(2, 20, dtype=torch.uint8), torch.zeros(2, 9, dtype=torch.uint8))
    with pytest.raises(ValueError, match="40"):
        q.check_head_size(40)
    q.check_head_size(48)


@pytest.mark.parametrize("d", [48, 64, 80, 128, 256])
def test_fifth_bit_positions_place_every_channel_once(d: int) -> None:
    """Each of half 1's D/2 fifth bits has its own bit among the D/16 bytes, in the decode's
    operand order where D is a multiple of 64 (one aux row's byte of token t holds its bits of
    channels g U + 4 ih .. + 3 for g = 2 (byte % 4), + 1: a lane's words of a 16-token step)."""
    pos = q.fifth_bit_positions(d)
    assert sorted(pos.tolist()) == list(range(d // 2))
    bits = torch.randint(0, 2, (3, d // 2), dtype=torch.uint8)
    assert torch.equal(q.unpack_fifth_bits(q.pack_fifth_bits(bits)), bits)
    u = d // 16
    if u % 4 == 0:  # byte 4 ih + g2 holds channels (2 g2 + n) U + 4 ih + il at bit 4 n + il
        for byte in range(u):
            ih, g2 = divmod(byte, 4)
            want = [(2 * g2 + b // 4) * u + 4 * ih + b % 4 for b in range(8)]
            assert [int((pos == 8 * byte + b).nonzero()) for b in range(8)] == want
