"""How the Hopper and Blackwell Triton forwards (and the Hopper Gluon warp-specialized
forward, whose operands are TMA descriptors) take their arguments in bundles.

Each tensor's strides are one tuple, (batch, head, row) or (batch, head, channel) (the
last dim is contiguous), and the per-call scalars are one tuple, `call` (`CALL`). The
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


def call_signature() -> tuple[str, ...]:
    """The `call` tuple's types as the JIT gives them (for a build without a launch)."""
    return tuple("fp32" if n == "qk_scale" else "i32" for n in CALL)
