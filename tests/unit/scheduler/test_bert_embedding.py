"""Our packed BERT encoder must reproduce sentence-transformers' all-MiniLM-L6-v2 embeddings."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from meshlm.scheduler.model_loader import iterate_weights
from meshlm.scheduler.models.bert import BertModel, find_minilm_path

LONG = " ".join(
    [
        "The scheduler packs the tokens of many requests back to back into a single tensor,",
        "so an encoder must keep every request's attention inside its own span of tokens,",
        "and the pooling step must average only over the tokens that belong to one request.",
    ]
    * 4
)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "El zorro marrón rápido salta sobre el perro perezoso.",
    "敏捷的棕色狐狸跳过了懒狗。",
    LONG,
]


@pytest.fixture(scope="module")
def minilm_dir():
    return find_minilm_path()


@pytest.fixture(scope="module")
def model(minilm_dir):
    config = json.loads((minilm_dir / "config.json").read_text())
    bert = BertModel(config, torch.float32).eval()
    loaded = bert.load_weights(iterate_weights(minilm_dir, progress=False))
    assert loaded == {name for name, _ in bert.named_parameters()}
    return bert


def _packed_batch(lists: list[list[int]]) -> ForwardBatch:
    lens = [len(ids) for ids in lists]
    input_ids = torch.tensor([t for ids in lists for t in ids], dtype=torch.long)
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lens])
    return ForwardBatch(
        forward_mode=ForwardMode.EMBED,
        batch_size=len(lists),
        input_ids=input_ids,
        positions=positions,
        seq_lens=torch.tensor(lens, dtype=torch.long),
        req_pool_indices=torch.arange(len(lists), dtype=torch.long),
        out_cache_loc=None,
        seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * len(lists),
        extend_seq_lens_cpu=lens,
    )


def test_packed_forward_matches_sentence_transformers(minilm_dir, model) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir), local_files_only=True)
    lists = [tokenizer(s)["input_ids"] for s in SENTENCES]
    lens = [len(ids) for ids in lists]
    assert 180 <= lens[-1] < 256, lens  # long, yet under sentence-transformers' truncation
    batch = _packed_batch(lists)

    ours = model(batch.input_ids, batch.positions, batch)
    assert ours.shape == (len(SENTENCES), 384)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(SENTENCES)))

    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    expected = torch.from_numpy(reference.encode(SENTENCES, batch_size=len(SENTENCES)))
    cosine = torch.nn.functional.cosine_similarity(ours, expected.float(), dim=1)
    assert bool((cosine >= 0.9999).all()), cosine.tolist()


def test_packing_does_not_leak_between_requests(model, minilm_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir), local_files_only=True)
    lists = [tokenizer(s)["input_ids"] for s in SENTENCES[:3]]
    together = _packed_batch(lists)
    packed = model(together.input_ids, together.positions, together)
    for i, ids in enumerate(lists):
        alone = _packed_batch([ids])
        single = model(alone.input_ids, alone.positions, alone)
        torch.testing.assert_close(packed[i : i + 1], single, atol=1e-5, rtol=1e-5)


def test_bad_lengths_rejected(model) -> None:
    batch = _packed_batch([[101, 7592, 102]])
    batch.extend_seq_lens_cpu = [2]
    with pytest.raises(ValueError, match="sum to the 3 packed tokens"):
        model(batch.input_ids, batch.positions, batch)
