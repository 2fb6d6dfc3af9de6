"""A pipeline-aware cost model of the Blackwell forward on a B200, read off its machine
code: a prediction, never a measurement (no Blackwell GPU has run these kernels).

Per 128 x 128 key tile it counts the clocks of each resource the tile needs:

    issue    the warp schedulers' instruction slots: each partition's tile loop (its
             SASS) times its warps, spread over the SM's 4 schedulers (one instruction a
             clock each; a partition of fewer than 4 warps lands on as many schedulers)
    tensor   the two products at the tensor cores' dense rates (B200: BF16 2.25, FP8
             4.5, FP4 9 PFLOP/s at 148 SMs)
    MUFU     the loop's MUFU instructions at 16 per SM and clock

and how they combine, which is what the schedule allows:

    pipelined (warp-specialized: loads and MMA issue, softmax, correction in partitions
              that run at once, S in tensor memory single-buffered, freed once the
              softmax has read it): the tile takes the largest of the three; the next
              QK^T runs under this tile's softmax and this tile's PV under the next one's
    serial    (one program's warps issue the products, wait for them and build P): the
              issue time plus the tensor time (the warps wait on each product before
              using it), with the all-overlapped largest-of-three as its ceiling

TFLOP/s = 4 * 128 * 128 * D per tile / tile time, at 148 SMs and the 1.86 GHz the
datasheet rates imply. The model ignores memory, latency and synchronization, so it is
a ceiling; `calibrate` applies it to the BF16 build of the same pipeline and compares
with FlashAttention-4's measured BF16 forward (1613 TFLOP/s, B200, D=128): the ratio is
the model's error on a kernel whose real speed is known, and the factor the other
builds' `predicted_tflops` are scaled by.
"""

from __future__ import annotations

from dataclasses import dataclass

# FlashAttention-4's BF16 forward on a B200, D=128, non-causal (published: 1613 TFLOP/s,
# 71% of the dense BF16 peak); the paper's FP4 kernel reached 2.13x of it at best and
# 2.02x in geometric mean over its D=128 grid (GB200)
FA4_BF16_TFLOPS = 1613.0


@dataclass(frozen=True)
class GPU:
    """The figures the model uses: SMs, the clock, dense tensor-core FLOP per SM and
    clock by operand kind, 4 warp schedulers issuing one instruction a clock each, MUFU
    16 per SM and clock, and the register file and shared memory an SM shares among
    its resident programs."""

    name: str
    sms: int
    clock_hz: float
    flop_per_clk: tuple
    schedulers: int = 4
    mufu_per_clk: int = 16
    registers_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024

    def rate(self, kind: str) -> int:
        return dict(self.flop_per_clk)[kind]


# B200: the datasheet's dense throughputs (HGX B200: BF16 2.25, FP8 4.5, FP4 9 PFLOP/s) at
# 148 SMs and the clock they imply (2.25e15 / (148 * 8192) = 1.86 GHz)
B200 = GPU("B200", 148, 1.86e9, (("bf16", 8192), ("fp8", 16384), ("fp4", 32768)))
# RTX 5090 (sm_120): 170 SMs at the 2.41 GHz boost clock and the dense rates of NVIDIA's RTX
# Blackwell whitepaper as read here (FP4 1676, FP8 838, BF16 419 TFLOPS with float32
# accumulation: 4096, 2048, 1024 FLOP per SM and clock), 100 KiB of shared memory an SM;
# not checked on the GPU
RTX_5090 = GPU("RTX 5090", 170, 2.41e9, (("bf16", 1024), ("fp8", 2048), ("fp4", 4096)), smem_per_sm=100 * 1024)
# SageAttention3 on an RTX 5090 (NVFP4 Q/K/P/V, its paper: 1038 TOPS), the sm_120 builds'
# comparison point
SAGEATTENTION3_RTX5090_TOPS = 1038.0


def _issue_clocks(loops: list[tuple[int, int]], gpu: B200) -> float:
    """Clocks of the busiest scheduler for loops given as (instructions, warps): a
    partition of w >= 4 warps puts w / 4 of them on each scheduler, a smaller one its
    warps on one scheduler each, all on the same ones (the worst case)."""
    return sum(n * (w / gpu.schedulers if w >= gpu.schedulers else w) for n, w in loops)


def predict(report, *, qk: str, pv: str, head_dim: int, block_m: int = 128, block_n: int = 128,
            gpu: GPU = B200) -> dict:
    """The model's figures for one compiled build (`machine_code_sm100.BlackwellSass`)
    whose products multiply `qk` and `pv` operands ("fp4", "fp8", "bf16"), per program
    tile of block_m x block_n. Returns per-partition issue, the clocks of each resource,
    the bound, and `ceiling_tflops` (the model's raw figure); `calibrate` adds the
    calibrated prediction. A serial build with room for two or more programs on an SM
    (registers and shared memory) overlaps one program's products with another's
    issue: its tile then takes the largest, as a pipelined one."""
    flop = 2 * block_m * block_n * head_dim
    tensor = flop / gpu.rate(qk) + flop / gpu.rate(pv)
    out: dict = {"pipelined": report.pipelined}
    if getattr(report, "gluon", False):
        # the Gluon pipeline (forward_gluon_sm100): each loop runs once per key tile for the
        # CTA's two query tiles, so a tile's issue and MUFU are half a step's
        loops = report.gluon_partition_loops()
        tiles = 2
        elems = block_m * block_n / (loops["softmax0"].warps * 32)
        parts = {role: {"instructions": len(lp.opcodes), "warps": lp.warps, "registers": lp.registers,
                        "clk_issue_per_tile": round(_issue_clocks([(len(lp.opcodes), lp.warps)], gpu) / tiles),
                        "instructions_per_element": round(len(lp.opcodes) / elems / (1 if "softmax" in role else tiles),
                                                          2)}
                 for role, lp in loops.items()}
        issue = _issue_clocks([(len(lp.opcodes), lp.warps) for lp in loops.values()], gpu) / tiles
        mufu = sum(sum(o.startswith("MUFU") for o in lp.opcodes) * lp.warps * 32 for lp in loops.values()) / tiles
        # the masked tiles' loop (the tail past Sk; causal, the diagonal) is not in the
        # tile's figure: a few tiles of a long sequence; its cost a score beside it
        out.update(partitions=parts, instructions_per_element=round(len(loops["softmax0"].opcodes) / elems, 2),
                   masked_tile_instructions_per_element=round(len(loops["softmax0"].tail) / elems, 2),
                   query_tiles_per_program=tiles)
    elif report.pipelined:
        loops = report.partition_loops()
        softmax = loops["softmax"]
        elems = block_m * block_n / (softmax.warps * 32)
        parts = {role: {"instructions": len(lp.opcodes), "warps": lp.warps, "registers": lp.registers,
                        "clk_issue": round(_issue_clocks([(len(lp.opcodes), lp.warps)], gpu))}
                 for role, lp in loops.items()}
        issue = _issue_clocks([(len(lp.opcodes), lp.warps) for lp in loops.values()], gpu)
        mufu = sum(sum(o.startswith("MUFU") for o in lp.opcodes) * lp.warps * 32 for lp in loops.values())
        out.update(partitions=parts, instructions_per_element=round(len(softmax.opcodes) / elems, 2))
    else:
        loop = report.tile_loop()
        elems = block_m * block_n / (report.num_warps * 32)
        issue = _issue_clocks([(len(loop), report.num_warps)], gpu)
        mufu = sum(o.startswith("MUFU") for o in loop) * report.num_warps * 32
        out.update(instructions_per_element=round(len(loop) / elems, 2), tile_loop_instructions=len(loop))
    clk_mufu = mufu / gpu.mufu_per_clk
    ceiling = max(tensor, issue, clk_mufu)
    threads = report.num_warps * 32
    programs = min(gpu.registers_per_sm // (max(report.registers, 1) * threads),
                   gpu.smem_per_sm // max(report.shared_bytes, 1))
    overlapped = report.pipelined or programs >= 2
    tile = ceiling if overlapped else issue + tensor
    bound = {tensor: "tensor cores", issue: "instruction issue", clk_mufu: "MUFU"}[ceiling]
    if not overlapped:
        bound = "issue + tensor cores in turn"
    tflops = 2 * flop / tile * gpu.sms * gpu.clock_hz / 1e12
    # every partition's issue per score element: the paper's 2.02x over FA4's BF16 is
    # about 5.5 (710 clocks a 128 x 128 tile at D=128)
    out["issue_per_element"] = round(issue * gpu.schedulers * 32 / (block_m * block_n), 2)
    out.update(gpu=gpu.name, programs_per_sm=programs if not report.pipelined else 1,
               mufu_per_tile=mufu, clk_tensor=round(tensor), clk_issue=round(issue), clk_mufu=round(clk_mufu),
               clk_tile=round(tile), bound=bound, ceiling_tflops=round(tflops),
               overlapped_ceiling_tflops=round(2 * flop / ceiling * gpu.sms * gpu.clock_hz / 1e12))
    return out


def calibrate(prediction: dict, bf16_prediction: dict) -> dict:
    """`prediction` with the calibrated figures: `predicted_tflops` is its ceiling times
    FA4_BF16_TFLOPS / the BF16 build's ceiling (the model's error on a kernel of known
    speed taken out), `predicted_vs_fa4_bf16` that over FA4_BF16_TFLOPS, and
    `calibration` the factor and the raw model's error on the BF16 build."""
    factor = FA4_BF16_TFLOPS / bf16_prediction["ceiling_tflops"]
    predicted = prediction["ceiling_tflops"] * factor
    return {**prediction, "predicted_tflops": round(predicted), "predicted_vs_fa4_bf16": round(predicted / FA4_BF16_TFLOPS, 2),
            "calibration": {"factor": round(factor, 3), "raw_error_on_bf16": round(1 / factor - 1, 3)}}
