"""Shared fixtures: tiny real models saved to disk with a real (tiny) tokenizer, small text data, the
device parametrization. The helpers they use, which test modules import too, are in tests/helpers.py."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, SAMPLE_TEXT, build_tokenizer, save_tiny_model  # also applies the test settings


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sample.txt"
    path.write_text("\n\n".join([SAMPLE_TEXT] * 6))
    return str(path)


@pytest.fixture(scope="session")
def tiny_olmoe_dir(tmp_path_factory, tiny_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("olmoe"), "olmoe", tiny_tokenizer)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)
