"""Helpers shared by the test modules (`from helpers import ...`; the fixtures live in conftest.py): the
test process settings, safety timeouts, a tiny real tokenizer and model saved to disk, sample text, and the
device parametrization. Importing this module applies the settings (offline Hub, one torch thread), also
in the worker processes the distributed tests start."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

#: Timeouts in tests are safety nets against a hang, never speed checks: each is a base figure (a few
#: times what the run takes alone on 2 quiet cores) times this factor, so that a loaded machine (CI
#: sharing its cores, several suites at once) makes a test slower, not red. Set it lower to find hangs
#: sooner on a quiet machine.
TIMEOUT_SCALE = float(os.environ.get("OCCULT_FT_TEST_TIMEOUT_SCALE", "6"))


def load_benchmark(name: str):
    """The script benchmarks/NAME.py as a module (the scripts are not a package), for tests of its `main`."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def safety_timeout(seconds: float) -> float:
    """`seconds` (the base figure) times `TIMEOUT_SCALE`: the timeout a test gives a subprocess."""
    return seconds * TIMEOUT_SCALE


SAMPLE_TEXT = """It was the best of times, it was the worst of times, it was the age of wisdom.
def add(a, b):
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b

The quick brown fox jumps over the lazy dog near the river bank.
class Stack:
    def push(self, item):
        self.items.append(item)
Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse.
"""


def build_tokenizer(vocab_size: int = 128):
    """A byte-level BPE tokenizer with `vocab_size` entries trained on SAMPLE_TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def save_tiny_model(path, model_type: str = "olmoe", tokenizer=None, seed: int = 0, **overrides) -> str:
    from transformers import AutoModelForCausalLM

    from occult_ft.models import tiny_config

    torch.manual_seed(seed)
    tokenizer = tokenizer or build_tokenizer()
    cfg = tiny_config(model_type, vocab_size=len(tokenizer), **overrides)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _cuda_param():
    return pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU test)"),
        ],
    )


#: parametrize a test over devices: `@pytest.mark.parametrize("device", DEVICES)`; the CUDA case carries
#: the `gpu` marker (`make test-gpu` runs only those) and skips cleanly without a GPU
DEVICES = ["cpu", _cuda_param()]
