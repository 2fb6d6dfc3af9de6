"""The decode split plan and the occupancy it plans for (pure Python, no GPU)."""

import math

import pytest

from fp4attn.routing.decode import DEFAULT_LAUNCH, DecodeLaunch, resident_programs, split_plan


def test_resident_programs_follow_registers_warps_and_shared_memory():
    assert resident_programs(207, 4, 45 * 1024) == 2  # 208 x 128 registers a program: two of 64 K
    assert resident_programs(128, 4, 0) == 4
    assert resident_programs(64, 4, 0) == 8
    assert resident_programs(32, 4, 0) == 16  # the SM's 64 warps
    assert resident_programs(32, 4, 100 * 1024) == 2  # shared memory
    assert resident_programs(255, 8, 0) == 1


def test_the_plan_fills_whole_waves():
    launch = DEFAULT_LAUNCH  # 128-key tiles
    # (8, 32, 8, 32768): 64 (sequence, KV head) programs, two resident on each of 132 SMs:
    # four splits fill one wave (256 of 264 slots), where nine made 2.2 waves
    assert split_plan(launch, 32768, 64, 132, 2) == (4, 8192)
    # one sequence of 131072 (8 KV heads): 32 splits, 256 programs, one wave
    assert split_plan(launch, 131072, 8, 132, 2) == (32, 4096)
    # already four waves of programs: no split
    assert split_plan(launch, 8192, 1024, 132, 2) == (1, 8192)
    # the launch's own split count (measurement)
    assert split_plan(DecodeLaunch(64, 4, 2, splits=16), 4096, 8, 132, 2) == (16, 256)


@pytest.mark.parametrize("max_len", [1, 63, 128, 129, 1000, 4096, 32767, 131072, 500_000])
@pytest.mark.parametrize("programs", [1, 7, 64, 1024])
@pytest.mark.parametrize("resident", [1, 2, 4])
def test_every_split_holds_keys_and_together_they_cover_the_sequence(max_len, programs, resident):
    for launch in (DEFAULT_LAUNCH, DecodeLaunch(64, 4, 2, min_split_tiles=1)):
        splits, per = split_plan(launch, max_len, programs, 132, resident)
        tiles = math.ceil(max_len / launch.block_n)
        assert per % launch.block_n == 0 and 1 <= splits <= max(1, tiles)
        assert (splits - 1) * per < max(max_len, 1) <= splits * per  # none empty, none missing
        if splits > 1:
            assert per // launch.block_n >= launch.min_split_tiles


def test_explain_says_what_decode_runs(monkeypatch):
    """`fp4attn.explain(q, cache)`: the call's route, the reference where the kernels cannot
    run, else the split kernel `decode_routing.decide_route` picks (the CUDA C++ one where it
    takes the call and builds), with the launch the op uses."""
    import torch

    import fp4attn
    from fp4attn import routing
    from fp4attn.routing import decode as decode_routing

    decode_routing.clear_routes()
    monkeypatch.setattr(decode_routing, "_ROUTES", {})  # this test's routes stay its own
    cache = fp4attn.KVCache(2, 2, 128, 256, k_format="fp8")
    q = torch.randn(2, 8, 1, 128)
    cpu = fp4attn.explain(q, cache)
    assert cpu["backend"] == "reference" and cpu["kernel"] == "reference" and "cpu" in cpu["reason"]
    assert fp4attn.explain(q, cache, backend="reference")["reason"] == "backend='reference' was asked for"
    with pytest.raises(TypeError, match="value is required"):
        fp4attn.explain(q, q)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    triton = fp4attn.explain(q, cache)
    assert triton["kernel"] == "hopper.decode_triton" and "interpreter" in triton["reason"], triton
    assert triton["launcher"] == "fp4attn.kernels.hopper.decode_op:hopper_decode"
    launch = decode_routing.decode_launch("fp8", "fp8", 128, decode_routing.block_m_for(4))
    assert triton["launch"] == {"block_n": launch.block_n, "warps": launch.warps, "stages": launch.stages}
    # on a GPU where the CUDA kernels build (the routing's hooks: the device check, the
    # interpreter, the probe): the CUDA split kernel for one new row of FP8 keys
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(decode_routing, "unsupported_reason", lambda device, head_dim: None)
    monkeypatch.setattr(routing.targets, "interpreting", lambda: False)
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: None)
    cuda = fp4attn.explain(q, cache)
    assert cuda["kernel"] == "hopper.decode_cuda", cuda
    assert cuda["launch"] == {"block_n": decode_routing.CUDA_LAUNCH.block_n, "warps": decode_routing.CUDA_WARPS,
                              "stages": decode_routing.cuda_stages("fp8", "fp8")}
    assert decode_routing.split_kernel("fp8", "fp8", 128, 4, 1, cache.page_size, True) == "cuda"
    two_rows = fp4attn.explain(torch.randn(2, 8, 2, 128), cache)
    assert two_rows["kernel"] == "hopper.decode_triton" and "2 new query rows" in two_rows["reason"], two_rows
    # decided once: the same form of call gives the same record, a patched probe is seen
    # only once the routes are cleared
    route = decode_routing.decode_route(q.device, 2, 2, 8, 1, 128, "fp8", "fp8", cache.page_size)
    assert route is decode_routing.decode_route(q.device, 2, 2, 8, 1, 128, "fp8", "fp8", cache.page_size)
    assert fp4attn.explain(q, cache) == route.as_dict()
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: "not here")
    assert fp4attn.explain(q, cache)["kernel"] == "hopper.decode_cuda"
    decode_routing.clear_routes()
    assert "not here" in fp4attn.explain(q, cache)["reason"]


def test_block_m_is_the_next_power_of_two_within_bounds():
    from fp4attn.routing.decode import MAX_BLOCK_M, MIN_BLOCK_M, block_m_for

    assert [block_m_for(r) for r in (1, 4, 5, 8, 9, 33, 64, 65, 1000)] == [MIN_BLOCK_M, 4, 8, 8, 16, 64, 64,
                                                                          MAX_BLOCK_M, MAX_BLOCK_M]
