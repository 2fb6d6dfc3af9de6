"""The NVRTC build cache's key (`nvrtc_build.cache_key`): the source and exactly the headers it
includes by quoted name, through other headers too and wherever they are found among the
include paths, so that an edit to any of them builds again and an edit to any other file
does not. CPU only, nothing is compiled."""

import pytest

from fp4attn.kernels.hopper import nvrtc_build


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """src/kernel.cu includes a.cuh (beside it) and lib.cuh (in inc/); a.cuh includes b.cuh
    (beside it) and, under a condition, c.cuh (found in inc/); lib.cuh includes deep/d.cuh;
    unused.cuh (beside the source) and inc/other.cuh are included by nothing."""
    monkeypatch.setattr(nvrtc_build, "nvrtc_version", lambda: (13, 0))  # no NVRTC needed
    src, inc = tmp_path / "src", tmp_path / "inc"
    (inc / "deep").mkdir(parents=True)
    src.mkdir()
    files = {
        src / "kernel.cu": '#include "a.cuh"\n  #  include "lib.cuh"\n#include <cuda_fp8.h>\n// body\n',
        src / "a.cuh": '#pragma once\n#include "b.cuh"\n#if 0\n#include "c.cuh"\n#endif\n#include "a.cuh"\n',
        src / "b.cuh": "#pragma once\n",
        inc / "c.cuh": "#pragma once\n",
        inc / "lib.cuh": '#pragma once\n#include "deep/d.cuh"\n#include "b.cuh"\n',
        inc / "deep" / "d.cuh": "#pragma once\n",
        src / "unused.cuh": "#pragma once\n",
        inc / "other.cuh": "#pragma once\n",
    }
    for path, text in files.items():
        path.write_text(text)
    return src / "kernel.cu", [f"--include-path={inc}", "-DHEAD_DIM=128"]


def test_the_headers_are_the_included_ones_found_on_the_include_paths(tree):
    source, options = tree
    found = nvrtc_build.included_headers(source, nvrtc_build.include_dirs(source, options))
    inc = source.parent.parent / "inc"
    # the source's own includes are looked up on the include paths (inc/ before its folder),
    # a header's beside it first: lib.cuh's "b.cuh" is src/b.cuh, already counted
    assert [(name, path.relative_to(source.parent.parent).as_posix()) for name, path in found] == [
        ("a.cuh", "src/a.cuh"), ("lib.cuh", "inc/lib.cuh"), ("b.cuh", "src/b.cuh"), ("c.cuh", "inc/c.cuh"),
        ("deep/d.cuh", "inc/deep/d.cuh")]
    assert nvrtc_build.include_dirs(source, options) == [inc, source.parent]


@pytest.mark.parametrize("edited", ["src/kernel.cu", "src/a.cuh", "src/b.cuh", "inc/c.cuh", "inc/lib.cuh",
                                    "inc/deep/d.cuh"])
def test_an_edit_to_the_source_or_an_included_header_changes_the_key(tree, edited):
    source, options = tree
    before = nvrtc_build.cache_key(source, options)
    path = source.parent.parent / edited
    path.write_text(path.read_text() + "// edited\n")
    assert nvrtc_build.cache_key(source, options) != before


@pytest.mark.parametrize("edited", ["src/unused.cuh", "inc/other.cuh"])
def test_an_edit_to_a_header_nothing_includes_keeps_the_key(tree, edited):
    source, options = tree
    before = nvrtc_build.cache_key(source, options)
    path = source.parent.parent / edited
    path.write_text(path.read_text() + "// edited\n")
    (source.parent / "new.cuh").write_text("// a new header nothing includes\n")
    assert nvrtc_build.cache_key(source, options) == before


def test_the_key_follows_the_options_and_nvrtc_but_not_the_install_path(tree, tmp_path, monkeypatch):
    source, options = tree
    key = nvrtc_build.cache_key(source, options)
    assert nvrtc_build.cache_key(source, [*options, "-DCAUSAL=1"]) != key
    monkeypatch.setattr(nvrtc_build, "nvrtc_version", lambda: (13, 1))
    assert nvrtc_build.cache_key(source, options) != key
    monkeypatch.setattr(nvrtc_build, "nvrtc_version", lambda: (13, 0))
    moved = tmp_path / "moved"
    (tmp_path / "src").rename(moved)  # the source's folder elsewhere: the same files, the same key
    assert nvrtc_build.cache_key(moved / "kernel.cu", options) == key


def test_every_header_of_the_cuda_kernels_is_in_a_key():
    from fp4attn.kernels.hopper import backward_cuda, decode_cuda, forward_cuda

    keyed = {}
    for module in (forward_cuda, backward_cuda, decode_cuda):
        options = nvrtc_build.options_for(module.all_variants()[0].defines())
        found = nvrtc_build.included_headers(module.SOURCE, nvrtc_build.include_dirs(module.SOURCE, options))
        assert all(path.parent == module.SOURCE.parent for _, path in found), module.__name__
        keyed[module] = {path.name for _, path in found}
    assert set().union(*keyed.values()) == {path.name for path in forward_cuda.SOURCE.parent.glob("*.cuh")}
    # the kernels share headers by role only: an edit to the forward's own builds none of the
    # backward again, and the reverse
    assert not [name for name in keyed[backward_cuda] if name.endswith("_fwd.cuh")]
    assert not [name for name in keyed[forward_cuda] if name.endswith("_bwd.cuh")]
    assert keyed[decode_cuda] == {"ptx.cuh"}
