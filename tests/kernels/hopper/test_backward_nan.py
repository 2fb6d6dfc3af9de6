"""The training backward's Triton kernels and their operand passes under the Triton
interpreter (CPU): a NaN reaches the gradients the reference says (reference/backward.py,
"Non-finite values"; tests/reference/test_nan_rows.py) and, besides them, only the rows or
keys of a tile that reads it (a masked pair's 0 times the NaN in the tile's product, as in
the forward): never another batch item, head, or tile.

- k[200] (causal): dq of rows 200 on NaN in every channel, rows before 128 (the query
  tiles that never read key 200's tile) finite; dk and dv NaN on every key the NaN rows
  attend (all of them).
- q[40] (causal): dq of row 40 alone; dk and dv of keys 0..40 NaN, keys from 128 on (a
  key tile row 40 never reads) finite.

A NaN row of Q or K once made every channel scale of its per-channel view NaN, and with
it every dq of the head. The GPU test is tests/kernels/hopper/test_backward_cuda.py's
test_nan_reaches_only_what_it_feeds."""

import textwrap

import pytest

from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

SCRIPT = KERNEL_PATCHES + textwrap.dedent('''
    import torch

    from fp4attn.kernels.hopper import train_op

    S, D = 256, 64
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 1, S, D, generator=g).bfloat16() for _ in range(4))
    for where, row in (("k", 200), ("q", 40)):
        args = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        args[where][0, 0, row, 3] = float("nan")
        out, lse, *saved = train_op._train_forward_fp8_op(args["q"], args["k"], args["v"], "fp8", "fp8", "exp2",
                                                          "fp8", 0, True, D ** -0.5)
        ops = train_op.backward_operands_fp8(dout, out, *saved)
        dq, dk, dv = (t.float() for t in train_op.launch_backward(ops, lse, "fp8", "exp2", 0, True, D ** -0.5))
        for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
            assert not t[1].isnan().any(), (where, name, "the other batch item")
        if where == "k":
            assert dq[0, 0, 200:].isnan().all() and not dq[0, 0, :128].isnan().any(), where
            assert dk[0, 0].isnan().all() and dv[0, 0].isnan().all(), where
        else:
            rows = dq[0, 0].isnan().any(-1)
            assert dq[0, 0, 40].isnan().all() and rows.sum() == 1, (where, rows.nonzero().flatten().tolist())
            for name, t in (("dk", dk), ("dv", dv)):
                keys = t[0, 0].isnan().any(-1)
                assert keys[:41].all() and not keys[128:].any(), (where, name, keys.nonzero().flatten().tolist())
    print("ok")
''')


def test_nan_reaches_only_what_it_feeds_under_the_interpreter():
    run_under_interpreter(SCRIPT, timeout=900)
