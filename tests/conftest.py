import pytest
import torch


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA Hopper GPU (sm_90)")
    for item in items:
        if "gpu" in item.keywords and not _hopper():
            item.add_marker(skip)
