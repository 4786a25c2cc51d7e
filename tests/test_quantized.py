"""The int8 embedding model: built once into the data directory, checked against the float
model, and kept in a collection of its own (a change of model re-indexes from the database)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from config import Settings
from memory.engine import MemoryEngine, collection_name
from memory.index.embeddings import LocalEmbedder, UnavailableEmbedder, onnx_dir
from memory.index.quantized import (
    CHECK_FILE,
    CHECK_SENTENCES,
    MIN_COSINE,
    QuantizedModelRejected,
    int8_model_dir,
)
from memory.storage.turns import NewTurn
from tests.conftest import MODEL_DIR

# Out of the fast lane (CONTRIBUTING.md): builds the int8 model.
pytestmark = pytest.mark.slow


def test_built_once_checked_and_close_to_the_float_model(
    tmp_path: Path, embedder: LocalEmbedder
) -> None:
    folder = int8_model_dir(MODEL_DIR, tmp_path)
    assert folder == tmp_path / "models" / "all-MiniLM-L6-v2-int8"
    check = json.loads((folder / CHECK_FILE).read_text())
    assert check["min_cosine"] >= MIN_COSINE and check["sentences"] == len(CHECK_SENTENCES)
    # int8 MatMul weights (the float word-embedding table stays): 58 of 90 MB.
    float_size = (onnx_dir(MODEL_DIR) / "model.onnx").stat().st_size
    assert (folder / "model.onnx").stat().st_size < 0.7 * float_size
    texts = ["Where did we decide to hold the offsite?", "The retry loop in sync_orders never backs off."]
    cosine = np.sum(LocalEmbedder(folder).embed_sync(texts) * embedder.embed_sync(texts), axis=1)
    assert cosine.min() > MIN_COSINE
    built = (folder / "model.onnx").stat().st_mtime_ns
    assert int8_model_dir(MODEL_DIR, tmp_path) == folder
    assert (folder / "model.onnx").stat().st_mtime_ns == built  # reused, not rebuilt


def test_a_model_that_will_not_quantize_is_rejected_and_leaves_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(onnx_dir(MODEL_DIR), broken)
    (broken / "model.onnx").write_bytes(b"not an onnx graph")
    with pytest.raises(QuantizedModelRejected, match="quantizing"):
        int8_model_dir(broken, tmp_path / "data")
    assert list((tmp_path / "data" / "models").iterdir()) == []


async def test_switching_to_int8_indexes_again_into_its_own_collection(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder
) -> None:
    float_settings = make_settings()
    engine = await MemoryEngine.open(float_settings, embedder=embedder)
    try:
        await engine.log.append_turns("ada", "s1", [
            NewTurn("user", "Our offsite is in Porto this year.", created_at=1_700_000_000.0),
            NewTurn("assistant", "Porto, noted.", created_at=1_700_000_001.0),
        ], job_kind="index")
        await engine.worker.run_until_idle(timeout=60)
        assert engine.vectors.count() == 2
    finally:
        await engine.close()

    int8_settings = float_settings.replace(embedding_precision="int8")
    assert collection_name(int8_settings) != collection_name(float_settings)
    engine = await MemoryEngine.open(int8_settings)
    try:
        assert not isinstance(engine.embedder, UnavailableEmbedder)
        assert engine.vectors.name == collection_name(int8_settings)
        # No worker runs here, so /readyz's progress holds still at the jobs left (one batch).
        for _ in range(1000):
            progress = await engine.rebuild.progress()
            if not (progress and progress.endswith("queueing the jobs")):
                break
            await asyncio.sleep(0.01)
        assert progress is not None and progress.endswith("; 1 job(s) left"), progress
        await engine.worker.run_until_idle(timeout=60)
        assert engine.vectors.count() == 2
        assert await engine.rebuild.progress() is None
        vector = (await engine.embedder.embed(["Where is the offsite?"]))[0]
        found = engine.vectors.query(vector, k=1, where={"user_id": "ada"})
        assert found and found[0][1] > 0.5
    finally:
        await engine.close()
