"""`patch_sdpa` changes the SDPA calls of the thread that entered it only, and blocks
nest: two threads with overlapping blocks each keep their own route, and neither leaves
the patch on after its block (the module-attribute swap it replaced did both)."""

import threading

import torch
import torch.nn.functional as F

import fp4attn

Q, K, V = (torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
TORCH = F.scaled_dot_product_attention(Q, K, V)
FP8 = fp4attn.attention(Q, K, V, recipe="fp8")
DIRECTP = fp4attn.attention(Q, K, V, recipe="directp")


def _route() -> str:
    """Which implementation `F.scaled_dot_product_attention` runs here and now."""
    out = F.scaled_dot_product_attention(Q, K, V)
    for name, want in (("torch", TORCH), ("fp8", FP8), ("directp", DIRECTP)):
        if torch.equal(out, want):
            return name
    raise AssertionError("SDPA gave an output of none of torch, fp8, directp")


def test_reference_outputs_differ():
    """The routes are told apart by their outputs: the three must differ."""
    assert not torch.equal(TORCH, FP8) and not torch.equal(TORCH, DIRECTP) and not torch.equal(FP8, DIRECTP)


def _run(*steps):
    """Run each thread's steps in the global order given by the (thread, step) pairs;
    returns what each step recorded."""
    turns = [threading.Event() for _ in steps] + [threading.Event()]
    turns[0].set()
    seen: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(name):
        try:
            for i, (who, action) in enumerate(steps):
                if who != name:
                    continue
                assert turns[i].wait(timeout=60), f"step {i} never came"
                result = action()
                if result is not None:
                    seen[i] = result
                turns[i + 1].set()
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)
            for t in turns:
                t.set()

    threads = [threading.Thread(target=worker, args=(n,)) for n in sorted({w for w, _ in steps})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return seen


def _enter(cm):
    def step():
        cm.__enter__()
    return step


def _leave(cm):
    def step():
        cm.__exit__(None, None, None)
    return step


def test_other_threads_keep_torch_sdpa():
    cm = fp4attn.patch_sdpa(recipe="fp8")
    seen = _run(("a", _enter(cm)), ("b", _route), ("a", _route), ("a", _leave(cm)), ("b", _route))
    assert seen == {1: "torch", 2: "fp8", 4: "torch"}


def test_overlapping_blocks_in_two_threads():
    """a enters, b enters, a leaves while b is inside, b leaves: each thread saw its own
    recipe while inside, torch SDPA outside, and nothing stays patched."""
    ca, cb = fp4attn.patch_sdpa(recipe="fp8"), fp4attn.patch_sdpa(recipe="directp")
    seen = _run(("a", _enter(ca)), ("b", _enter(cb)), ("a", _route), ("b", _route), ("a", _leave(ca)),
                ("a", _route), ("b", _route), ("b", _leave(cb)), ("b", _route))
    assert seen == {2: "fp8", 3: "directp", 5: "torch", 6: "directp", 8: "torch"}
    assert _route() == "torch"


def test_blocks_nest_in_one_thread():
    with fp4attn.patch_sdpa(recipe="fp8"):
        assert _route() == "fp8"
        with fp4attn.patch_sdpa(recipe="directp"):
            assert _route() == "directp"
        assert _route() == "fp8"
    assert _route() == "torch"


def test_block_left_by_an_exception_unpatches():
    try:
        with fp4attn.patch_sdpa(recipe="fp8"):
            raise KeyError("inside")
    except KeyError:
        pass
    assert _route() == "torch"
