"""Development modules, not part of the installed package: the machine-code (SASS) analysis
of the Hopper Triton/Gluon builds (`machine_code`) and the cost model read off it
(`cost_model_sm90`). Used by the compile tests and tools/; tests/dev/test_dev.py imports each.
Import them from the checkout's root (`python -m pytest`, or a script that puts the root
on sys.path, as tools/compile_check.py does).

Blackwell: the builds' SASS read instruction by instruction (`machine_code_sm100`), the
cost model read off it (`cost_model_sm100`) and its report on every build
(`python -m dev.cost_report_sm100`), and the unrouted Gluon forward with
FlashAttention-4's structure (`forward_gluon_sm100`).

The Hopper CUDA forward's checking build (`forward_cuda_check`), and the timing steps the
forward probes of tools/ share (`forward_probe`)."""
