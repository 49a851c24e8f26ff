"""Load models by short name, path or hub id; save and reload patched models.

One module per job: ``loading`` (names → folders, devices, ``load_model`` re-applying a saved patch, the
tokenizer, configs and the training window), ``saving`` (the transformers export: ``save_patched``,
``save_adapter``, the patch as ``rope_parameters``), ``fingerprints`` (what identifies the weights). This
package face re-exports their public names: ``ropescale.models.load_model`` and the rest are where they
were.
"""

from __future__ import annotations

from .fingerprints import model_fingerprint, weights_fingerprint
from .loading import (
    ADAPTER_FILE,
    DTYPES,
    MODEL_ALIASES,
    PATCH_FILE,
    REFERENCE_MODEL,
    ModelLoadError,
    adapter_base,
    load_model,
    load_tokenizer,
    model_config,
    model_rope_config,
    model_training_window,
    resolve_device,
    resolve_model,
)
from .loading import (
    model_training_length as model_training_length,  # model_training_window's old name, kept for old code
)
from .saving import MARKER, exported_config, native_rope_parameters, save_adapter, save_patched, save_unexpressed

__all__ = [
    "ADAPTER_FILE",
    "DTYPES",
    "MARKER",
    "MODEL_ALIASES",
    "PATCH_FILE",
    "REFERENCE_MODEL",
    "ModelLoadError",
    "adapter_base",
    "exported_config",
    "load_model",
    "load_tokenizer",
    "model_config",
    "model_fingerprint",
    "model_rope_config",
    "model_training_window",
    "native_rope_parameters",
    "resolve_device",
    "resolve_model",
    "save_adapter",
    "save_patched",
    "save_unexpressed",
    "weights_fingerprint",
]
