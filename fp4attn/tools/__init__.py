"""Helpers of the `bench` and `compile-report` commands: timing, cuDNN FP8, machine code."""
