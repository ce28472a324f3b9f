"""`EmbeddingGradientReducer` (occult_ft/trainer/embedding_grad.py): the input embedding's gradient
reduced apart from DDP, against the plain reference (every rank's accumulated gradient all-reduced and
divided by W, as DDP leaves it), on 2 and 3 gloo processes, with 1 and 3 micro-batches per step,
ranks holding different token counts, repeated tokens, a padding row, and both ways of sending the
last micro-batch (gathered rows, one per distinct token; the dense table when that is fewer bytes);
every rank must end with the same bits, as an all-reduce leaves them. Which embeddings it may take is
checked on real tiny models (tied, frozen, customised ones are left to DDP)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

try:
    from .dist_utils import run_distributed
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import run_distributed

from occult_ft.trainer.embedding_grad import add_rows, gather_is_cheaper, reducible_embedding, sum_by_id

TOL = 1e-6


def test_gather_is_cheaper_compares_bytes_received():
    # W=2, V=128, H=64, fp32: the ring moves 2 * 1/2 * 128 * 64 * 4 = 32,768 bytes; a row 264
    assert gather_is_cheaper(124, 2, 128, 64, 4)  # 32,736
    assert not gather_is_cheaper(125, 2, 128, 64, 4)  # 33,000
    # fine-tuning sizes: 4 ranks x 8k tokens against a 150k x 4096 bf16 table: rows; 64 ranks: the table
    assert gather_is_cheaper(8192, 4, 151_936, 4096, 2)
    assert not gather_is_cheaper(8192, 64, 151_936, 4096, 2)
    assert not gather_is_cheaper(1, 1, 128, 64, 4)  # one rank: nothing to send either way


def test_add_rows_sums_repeated_ids_as_index_add_does():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(10, 4, generator=gen)
    ids = torch.tensor([3, 7, 3, 0, 9, 3, 7])
    rows = torch.randn(7, 4, generator=gen)
    want = table.clone().index_add_(0, ids, rows)
    got = add_rows(table.clone(), ids, rows)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(add_rows(table.clone(), ids[:0], rows[:0]), table)  # nothing to add
    # the rows of one id are summed in their given order, whatever else the batch holds
    order = torch.tensor([3, 3, 3])
    assert torch.equal(add_rows(torch.zeros(10, 4), order, rows[:3])[3], rows[0] + rows[1] + rows[2])


def test_sum_by_id_gives_each_id_once_with_its_rows_summed_in_order():
    gen = torch.Generator().manual_seed(1)
    ids = torch.tensor([5, 2, 5, 9, 2, 5])
    rows = torch.randn(6, 3, generator=gen)
    ids_U, sums_UH = sum_by_id(ids, rows)
    assert ids_U.tolist() == [2, 5, 9]
    for u, i in enumerate(ids_U.tolist()):  # the reference: a loop over the rows in their given order
        want = torch.zeros(3)
        for m in range(6):
            if int(ids[m]) == i:
                want = want + rows[m]
        assert torch.equal(sums_UH[u], want), i
    empty_ids, empty_rows = sum_by_id(ids[:0], rows[:0])
    assert empty_ids.numel() == 0 and empty_rows.shape == (0, 3)


def _tiny(**overrides):
    from transformers import AutoModelForCausalLM

    from occult_ft.models.tiny import tiny_config

    config = tiny_config("olmoe")
    config.update(overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_reducible_embedding_takes_only_a_plain_untied_trainable_table():
    model = _tiny()
    found = reducible_embedding(model)
    assert found is not None and found[0] == "model.embed_tokens.weight"
    assert found[1] is model.get_input_embeddings()
    assert reducible_embedding(_tiny(tie_word_embeddings=True)) is None  # the LM head adds its own gradient
    frozen = _tiny()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert reducible_embedding(frozen) is None

    class Scaled(nn.Embedding):  # as Gemma's: the output is not the table's rows
        def forward(self, ids):
            return super().forward(ids) * 2.0

    scaled = _tiny()
    old = scaled.get_input_embeddings()
    scaled.set_input_embeddings(Scaled(old.num_embeddings, old.embedding_dim))
    assert reducible_embedding(scaled) is None
    for option in (dict(max_norm=1.0), dict(scale_grad_by_freq=True)):
        odd = _tiny()
        odd.set_input_embeddings(nn.Embedding(old.num_embeddings, old.embedding_dim, **option))
        assert reducible_embedding(odd) is None, option


def _rows(step: int, micro: int, rank: int, length: int, vocab: int, every_id: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, vocab, (2, length + rank), generator=gen)  # ranks hold different counts
    ids[:, 0] = 5  # a token repeated within the micro-batch: its rows are summed before sending
    ids[:, -1] = 0  # the padding row (pad_token_id 0) appears, and gets no gradient
    if every_id:  # every token of the vocabulary appears: its distinct rows outweigh the table
        middle = ids[:, 1:-1].reshape(-1)
        middle[:vocab] = torch.randperm(vocab, generator=gen)
        ids[:, 1:-1] = middle.view(2, -1)
    return ids


def _case(rank: int, world: int, accum: int, length: int, every_id: bool, steps: int = 3) -> dict:
    import torch.distributed as dist

    from occult_ft.trainer.embedding_grad import EmbeddingGradientReducer

    apart, reference = _tiny(), _tiny()
    reducer = EmbeddingGradientReducer(reducible_embedding(apart)[1])
    vocab = apart.config.vocab_size
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (apart, reference)]
    worst, modes, bits = 0.0, [], []
    for step in range(steps):
        for model in (apart, reference):
            for micro in range(accum):
                last = micro == accum - 1
                if model is apart:
                    reducer.before(last)
                ids = _rows(step, micro, rank, length, vocab, every_id)
                (model(input_ids=ids, labels=ids).loss / accum).backward()
                if model is apart:
                    reducer.after(last)
            for name, p in model.named_parameters():  # DDP's part: a plain average
                if p.grad is not None and (model is reference or "embed_tokens" not in name):
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
        modes.append(reducer.last_mode)
        emb_a, emb_r = apart.get_input_embeddings().weight, reference.get_input_embeddings().weight
        bits.append(hashlib.sha256(emb_a.grad.numpy().tobytes()).hexdigest())  # equal on every rank
        assert emb_a.grad is not None and emb_r.grad is not None
        assert float(emb_r.grad[0].abs().max()) == 0.0  # the padding row
        worst = max(worst, float((emb_a.grad - emb_r.grad).abs().max() / emb_r.grad.abs().max()))
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    weights = float(
        (apart.get_input_embeddings().weight - reference.get_input_embeddings().weight).abs().max()
    )
    reducer.remove()
    return {"worst": worst, "modes": modes, "weights": weights, "bits": bits}


def _worker(rank: int, world: int, cases: list[tuple[int, int, bool, str]]) -> dict:
    return {
        f"{accum}-{length}-{every_id}": _case(rank, world, accum, length, every_id)
        for accum, length, every_id, _ in cases
    }


# (micro-batches, tokens per row, every id of the vocabulary in each micro-batch, the way expected).
# 2 x 12 tokens are gathered as rows on 2 and 3 ranks; so are 2 x 48 random tokens of the 128-token
# vocabulary (about 60-70 distinct: on 3 ranks as many rows as tokens would have cost more than the
# dense table); with every id present (2 x 80 tokens) the 128 x 64 table is all-reduced (`gather_is_cheaper`)
CASES = [(1, 12, False, "rows"), (3, 12, False, "rows"), (3, 48, False, "rows"), (3, 80, True, "dense")]


@pytest.mark.slow
# 3 ranks in `make test`, 2 in `make test-all` as well
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.extended), 3])
def test_reduced_apart_equals_the_plain_average(world):
    results = run_distributed(_worker, world, CASES, timeout=240.0)
    for rank, per_case in enumerate(results):
        for name, result in per_case.items():
            assert result["worst"] <= TOL, (world, rank, name, result)
            assert result["weights"] <= TOL, (world, rank, name, result)
            expected = {f"{a}-{n}-{e}": way for a, n, e, way in CASES}[name]
            assert result["modes"] == [expected] * 3, (world, rank, name, result)
            # the replicas' gradients are the same bits, as after DDP's all-reduce
            assert result["bits"] == results[0][name]["bits"], (world, rank, name)
