"""Embeddings through the engine (ForwardMode.EMBED, the scheduler's pools): all-MiniLM-L6-v2
equals sentence-transformers, and a decoder model returns its L2-normalised last hidden state."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from meshlm.scheduler.engine import Engine, RequestError
from meshlm.scheduler.models.bert import find_minilm_path

from .conftest import assert_pools_whole

TEXTS = [
    "The cat sits on the mat.",
    "Le chat est assis sur le tapis, près de la fenêtre ouverte.",
    "東京は日本の首都です。",
    "Ein sehr langer Satz über nichts Besonderes, der nur dazu dient, mehr als sechzehn Tokens zu haben.",
    "🌊 sea waves",
]


def encode_all(engine: Engine, texts: list[str], timeout: float = 60.0) -> torch.Tensor:
    """Submit every text at once (one packed batch); fail instead of hanging on a stuck loop."""

    async def run() -> list[dict]:
        return list(await asyncio.wait_for(asyncio.gather(*(engine.encode(t) for t in texts)), timeout))

    return torch.tensor([r["embedding"] for r in asyncio.run(run())])


@pytest.fixture(scope="module")
def minilm_path() -> str:
    return str(find_minilm_path())


@pytest.fixture(scope="module")
def minilm(minilm_path: str):
    """16-token prefill chunks: an embedding request must still be encoded in one piece."""
    eng = Engine(
        dtype="float32", model_path=minilm_path, max_total_tokens=4096, chunked_prefill_size=16, load_progress=False
    )
    yield eng
    eng.shutdown()


def test_minilm_matches_sentence_transformers(minilm: Engine, minilm_path: str) -> None:
    from sentence_transformers import SentenceTransformer

    assert max(len(minilm.tokenize(t)) for t in TEXTS) > 16
    ours = encode_all(minilm, TEXTS)
    ref = SentenceTransformer(minilm_path, device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    assert ours.shape == ref.shape
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert F.cosine_similarity(ours, ref).min().item() >= 0.9999
    one = encode_all(minilm, TEXTS[3:4])  # alone equals batched
    assert F.cosine_similarity(one, ours[3:4]).item() >= 0.99999
    assert_pools_whole(minilm)


def test_embedding_model_rejects_generate_and_long_inputs(minilm: Engine) -> None:
    with pytest.raises(RequestError) as err:
        minilm.generate_sync("Hello", sampling_params={"max_new_tokens": 4})
    assert err.value.status_code == 400 and "embedding" in err.value.message
    with pytest.raises(RequestError) as err:
        asyncio.run(minilm.encode(input_ids=[1000] * 600))
    assert err.value.status_code == 400 and "600 tokens" in err.value.message
    assert encode_all(minilm, ["still serving"]).shape == (1, 384)
    assert_pools_whole(minilm)


def test_decoder_encode_is_normalised_last_hidden_state(smollm_engine: Engine, hf_smollm) -> None:
    engine = smollm_engine
    story = engine.apply_chat_template([{"role": "user", "content": "Write a short story about a cat."}])
    alone = engine.generate_sync(input_ids=story, sampling_params={"temperature": 0, "max_new_tokens": 12})

    async def mixed() -> list:
        # Embedding and generation requests in flight together (they run in separate batches).
        jobs = [engine.encode(t) for t in TEXTS[:3]]
        jobs.append(engine.generate(input_ids=story, sampling_params={"temperature": 0, "max_new_tokens": 12}))
        return list(await asyncio.gather(*jobs))

    *embs, gen = asyncio.run(mixed())
    assert gen["output_ids"] == alone["output_ids"]
    for text, res in zip(TEXTS, embs):
        ids = engine.tokenize(text)
        assert res["meta_info"]["prompt_tokens"] == len(ids)
        with torch.no_grad():
            batch = torch.tensor([ids], device=hf_smollm.device)
            last = hf_smollm.model(batch).last_hidden_state[0, -1].float().cpu()
        ours = torch.tensor(res["embedding"])
        assert abs(ours.norm().item() - 1.0) < 1e-5
        assert F.cosine_similarity(ours, F.normalize(last, dim=-1), dim=0).item() >= 0.9999
    assert_pools_whole(engine)
