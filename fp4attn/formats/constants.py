"""Named constants of the number formats, each with its value and source.

OCP = "OCP Microscaling Formats (MX) Specification v1.0" (2023).
NVFP4 follows NVIDIA's definition as implemented by TransformerEngine's reference
quantizer (`NVFP4QuantizerRef`).
"""

# E2M1 (OCP MX v1.0, section 5.3.3): 1 sign, 2 exponent, 1 mantissa bit, bias 1,
# no Inf/NaN. Magnitudes of codes 0..7; codes 8..15 are the negatives (8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest normal, 4 = 2**2 (OCP table 1)

# E4M3 "fn" (OCP 8-bit floating point v1.0): bias 7, no Inf, NaN = S.1111.111.
E4M3_MAX = 448.0
# E5M2: bias 15, IEEE-like Inf/NaN.
E5M2_MAX = 57344.0
# FP8 blocks whose absolute maximum is below this are flushed (scale 1, zero elements):
# their inverse scale fmax / amax would overflow float32 (448 / amax at amax < 2**-119,
# 57344 / amax at 2**-112) and turn the block's zeros into NaN (0 * inf). Gradient
# tiles this small occur in training (dS = P (dP - delta) where P underflows).
FP8_MIN_AMAX = 2.0**-112

# E8M0 (OCP MX v1.0, section 5.4.1): unsigned exponent, bias 127, 0xFF is NaN, no zero.
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_EMIN = -127
E8M0_EMAX = 127

MX_BLOCK = 32  # OCP MX v1.0: k = 32 elements share one E8M0 scale
NVFP4_BLOCK = 16  # NVFP4: 16 elements share one E4M3 scale

FP32_MAX = 3.4028234663852886e38
