"""How many bits the FP8 tensor cores keep when they accumulate long sums (Hopper).

A PV product that accumulates O across key tiles on the tensor cores (FlashAttention-3's
schedule) adds every new tile's products into a growing accumulator. This probe measures the
same effect with `torch._scaled_mm`: row sums of non-negative e4m3 values (as P's) over K
keys, once summed by the tensor cores alone (use_fast_accum=True) and once with the
library's periodic float32 promotion (use_fast_accum=False), against float64. Printed: the
relative error of each per K.

    python tools/probe_fp8_accumulation.py
"""

import torch


def main():
    torch.manual_seed(0)
    print("| K | fast_accum rel. error | promoted rel. error |\n|---|---|---|")
    for K in (128, 512, 2048, 8192, 32768):
        # P-like values: 2**8 * exp2(-u), u >= 0, rounded to e4m3, as the recipe's P codes
        u = torch.rand(128, K, device="cuda") * 8
        p = (256 * torch.exp2(-u)).to(torch.float8_e4m3fn)
        ones = torch.ones(16, K, device="cuda").to(torch.float8_e4m3fn)  # (N, K): the second operand K-major
        one = torch.ones((), device="cuda")
        exact = p.double().sum(dim=1)
        errs = []
        for fast in (True, False):
            s = torch._scaled_mm(p, ones.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                 use_fast_accum=fast)[:, 0].double()
            errs.append(((s - exact).abs() / exact).max().item())
        print(f"| {K} | {errs[0]:.2e} | {errs[1]:.2e} |")


if __name__ == "__main__":
    main()
