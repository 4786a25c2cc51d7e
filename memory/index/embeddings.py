"""Local sentence embeddings: all-MiniLM-L6-v2 in ONNX, the model chromadb's default function uses.

Vectors match chromadb's `ONNXMiniLM_L6_V2` (truncation to 256 tokens, attention-masked mean
pooling, L2 normalisation), but each batch is padded only to its longest input instead of to
256 tokens, which makes a one-sentence query roughly ten times cheaper.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import httpx
import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from tokenizers import Encoding, Tokenizer

MODEL_NAME = "all-MiniLM-L6-v2"
DIMENSION = 384
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model, as chromadb uses
PAD_SLACK = 1.1  # longest row of a batch over its shortest (+4 tokens), see _batches
# Most tokens (rows x padded width) one run of the model takes. onnxruntime's memory for a
# run grows with rows x width^2 (attention): 32 rows of 256 tokens peaked at 1.17 GB of RSS
# for a 2 MB message's 100 chunks, 8 rows at 0.58 GB (docs/benchmarks.md, "Large messages").
# Short texts still go 32 to a batch.
MAX_BATCH_TOKENS = 8 * MAX_TOKENS
# A run larger than this hands the memory it took back to the system when it ends:
# onnxruntime's arena otherwise keeps its peak for the life of the process. Smaller runs (a
# recall query) keep the arena warm: shrinking it after each of them cost 0.5 ms a query.
RELEASE_OVER_TOKENS = 2 * MAX_TOKENS
MODEL_FILES = (
    "config.json",
    "model.onnx",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
)
# Same archive and checksum as chromadb's ONNXMiniLM_L6_V2 (onnx_mini_lm_l6_v2.py), so a
# machine with internet ends up with exactly the files chromadb itself would download.
ARCHIVE_URL = "https://chroma-onnx-models.s3.amazonaws.com/all-MiniLM-L6-v2/onnx.tar.gz"
ARCHIVE_SHA256 = "913d7300ceae3b2dbc2c50d1de4baacab4be7b9380491c27fab7418616a16ec3"
SETTING_NAME = "MEMPROXY_EMBEDDING_MODEL_DIR"

Vectors = npt.NDArray[np.float32]
Embed = Callable[[Sequence[str]], Awaitable[Vectors]]  # texts in, one unit vector a row out

log = logging.getLogger(f"memproxy.{__name__}")  # under memproxy: configure_logging formats it


class EmbeddingModelMissing(Exception):
    """The embedding model files are not on this machine and could not be fetched."""


def onnx_dir(model_dir: Path) -> Path:
    """Return the folder holding the model files, given it or its parent."""
    nested = model_dir / "onnx"
    return nested if nested.is_dir() else model_dir


def missing_files(model_dir: Path) -> list[str]:
    """Return the names of model files absent from `model_dir` (or its `onnx/`)."""
    folder = onnx_dir(model_dir)
    return [name for name in MODEL_FILES if not (folder / name).is_file()]


def find_model_dir(configured: Path | None) -> Path:
    """Return the folder holding the model: configured, chromadb's cache, or a fresh download."""
    if configured is not None:
        absent = missing_files(configured)
        if absent:
            raise EmbeddingModelMissing(
                f"{SETTING_NAME}={configured} does not hold the {MODEL_NAME} ONNX model "
                f"(missing: {', '.join(absent)})"
            )
        return onnx_dir(configured)
    # chromadb's own cache folder for this model (it holds an `onnx/` folder).
    cache = Path.home() / ".cache" / "chroma" / "onnx_models" / MODEL_NAME
    if not missing_files(cache):
        return onnx_dir(cache)
    log.warning("%s not found in %s; downloading chromadb's copy", MODEL_NAME, cache)
    try:
        download_model(cache)
    except (OSError, tarfile.TarError) as exc:
        raise EmbeddingModelMissing(
            f"could not store the {MODEL_NAME} model in {cache} ({exc}); "
            f"set {SETTING_NAME} to a folder holding its onnx/ files"
        ) from exc
    return onnx_dir(cache)


def download_model(cache: Path, *, url: str = ARCHIVE_URL, sha256: str = ARCHIVE_SHA256) -> None:
    """Fetch chromadb's model archive into `cache`, verify its checksum and unpack it."""
    cache.mkdir(parents=True, exist_ok=True)
    # Everything lands in a scratch folder first and moves into place only once verified and
    # complete, so an interrupted download never looks like a usable model on the next start.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
        archive = Path(scratch) / "onnx.tar.gz"
        with archive.open("wb") as out:
            digest = _stream_to(url, out)
        if digest != sha256:
            raise EmbeddingModelMissing(
                f"downloaded {url} has SHA256 {digest}, expected {sha256}; "
                f"set {SETTING_NAME} to a folder holding the {MODEL_NAME} ONNX model"
            )
        with tarfile.open(archive, mode="r:gz") as tar:
            tar.extractall(scratch, filter="data")
        unpacked = Path(scratch) / "onnx"  # the archive holds one top-level onnx/ folder
        absent = missing_files(unpacked)
        if absent:
            raise EmbeddingModelMissing(f"archive from {url} lacks {', '.join(absent)}")
        target = cache / "onnx"
        shutil.rmtree(target, ignore_errors=True)
        unpacked.rename(target)


def _stream_to(url: str, out: BinaryIO) -> str:
    """Write the body at `url` to the binary file `out`; return its SHA256."""
    digest = hashlib.sha256()
    try:
        with httpx.stream("GET", url, timeout=30.0, follow_redirects=True) as resp:
            resp.raise_for_status()
            for block in resp.iter_bytes():
                digest.update(block)
                out.write(block)
    except httpx.HTTPError as exc:
        raise EmbeddingModelMissing(
            f"the {MODEL_NAME} embedding model is not on this machine and downloading it "
            f"failed ({exc!r}); set {SETTING_NAME} to a folder holding its onnx/ files"
        ) from exc
    return digest.hexdigest()


class UnavailableEmbedder:
    """Stands in for a model that could not be loaded: every call raises why."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """Raise the error that kept the model from loading."""
        raise EmbeddingModelMissing(f"the embedding model is unavailable: {self.error}")


class LocalEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings on the CPU through onnxruntime."""

    def __init__(
        self, model_dir: Path, *, batch_size: int = 32, threads: int | None = None
    ) -> None:
        folder = onnx_dir(model_dir)
        absent = missing_files(folder)
        if absent:
            raise EmbeddingModelMissing(f"{folder} lacks {', '.join(absent)}")
        self._batch_size = max(1, batch_size)
        # Truncating like chromadb and leaving padding to us: tokenizer.json ships fixed
        # padding to 128 and truncation at 128; chromadb overrides both.
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tokenizer.enable_truncation(max_length=MAX_TOKENS)
        self._tokenizer.no_padding()
        self._model = folder / "model.onnx"
        self._session = self._load(threads)
        self._inputs = {node.name for node in self._session.get_inputs()}
        self._output = self._session.get_outputs()[0].name
        # Several batches (an index job's turns) run side by side, one thread each, on a
        # one-thread session of their own: see _run_spread. Loaded now, with the other, so
        # its memory is part of the start and not growth under the first index jobs.
        self._workers = max(1, threads or os.cpu_count() or 1)
        self._single: ort.InferenceSession | None = self._load(1) if self._workers > 1 else None
        self._release = release_options()

    @property
    def dimension(self) -> int:
        """Length of every vector this model returns."""
        return DIMENSION

    def embed_sync(self, texts: Sequence[str]) -> Vectors:
        """Embed `texts` into unit vectors, shape (len(texts), 384), in input order."""
        result = np.zeros((len(texts), DIMENSION), dtype=np.float32)
        if not texts:
            return result
        encodings = self._tokenizer.encode_batch(list(texts))
        batches = _batches([len(e.ids) for e in encodings], self._batch_size)
        if len(batches) == 1 or self._workers == 1:
            for picked in batches:
                result[picked] = self._run(self._session, [encodings[i] for i in picked])
        else:
            self._run_spread(batches, encodings, result)
        return result

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """Embed `texts` in a worker thread so the event loop keeps serving."""
        return await asyncio.to_thread(self.embed_sync, list(texts))

    def _run_spread(
        self, batches: list[list[int]], encodings: list[Encoding], result: Vectors
    ) -> None:
        """Run the batches on `self._workers` threads at once, one onnxruntime thread each.

        An operator split over two threads waits for the slower one, and without spinning
        (session_options) it also wakes the other for every operator: measured on this 2-core
        box over 400 of bench_recall's index texts, the float model took 16.0-17.5 ms of CPU a
        text on one two-thread session against 14.5 ms as two one-thread runs side by side
        (int8: 8.3-9.1 against 7.6-7.9 ms), and the side-by-side runs never wait on each other.
        """
        session = self._single
        assert session is not None  # loaded at start whenever there is more than one worker
        # Longest first, taken in turn by whichever thread is free: the threads end together.
        ordered = sorted(batches, key=len, reverse=True)
        pool = ThreadPoolExecutor(min(self._workers, len(batches)), thread_name_prefix="embed")
        try:
            runs = pool.map(
                lambda picked: self._run(session, [encodings[i] for i in picked]), ordered
            )
            for picked, vectors in zip(ordered, runs, strict=True):
                result[picked] = vectors
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, the batches not begun never run

    def _load(self, threads: int | None) -> ort.InferenceSession:
        return ort.InferenceSession(
            str(self._model), sess_options=session_options(threads),
            providers=["CPUExecutionProvider"],
        )

    def _run(self, session: ort.InferenceSession, batch: list[Encoding]) -> Vectors:
        """Run the model on one batch of encodings; return pooled, normalised vectors."""
        ids, mask = _pad(batch)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        options = self._release if ids.size > RELEASE_OVER_TOKENS else None
        hidden = np.asarray(session.run([self._output], feeds, options)[0], dtype=np.float32)
        return _normalise(_mean_pool(hidden, mask))


def _batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Indexes grouped shortest first into batches whose lengths stay within PAD_SLACK and
    whose padded size stays within MAX_BATCH_TOKENS.

    Every row of a batch costs as much as its longest (padding is computed, then masked), so
    batches mix only similar lengths. Measured on 300 chat turns of 10-300 tokens, one thread:
    batches of up to 64 sorted by length cost 88 ms of CPU a text, of 16 31 ms, of 1 19.8 ms;
    bounded padding 18.8 ms (the int8 model: 47, 16, 8.8 and 9.2 ms).
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    for i in order:
        batch = batches[-1] if batches else None
        if batch is None or len(batch) >= size or lengths[i] > PAD_SLACK * lengths[batch[0]] + 4 \
                or (len(batch) + 1) * lengths[i] > MAX_BATCH_TOKENS:  # the longest row is the last
            batches.append([i])
        else:
            batch.append(i)
    return batches


def session_options(threads: int | None) -> ort.SessionOptions:
    """Return onnxruntime options suited to a small shared CPU box."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    if threads is not None:
        options.intra_op_num_threads = max(1, threads)
    # By default idle worker threads busy-wait for the next run, which on two cores steals
    # CPU from the event loop, SQLite and Chroma between queries.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def release_options() -> ort.RunOptions:
    """Options for a run whose arena memory goes back to the system at its end
    (onnxruntime's `memory.enable_memory_arena_shrinkage` run setting, for the CPU)."""
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


def _pad(batch: list[Encoding]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Pad a batch to its longest encoding; return input ids and attention mask."""
    width = max(len(encoding.ids) for encoding in batch)
    ids = np.zeros((len(batch), width), dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for row, encoding in enumerate(batch):
        ids[row, : len(encoding.ids)] = encoding.ids
        mask[row, : len(encoding.attention_mask)] = encoding.attention_mask
    return ids, mask


def _mean_pool(hidden: Vectors, mask: npt.NDArray[np.int64]) -> Vectors:
    """Average token vectors over real (unmasked) tokens."""
    weights = mask[:, :, np.newaxis].astype(np.float32)
    summed = (hidden * weights).sum(axis=1)
    counts = np.clip(weights.sum(axis=1), 1e-9, None)
    pooled: Vectors = (summed / counts).astype(np.float32)
    return pooled


def _normalise(vectors: Vectors) -> Vectors:
    """Scale rows to unit length; zero rows stay zero (torch's epsilon, as chromadb does)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    norms[norms == 0] = 1e-12
    unit: Vectors = (vectors / norms).astype(np.float32)
    return unit
