"""Helpers of the `bench` command: timing, cuDNN FP8."""
