"""Shared pytest set-up: GPU tests skip without CUDA; browser tests skip without chromium."""

import shutil

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_browser = pytest.mark.skip(reason="needs /usr/bin/chromium (apt-get install chromium)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "browser" in item.keywords and shutil.which("chromium") is None:
            item.add_marker(no_browser)
