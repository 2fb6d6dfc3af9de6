"""Pure-PyTorch definitions of every recipe, on CPU and CUDA."""

from fp4attn.reference.backward import reference_backward
from fp4attn.reference.directp import DIRECTP_THRESHOLDS, build_p, directp_classify, exp2_mxfp4_classify
from fp4attn.reference.forward import ForwardResult, reference_forward

__all__ = [
    "DIRECTP_THRESHOLDS", "ForwardResult", "build_p", "directp_classify", "exp2_mxfp4_classify",
    "reference_backward", "reference_forward",
]
