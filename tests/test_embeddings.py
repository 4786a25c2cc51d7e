"""Local embeddings: same vectors as chromadb's default function, cheaper padding, offline."""

from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from chromadb.utils.embedding_functions.onnx_mini_lm_l6_v2 import ONNXMiniLM_L6_V2
from tokenizers import Tokenizer

from memory.index.embeddings import (
    DIMENSION,
    MAX_BATCH_TOKENS,
    MAX_TOKENS,
    MODEL_FILES,
    EmbeddingModelMissing,
    LocalEmbedder,
    _batches,
    download_model,
    find_model_dir,
    session_options,
)

SHARED_MODEL = Path(__file__).parents[1].parent / "shared/models/all-MiniLM-L6-v2"

TEXTS = [
    "hi",
    "",
    "The user prefers TypeScript for new projects and uses pnpm.",
    "Ünïcödé, 日本語のテキスト and an emoji 🚀 in one line.",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    " ".join(f"sentence {i} talks about memory, recall and budgets." for i in range(80)),
    "A medium paragraph. " * 12,
]


@pytest.fixture(scope="module")
def embedder() -> LocalEmbedder:
    return LocalEmbedder(SHARED_MODEL, threads=2)


@pytest.fixture(scope="module")
def chroma_function() -> ONNXMiniLM_L6_V2:
    function = ONNXMiniLM_L6_V2(preferred_providers=["CPUExecutionProvider"])
    # The class looks for <DOWNLOAD_PATH>/onnx/*; pointing the instance at the shared model
    # makes it skip its download entirely.
    function.DOWNLOAD_PATH = SHARED_MODEL
    return function


def test_matches_chromadb_default_function(
    embedder: LocalEmbedder, chroma_function: ONNXMiniLM_L6_V2
) -> None:
    untruncated = Tokenizer.from_file(str(SHARED_MODEL / "onnx/tokenizer.json"))
    untruncated.no_truncation()
    untruncated.no_padding()
    assert len(untruncated.encode(TEXTS[5]).ids) > 256  # exercises truncation

    ours = embedder.embed_sync(TEXTS)
    theirs = np.asarray(chroma_function(TEXTS), dtype=np.float32)

    assert ours.dtype == np.float32
    assert ours.shape == (len(TEXTS), DIMENSION)
    assert float(np.abs(ours - theirs).max()) < 1e-5
    assert float((ours * theirs).sum(axis=1).min()) > 0.99999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_batching_preserves_order(embedder: LocalEmbedder) -> None:
    one_by_one = np.stack([embedder.embed_sync([text])[0] for text in TEXTS])
    small_batches = LocalEmbedder(SHARED_MODEL, batch_size=2, threads=1)

    assert np.abs(small_batches.embed_sync(TEXTS) - one_by_one).max() < 1e-5
    reversed_texts = TEXTS[::-1]
    assert np.abs(embedder.embed_sync(reversed_texts) - one_by_one[::-1]).max() < 1e-5


def test_batches_side_by_side_match_one_session(embedder: LocalEmbedder) -> None:
    # One text is one batch, run on the two-thread session: the module's embedder does that
    # as a fresh one would, without loading the model again for each text.
    one_by_one = np.stack([embedder.embed_sync([text])[0] for text in TEXTS])
    spread = LocalEmbedder(SHARED_MODEL, batch_size=2, threads=2)
    assert np.abs(spread.embed_sync(TEXTS) - one_by_one).max() < 1e-5
    assert spread._single is not None  # the batches ran on the one-thread session


def test_batches_mix_only_similar_lengths() -> None:
    lengths = [12, 300, 11, 40, 13, 44, 41, 12, 250, 12]
    batches = _batches(lengths, 3)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert [[lengths[i] for i in batch] for batch in batches] == [
        [11, 12, 12], [12, 13], [40, 41, 44], [250], [300],
    ]
    assert all(len(batch) <= 3 for batch in batches)


def test_a_batch_of_long_texts_is_bounded_in_tokens() -> None:
    """A huge message's chunks run a few at a time: a run's memory grows with its rows
    times its width squared (memory/index/embeddings.py, MAX_BATCH_TOKENS)."""
    lengths = [MAX_TOKENS] * 100 + [30] * 64
    batches = _batches(lengths, 32)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert all(len(batch) * max(lengths[i] for i in batch) <= MAX_BATCH_TOKENS for batch in batches)
    assert [len(b) for b in batches if lengths[b[0]] == 30] == [32, 32]  # short ones as before
    assert len(batches) == 2 + -(-100 // (MAX_BATCH_TOKENS // MAX_TOKENS))


def test_long_batches_give_the_same_vectors(embedder: LocalEmbedder) -> None:
    """Bounded batches, and the runs that hand their memory back, change no vector."""
    # One text more than a bounded batch holds: two batches, run side by side.
    long_texts = [f"note {i}: " + "the billing service runs Postgres 16 " * 40
                  for i in range(MAX_BATCH_TOKENS // MAX_TOKENS + 1)]
    together = embedder.embed_sync(long_texts)
    alone = np.stack([embedder.embed_sync([text])[0] for text in long_texts])
    assert np.abs(together - alone).max() < 1e-5


def test_duplicates_get_identical_vectors(embedder: LocalEmbedder) -> None:
    vectors = embedder.embed_sync(["same text", "other", "same text"])
    assert np.array_equal(vectors[0], vectors[2])


def test_empty_input(embedder: LocalEmbedder) -> None:
    vectors = embedder.embed_sync([])
    assert vectors.shape == (0, DIMENSION)
    assert vectors.dtype == np.float32


async def test_embed_async_matches_sync(embedder: LocalEmbedder) -> None:
    vectors = await embedder.embed(TEXTS[:3])
    assert np.array_equal(vectors, embedder.embed_sync(TEXTS[:3]))


def test_accepts_the_onnx_folder_itself() -> None:
    embedder = LocalEmbedder(SHARED_MODEL / "onnx", threads=1)
    assert embedder.dimension == DIMENSION
    assert embedder.embed_sync(["hello"]).shape == (1, DIMENSION)


def test_session_options_do_not_spin() -> None:
    options = session_options(2)
    assert options.intra_op_num_threads == 2
    assert options.inter_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert session_options(None).intra_op_num_threads == 0  # onnxruntime picks: physical cores


# -- locating the model


def test_find_model_dir_uses_configured_folder() -> None:
    assert find_model_dir(SHARED_MODEL) == SHARED_MODEL / "onnx"
    assert find_model_dir(SHARED_MODEL / "onnx") == SHARED_MODEL / "onnx"


def test_find_model_dir_names_a_bad_configured_folder(tmp_path: Path) -> None:
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "model.onnx").write_bytes(b"")
    with pytest.raises(EmbeddingModelMissing, match=str(tmp_path)) as caught:
        find_model_dir(tmp_path)
    assert "MEMPROXY_EMBEDDING_MODEL_DIR" in str(caught.value)
    assert "tokenizer.json" in str(caught.value)


def test_find_model_dir_uses_chromadb_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / ".cache/chroma/onnx_models/all-MiniLM-L6-v2/onnx"
    cache.mkdir(parents=True)
    for name in MODEL_FILES:
        (cache / name).symlink_to(SHARED_MODEL / "onnx" / name)
    monkeypatch.setenv("HOME", str(tmp_path))

    assert find_model_dir(None) == cache


def test_find_model_dir_names_the_setting_when_the_cache_is_unusable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A HOME that is a file fails before any download is attempted, even for root.
    home = tmp_path / "not-a-folder"
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))

    with pytest.raises(EmbeddingModelMissing, match="MEMPROXY_EMBEDDING_MODEL_DIR"):
        find_model_dir(None)


# -- downloading, against a server on 127.0.0.1 only


@pytest.fixture
def archive_server() -> Iterator[tuple[str, dict[str, bytes]]]:
    """Serve bytes put in the returned dict at http://127.0.0.1:<port>/<name>."""
    served: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = served.get(self.path.lstrip("/"))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _fake_archive() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in MODEL_FILES:
            data = f"fake {name}".encode()
            info = tarfile.TarInfo(f"onnx/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_download_verifies_and_unpacks(
    tmp_path: Path, archive_server: tuple[str, dict[str, bytes]]
) -> None:
    base, served = archive_server
    served["onnx.tar.gz"] = archive = _fake_archive()

    download_model(tmp_path, url=f"{base}/onnx.tar.gz", sha256=hashlib.sha256(archive).hexdigest())

    assert sorted(p.name for p in (tmp_path / "onnx").iterdir()) == sorted(MODEL_FILES)
    assert [p.name for p in tmp_path.iterdir()] == ["onnx"]  # no scratch left behind


def test_download_rejects_a_bad_checksum(
    tmp_path: Path, archive_server: tuple[str, dict[str, bytes]]
) -> None:
    base, served = archive_server
    served["onnx.tar.gz"] = _fake_archive()

    with pytest.raises(EmbeddingModelMissing, match="SHA256"):
        download_model(tmp_path, url=f"{base}/onnx.tar.gz", sha256="0" * 64)
    assert list(tmp_path.iterdir()) == []


def test_download_failure_names_the_setting(
    tmp_path: Path, archive_server: tuple[str, dict[str, bytes]]
) -> None:
    base, _ = archive_server
    with pytest.raises(EmbeddingModelMissing, match="MEMPROXY_EMBEDDING_MODEL_DIR"):
        download_model(tmp_path, url=f"{base}/missing.tar.gz")
    assert list(tmp_path.iterdir()) == []
