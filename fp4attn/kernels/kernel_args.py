"""How the kernels take their arguments in bundles: the Hopper and Blackwell Triton
forwards, the Hopper Gluon warp-specialized forward and the training backward's Triton
and Gluon kernels.

The per-call scalars are one tuple, `call` (`CALL` for the forwards, `BACKWARD_CALL` for
the backward's kernels), and in the Triton forwards each tensor's strides are one tuple,
(batch, head, row) or (batch, head, channel) (the last dim is contiguous; the other
kernels read contiguous tensors or TMA descriptors). The
JIT specializes every integer of a tuple as it does a lone argument (1 becomes a
constant, a multiple of 16 is known as one), and the flattened parameters stay the same
list in the same order, so the kernels compile to the machine code they had with one
argument a number. Inside, a key tile takes a few named tuples (the query rows, the key
head, the constexpr flags) instead of some thirty arguments; a named tuple builds no
code.

What the two kernels repeat around their tile loops (the program's batch and heads, its
pointers, the epilogue's stores) stays written out in each: an inlined helper adds the
labels that mark its debug scope (Triton builds with line info) to the PTX, and ptxas
schedules around them. Shared, the prologue compiled to other registers in 15 of 217
sm_90 builds; written out, ptxas reads the PTX it read before but for line numbers.
"""

# the forwards' per-call scalars, their `call` tuple in this order: the query heads, the
# query heads per K/V head, the query and key counts, the causal diagonal's offset and
# softmax_scale * log2 e
CALL = ("H", "GROUP", "Sq", "Sk", "causal_offset", "qk_scale")
# the training backward's: the forward's, then softmax_scale itself (dS's factor)
BACKWARD_CALL = (*CALL, "sm_scale")


def call_signature(names: tuple[str, ...] = CALL) -> tuple[str, ...]:
    """The `call` tuple's types as the JIT gives them (for a build without a launch)."""
    return tuple("fp32" if n in ("qk_scale", "sm_scale") else "i32" for n in names)


def aligned_call(names: tuple[str, ...], lengths) -> list[tuple[str, int]]:
    """The `call` elements named in `lengths` as a build's divisibility entries ("call",
    index into `names`): those the JIT specializes as multiples of 16 when they are."""
    return [("call", names.index(n)) for n in lengths]
