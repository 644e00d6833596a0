"""qrecover.kernels.isa: the main loop, instruction kinds and per-weight counts read from SASS/PTX text (no GPU)."""

from __future__ import annotations

import pytest

from qrecover.kernels import isa

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   ISETP.GE.AND P0, PT, R2, 0x4, PT ;
        /*0030*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0040*/                   LDG.E.128 R4, desc[UR4][R8.64] ;
        /*0050*/                   LDS R6, [R2+0x100] ;
        /*0060*/                   SHFL.BFLY PT, R7, R6, 0x1, 0x1f ;
        /*0070*/                   LOP3.LUT R5, R4, 0x7, RZ, 0xc0, !PT ;
        /*0080*/                   HFMA2 R0, R5, R6, R0 ;
        /*0090*/                   F2FP.F16.F32.PACK_AB R3, R0, R0 ;
        /*00a0*/                   UIADD3 UR4, UR4, 0x10, URZ ;
        /*00b0*/               @P1 BRA `(.L_x_1) ;
        /*00c0*/                   EXIT ;
"""

PTX = """
$L__BB0_1:
	ld.global.v4.b32 	{%r1, %r2, %r3, %r4}, [%rd1];
	shr.u32 	%r5, %r1, 3;
	and.b32 	%r6, %r5, 7;
	fma.rn.f32 	%f1, %f2, %f3, %f1;
	setp.lt.s32 	%p1, %r7, %r8;
	@%p1 bra 	$L__BB0_1;
	ret;
"""


def test_sass_main_loop_is_the_longest_backward_branch():
    body = isa.loop_body(SASS)
    assert body == ["LDG", "LDS", "SHFL", "LOP3", "HFMA2", "F2FP", "UIADD3", "BRA"]
    c = isa.categorise(body)
    assert (c["global load"], c["shared load"], c["shuffle"], c["integer"], c["float"], c["convert"], c["other"]) == (1, 1, 1, 1, 1, 1, 2)
    pw = isa.per_weight(c, num_warps=4, weights_per_iter=256)  # 128 threads, 8 instructions each, 256 weights
    assert pw["total"] == pytest.approx(8 * 128 / 256) and pw["shuffle"] == pytest.approx(0.5)


def test_ptx_loop_and_kinds():
    body = isa.loop_body(PTX, ptx=True)
    assert body == ["ld.global.v4.b32", "shr.u32", "and.b32", "fma.rn.f32", "setp.lt.s32", "bra"]
    c = isa.categorise(body, ptx=True)
    assert (c["global load"], c["integer"], c["float"], c["other"]) == (1, 3, 1, 1)


SASS_FLUSH = """
.L_x_2:
        /*0000*/                   LDG.E R4, desc[UR4][R8.64] ;
        /*0010*/                   PRMT R5, R4, 0x5140, R6 ;
        /*0020*/                   HFMA2 R0, R5, R7, R0 ;
        /*0030*/               @P0 BRA P1, `(.L_x_3) ;
        /*0040*/                   HADD2.F32 R10, -RZ, R0.H0_H0 ;
        /*0050*/                   FADD R11, R11, R10 ;
.L_x_3:
        /*0060*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0070*/              @!P2 BRA `(.L_x_2) ;
        /*0080*/                   EXIT ;
"""


def test_loop_parts_set_apart_a_block_the_loop_can_skip():
    """A flush every few tiles: the block a forward branch inside the loop skips is returned apart, so that
    compile_check weights it by how often it runs; loop_body still returns the whole loop."""
    always, skipped = isa.loop_parts(SASS_FLUSH)
    assert always == ["LDG", "PRMT", "HFMA2", "BRA", "IADD3", "BRA"] and skipped == ["HADD2", "FADD"]
    assert sorted(isa.loop_body(SASS_FLUSH)) == sorted(always + skipped)
    assert isa.loop_parts(SASS) == (isa.loop_body(SASS), [])  # no forward branch: nothing skipped


def test_no_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop"):
        isa.loop_body("        /*0000*/   EXIT ;\n")


def test_occupancy_sm90_limits():
    assert isa.occupancy_sm90(255, 0, 4) == 8 / 64      # 8192 registers a warp: 8 warps, two 4-warp blocks
    assert isa.occupancy_sm90(64, 0, 4) == 32 / 64      # 2048 a warp: 32 warps
    assert isa.occupancy_sm90(32, 0, 4) == 1.0          # 1024 a warp: all 64 warp slots
    assert isa.occupancy_sm90(128, 100 * 1024, 4) == 8 / 64  # shared memory: two blocks of 101 KB


def test_pipe_ceiling_picks_the_slowest_pipe():
    pw = {k: 0.0 for k in isa.KINDS} | {"total": 4.0, "integer": 2.0, "float": 1.0, "convert": 1.0}
    assert isa.weights_per_clock_sm90(pw) == (16.0, "convert")  # one quarter-rate convert per weight
    pw["convert"] = 0.0
    assert isa.weights_per_clock_sm90(pw) == (32.0, "issue")  # 4 instructions at 128 a clock; integer 2/64 ties
    pw["integer"] = 3.0
    assert isa.weights_per_clock_sm90(pw) == (64 / 3, "integer")
