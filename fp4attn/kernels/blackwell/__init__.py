"""The sm_100/103 and sm_120/121 (Blackwell) kernels and their launchers."""
