"""An int8 copy of the embedding model, built once from the float model and checked against it.

onnxruntime's dynamic quantization stores the MatMul weights as int8, one scale per output
channel, and quantizes activations on the fly. Measured on this 2-core machine over 200
README sentences: 9.7 ms of CPU a document against 21.1 ms for the float model, cosine to
the float vectors 0.986 at worst, 0.993 on average. One scale per tensor was as fast but
agreed far less (0.92 at worst), and quantizing the other operators as well (not only the
MatMuls) agreed a little less (0.982) for no speed, hence the two options below.

The copy lives in the data directory and is built at the first start that asks for it
(about a second). It is used only after its vectors for a fixed set of sentences agree with
the float model's; the agreement is kept beside it as the proof. Its vectors differ from the
float model's, so they go to a collection of their own (engine.collection_name).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

from memory.index.embeddings import MODEL_FILES, LocalEmbedder, missing_files, onnx_dir
from memory.storage.file_modes import private_dir, private_tree

FOLDER = "all-MiniLM-L6-v2-int8"
CHECK_FILE = "agreement.json"
MIN_COSINE = 0.97  # worst agreement accepted on CHECK_SENTENCES (measured: 0.98 and up)
# Short and long, chat-like and technical: what the index holds.
CHECK_SENTENCES = (
    "What did Alice say about the payments deploy?",
    "My sister Priya is visiting on the 14th, so I'll be offline that weekend.",
    "The `resolve_token` function fails when the session cache is empty; fixed in v2.3.",
    "We agreed to move the ingest pipeline from Kafka to Postgres by next Friday.",
    "Latency of the search service went from 120 ms to 45 ms after the index change.",
    "I prefer Rust over Go for anything touching the hot path, mostly for the memory control.",
    "Can you remind me what budget we set for the billing dashboard this quarter?",
    "def flush(queue, retries=3):\n    for item in queue:\n        save(item)",
    "I went hiking with my dog last weekend and we got caught in the rain near the lake.",
    "Thanks! That worked.",
    "Set MEMPROXY_VECTOR_CACHE_MB to 512 in the config, not 128, or recall reloads users.",
    "Caroline said the adoption agency called back and the interview is set for June.",
)

log = logging.getLogger(f"memproxy.{__name__}")


class QuantizedModelRejected(Exception):
    """The int8 model could not be built, or its vectors disagree with the float model's."""


def int8_model_dir(float_dir: Path, data_dir: Path) -> Path:
    """The folder of the checked int8 model under `data_dir`, built from `float_dir` if absent."""
    target = data_dir / "models" / FOLDER
    if not missing_files(target) and (target / CHECK_FILE).is_file():
        return target
    private_dir(target.parent)  # under the data directory: 0700 (storage/file_modes.py)
    # Built and checked in a scratch folder, moved into place only once accepted, so an
    # interrupted build or a rejected model never looks usable on the next start.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        built = Path(scratch) / "model"
        built.mkdir()
        quantize(onnx_dir(float_dir), built)
        worst, mean = agreement(onnx_dir(float_dir), built)
        if worst < MIN_COSINE:
            raise QuantizedModelRejected(
                f"the int8 model agrees with the float model at cosine {worst:.4f} at worst "
                f"(needs {MIN_COSINE}); using it would change recall"
            )
        (built / CHECK_FILE).write_text(json.dumps({
            "min_cosine": round(worst, 5), "mean_cosine": round(mean, 5),
            "sentences": len(CHECK_SENTENCES),
        }))
        private_tree(built)
        shutil.rmtree(target, ignore_errors=True)
        built.rename(target)
    log.info("built the int8 embedding model in %s (cosine to float: min %.4f, mean %.4f)",
             target, worst, mean)
    return target


def quantize(float_dir: Path, out: Path) -> None:
    """Write an int8 model.onnx and the tokenizer files beside it into `out`."""
    # Imported here: it pulls in the onnx package, which only this one-off build needs.
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    # The quantizer advises "pre-processing" on the root logger at every run; the graph is
    # already optimised by onnxruntime at load, so the advice only confuses a first start.
    root.addFilter(_quantizer_advice)
    try:
        quantize_dynamic(
            float_dir / "model.onnx", out / "model.onnx", weight_type=QuantType.QInt8,
            per_channel=True, op_types_to_quantize=["MatMul"],
        )
    except Exception as exc:  # onnx's and onnxruntime's own errors, whatever they are
        raise QuantizedModelRejected(f"quantizing {float_dir / 'model.onnx'} failed: {exc}") from exc
    finally:
        root.removeFilter(_quantizer_advice)
    for name in MODEL_FILES:
        if name != "model.onnx":
            shutil.copyfile(float_dir / name, out / name)


def _quantizer_advice(record: logging.LogRecord) -> bool:
    return "onnxruntime" not in record.pathname or "pre-processing" not in record.getMessage()


def agreement(float_dir: Path, int8_dir: Path) -> tuple[float, float]:
    """Worst and mean cosine between the two models' vectors of CHECK_SENTENCES."""
    reference = LocalEmbedder(float_dir, threads=1).embed_sync(CHECK_SENTENCES)
    candidate = LocalEmbedder(int8_dir, threads=1).embed_sync(CHECK_SENTENCES)
    cosine = np.sum(reference * candidate, axis=1)
    return float(cosine.min()), float(cosine.mean())
