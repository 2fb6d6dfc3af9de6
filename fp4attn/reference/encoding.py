"""How the quantized P and V live in e4m3 on Hopper, which has FP8 but no FP4 tensor
cores. Every E2M1 value times a power of two is an e4m3 value while it stays inside
e4m3's range; these constants fix that range, and the reference applies the same
limits so that the kernels reproduce it code for code.

- P_OFFSET_LOG2 = 8: P tiles are stored as p * 2**8. An FP8 P (p <= 1) then reaches 256
  and an MXFP4 P, E2M1 x 2**(e_b + 8) with block exponent e_b <= -2, reaches
  6 * 2**6 = 384; both stay under e4m3's 448. Consistent normalization divides the
  offset out again, since the row sum is taken from the same stored values.
- P_EMIN = -16: the lowest MXFP4 P block exponent kept. 0.5 * 2**(e_b + 8) is an exact
  e4m3 value (a multiple of its smallest subnormal 2**-9) only for e_b >= -16. Lower
  blocks hold values under 6 * 2**-17 of the row maximum and are dropped (all codes 0).
- V_WINDOW = 14: MXFP4 V is stored as E2M1 x 2**(e - c) with c = e_max - 6 per head
  (e_max the head's largest block exponent; top value 6 * 2**6 = 384). Exact for
  e >= e_max - 14; blocks lower than that (more than 2**14 below the head's largest) are
  flushed to zero.
"""

P_OFFSET_LOG2 = 8
P_EMIN = -16
V_WINDOW = 14
V_TOP = 6  # log2 of the largest E2M1 block value's headroom under 448: 6 * 2**6 = 384
