"""`fp4attn bench --decode` without a GPU: its arguments, its table and its plot from
records of the form it writes."""

import pytest

from fp4attn.cli import bench_decode


def test_shapes_and_launches_parse_and_bad_ones_are_named():
    assert bench_decode.parse_decode_shapes("8,32,8,32768,128;1,32,8,131072,128")[1] == (1, 32, 8, 131072, 128)
    assert bench_decode.parse_decode_shapes("all")[0] == (8, 32, 8, 32768, 128)
    with pytest.raises(ValueError, match="B,Hq,Hkv,L,D"):
        bench_decode.parse_decode_shapes("8,32,8,32768")
    (a, b) = bench_decode.parse_launches("64,4,2;128,8,3,2,0")
    assert (a.block_n, a.warps, a.stages, a.asm) == (64, 4, 2, True)
    assert (b.block_n, b.warps, b.stages, b.programs_per_sm, b.asm) == (128, 8, 3, 2, False)
    with pytest.raises(ValueError, match="block_n,warps,stages"):
        bench_decode.parse_launches("64,4")


def _records():
    base = dict(B=8, Hq=32, Hkv=8, D=128)
    out = [{"impl": "d2d-copy", "bytes": 1, "bw_TBps": 4.3}]
    for L in (8192, 32768):
        for impl, ms, launch in (("sdpa-cudnn", 0.26, "sdpa"), ("fp4attn-nvfp4", 0.09, "table"),
                                 ("fp4attn-nvfp4", 0.08, "64,4,2,4,1"), ("append-nvfp4", 0.004, "table")):
            out.append({**base, "L": L, "impl": impl, "format": "nvfp4", "launch": launch, "ms": ms * L / 32768,
                        "bytes": 1, "cos": None if impl.startswith("append") else 0.99,
                        "speedup_vs_sdpa": None if impl.startswith("append") else 0.26 / ms,
                        "bw_TBps": 4.0, "bw_frac_copy": 0.93})
    return out


def test_the_table_keeps_each_implementations_fastest_launch(tmp_path):
    table = bench_decode.format_table(_records())
    rows = [r for r in table.splitlines() if "fp4attn-nvfp4" in r]
    assert len(rows) == 2 and all("64,4,2,4,1" in r for r in rows)
    pytest.importorskip("matplotlib")
    bench_decode.plot(_records(), tmp_path / "p.png", gpu="test")
    assert (tmp_path / "p.png").stat().st_size > 1000
