"""The embedded default: a small real-text corpus, its tokenizer and a small OLMoE trained on it.

Shipped inside the package so that every command and test has a real MoE model and real data
without the Hub:

    corpus/train.txt            ~1.7 MB: Austen prose, The Devil's Dictionary, CPython stdlib code
                                and reference text (documents separated by one blank line)
    corpus/eval.txt             ~80 kB held-out passages of the same sources
    corpus/instructions.jsonl   420 Alpaca rows (instruction / input / output) derived from train
    corpus/SOURCES.md           where each source comes from, its license, how it was extracted
    model/                      OlmoeForCausalLM (32 experts, top-4) + PreTrainedTokenizerFast
    model/TRAINING.md           how the model was trained, its losses and routing statistics
    model/training_results.json the same numbers as JSON (with the loss curve)

`scripts/embedded/build_corpus.py` (in the repository, not the installed package) rebuilds the corpus and `scripts/embedded/train_base.py` the tokenizer and model.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EMBEDDED_SPLITS", "embedded_model_path", "embedded_data_path"]

_ROOT = Path(__file__).resolve().parent
EMBEDDED_SPLITS = {"train": "train.txt", "eval": "eval.txt", "instructions": "instructions.jsonl"}
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def embedded_model_path() -> str:
    """Directory of the shipped model and tokenizer (for `from_pretrained`).

    Raises:
        FileNotFoundError: if a file of the model directory is missing (a broken install, or the
            model not built yet: run `python scripts/embedded/train_base.py`).
    """
    model_dir = _ROOT / "model"
    missing = [name for name in _MODEL_FILES if not (model_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"embedded model files {missing} are missing from {model_dir}; reinstall occult_ft "
            "or rebuild them with `python scripts/embedded/train_base.py`"
        )
    return str(model_dir)


def embedded_data_path(split: str = "train") -> str:
    """Path of one file of the shipped corpus.

    Args:
        split: `train` (train.txt), `eval` (eval.txt) or `instructions` (instructions.jsonl).

    Raises:
        ValueError: for another split name.
        FileNotFoundError: if the file is missing (rebuild with `python scripts/embedded/build_corpus.py`).
    """
    if split not in EMBEDDED_SPLITS:
        raise ValueError(f"embedded split {split!r} does not exist; use one of {', '.join(EMBEDDED_SPLITS)}")
    path = _ROOT / "corpus" / EMBEDDED_SPLITS[split]
    if not path.is_file():
        raise FileNotFoundError(
            f"embedded corpus file {path} is missing; reinstall occult_ft or rebuild it with "
            "`python scripts/embedded/build_corpus.py`"
        )
    return str(path)
