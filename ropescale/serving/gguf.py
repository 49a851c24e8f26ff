"""The GGUF file of a llama.cpp export: its rope metadata, rewritten into a copy of an existing GGUF.

``GgufRope`` holds llama.cpp's ``{arch}.rope.*`` metadata and rope tensors for one served length
(``ropescale.serving.engines.llama_cpp.gguf_rope`` translates a patch into it); ``rewrite_gguf``
writes them into a copy of an existing GGUF (llama.cpp's converter output, say), every other key and
tensor copied unchanged through the ``gguf`` package (llama.cpp's own gguf-py;
``pip install 'ropescale[gguf]'``); ``read_gguf_rope`` reads them back for
``ropescale.serving.engines.llama_cpp.llama_cpp_rope``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ropescale.errors import InvalidInput, RopescaleError
from ropescale.serving.output import same_path, staged
from ropescale.serving.rope import ExportRefused

__all__ = ["DEEPSEEK2_ARCHS", "LLAMA_CPP", "LONGROPE_ARCHS", "ROPE_KEYS", "ROPE_TENSORS", "SWA_ROPE_ARCHS", "GgufRope",
           "GgufUnavailable", "check_arch_layers", "check_arch_reads_tensors", "gguf_module", "read_gguf_rope",
           "rewrite_gguf"]

LLAMA_CPP = "llama-cpp-python 0.3.36"  # whose vendored llama.cpp the rules here were read from

# the metadata that decides llama.cpp's rotation: replaced as a whole by rewrite_gguf
ROPE_KEYS = ("rope.freq_base", "rope.scale_linear", "rope.scaling.type", "rope.scaling.factor",
             "rope.scaling.attn_factor", "rope.scaling.original_context_length", "rope.scaling.yarn_log_multiplier",
             "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast",
             "rope.scaling.yarn_beta_slow")
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
LONGROPE_ARCHS = ("phi3", "phimoe")  # architectures whose llama.cpp graph loads rope_factors_long/short
# architectures whose llama.cpp graph rotates its sliding-window layers at {arch}.rope.freq_base_swa with
# no scaling and the other layers with the rope.* keys (src/models/gemma3.cpp, gemma3n.cpp:
# llama_model::get_rope_freq_base/scale per layer; rope_freq_scale_train_swa stays 1), and passes
# ggml_rope_ext no frequency factors (a rope_freqs tensor is never read)
SWA_ROPE_ARCHS = ("gemma3", "gemma3n")
# architectures of DeepSeek's MLA (src/models/deepseek2.cpp): ``rope.scaling.yarn_log_multiplier`` read (as the
# converter's 0.1·mscale_all_dim, divided back by 0.1), the softmax scale multiplied by mscale², and no
# frequency factors passed to ggml_rope_ext (a rope_freqs tensor is never read)
DEEPSEEK2_ARCHS = ("deepseek2",)


class GgufUnavailable(RopescaleError, ImportError):
    """The optional ``gguf`` package is not installed."""


def gguf_module():
    """gguf-py (llama.cpp's GGUF package); ``GgufUnavailable`` (one line) when not installed."""
    try:
        import gguf
    except ImportError:
        raise GgufUnavailable("writing GGUF files needs the gguf package: pip install 'ropescale[gguf]'") from None
    return gguf


@dataclass
class GgufRope:
    """The rope metadata and tensors of a GGUF for one served length.

    arch: ``general.architecture`` the keys are written for; kv: full key
    (``{arch}.rope.…``) → ``(value, gguf.GGUFValueType)``; tensors: name (``rope_freqs.weight`` …)
    → float32 ``[d/2]`` array; notes: what the export decided and why.
    """

    arch: str
    kv: dict[str, tuple[Any, Any]]
    tensors: dict[str, np.ndarray]
    notes: list[str] = field(default_factory=list)
    dim: int | None = None  # the model's rotary dim d (None: not checked against the GGUF)
    base: float | None = None  # the model's rope_theta b, unpatched (None: not checked)
    rope_type: str | None = None  # the transformers rope type translated (the global layers' for per-layer types)
    # per-layer-type models (SWA_ROPE_ARCHS): each of the model's layer types → whether llama.cpp rotates
    # it as a sliding-window layer (at rope.freq_base_swa, unscaled); {} for one set of rope parameters
    swa_types: dict[str, bool] = field(default_factory=dict)
    sliding_window: int | None = None  # the model's window [tokens] (the GGUF's attention.sliding_window)
    base_swa: float | None = None  # the model's sliding layers' rope_theta, unpatched (None: not checked)

    def for_arch(self, arch: str) -> GgufRope:
        """The same metadata keyed for another architecture."""
        old = f"{self.arch}."
        kv = {f"{arch}.{k[len(old):]}" if k.startswith(old) else k: v for k, v in self.kv.items()}
        return GgufRope(arch, kv, dict(self.tensors), list(self.notes), self.dim, self.base, self.rope_type,
                        dict(self.swa_types), self.sliding_window, self.base_swa)



def rewrite_gguf(src: str | os.PathLike, dst: str | os.PathLike, rope: GgufRope) -> Path:
    """Copy the GGUF ``src`` to ``dst`` with its rope metadata and rope tensors replaced by ``rope``.

    Every key of ``ROPE_KEYS`` (``{arch}.rope.freq_base``, ``rope.scaling.*`` but ``finetuned``) and
    tensor of ``ROPE_TENSORS`` in ``src`` is dropped and ``rope``'s written instead (``rope.freq_base_swa``
    too where ``rope`` has it); every other key (value type and array item type kept) and tensor
    (type, shape and bytes) is copied. ``rope``
    is re-keyed to ``src``'s architecture. The copy is written into a staging folder and renamed
    to ``dst`` once complete (``ropescale.serving.output.staged``): a failed write (a full disk)
    leaves no ``dst``, nor the folders made for it.
    Raises ``ExportRefused`` (before writing anything) when
    ``src``'s ``rope.dimension_count``, ``rope.freq_base`` or ``rope.freq_base_swa`` is not the patched
    model's rotary dim or ``rope_theta`` (relative 1e-6), its architecture ignores ``rope``'s
    ``rope_freqs``, or ``rope`` is per layer type and ``src`` is not a sliding-window GGUF of
    ``SWA_ROPE_ARCHS`` (``check_arch_layers``);
    ``InvalidInput`` when ``src`` is missing, not a GGUF (cut short or corrupted included), or the
    same file as ``dst``; ``OutputError`` when ``dst`` cannot be written (``ropescale.serving.output``);
    ``GgufUnavailable`` without the ``gguf`` package.
    """
    gguf = gguf_module()
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise InvalidInput(f"{src}: no such GGUF file")
    if same_path(dst, src):  # any spelling, symlinks, hard links
        raise InvalidInput(f"{dst}: writing over the source GGUF; choose another output path")
    reader, fields = _read_gguf(gguf, src)
    arch = fields.get("general.architecture", (None, None))[1]
    if arch is None:
        raise InvalidInput(f"{src}: GGUF without general.architecture")
    rope = rope.for_arch(arch)
    check_arch_reads_tensors(rope)
    check_arch_layers(rope, {name: contents for name, (_, contents) in fields.items()}, src)
    _check_same_model(fields, arch, rope, src)
    drop = {f"{arch}.{k}" for k in ROPE_KEYS} | set(rope.kv)
    with staged(dst.parent, what=f"output {dst}") as stage:
        _write(gguf, reader, fields, drop, rope, stage / dst.name, arch)
    return dst


# what gguf-py's reader raises for a file that is not a GGUF, cut short or corrupted (measured on
# every truncation of a small GGUF and on random byte flips: ValueError — UnicodeDecodeError and
# unknown enum values included —, IndexError; OSError for an unreadable or empty file)
_READ_ERRORS = (ValueError, IndexError, KeyError, OverflowError, OSError)


def _read_gguf(gguf, path: Path):
    """``(reader, fields)``: gguf-py's reader of ``path`` and every field read (name → ``(field,
    contents)``) and every tensor's data located; ``InvalidInput`` (one line) when ``path`` is not
    a readable GGUF."""
    try:
        reader = gguf.GGUFReader(path)
        fields = {f.name: (f, f.contents()) for f in reader.fields.values()}
        for t in reader.tensors:
            _ = t.data.shape, t.data.dtype
    except _READ_ERRORS as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise InvalidInput(f"{path}: not a readable GGUF (cut short, corrupted or not a GGUF: {type(e).__name__}"
                           + (f": {first[:160]}" if first else "") + ")") from None
    return reader, fields


def _write(gguf, reader, fields: dict, drop: set, rope: GgufRope, path: Path, arch: str) -> None:
    """``path``: the GGUF of ``reader`` (its ``fields``) without the keys ``drop`` and the rope
    tensors, with ``rope``'s keys and tensors."""
    writer = gguf.GGUFWriter(path, arch)
    alignment = int(reader.alignment)
    if alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
        writer.add_custom_alignment(alignment)  # pads the data as the copied general.alignment says
    for name, (f, contents) in fields.items():
        if name in ("general.architecture", "general.alignment") or name.startswith("GGUF.") or name in drop:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, contents, vtype, sub_type=sub)
    for key, (value, vtype) in rope.kv.items():
        writer.add_key_value(key, value, vtype)
    kept = [t for t in reader.tensors if t.name not in ROPE_TENSORS]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    new = {name: np.ascontiguousarray(arr, dtype=np.float32) for name, arr in rope.tensors.items()}
    for name, arr in new.items():
        writer.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, gguf.GGMLQuantizationType.F32)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in kept:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        for arr in new.values():
            writer.write_tensor_data(arr)
    finally:
        writer.close()


def check_arch_reads_tensors(rope: GgufRope) -> None:
    """``ExportRefused`` for ``rope_freqs`` on an architecture whose llama.cpp graph loads
    ``rope_factors_long/short`` instead (Phi-3 types), and for any rope tensor on one whose graph
    passes no frequency factors (``SWA_ROPE_ARCHS``): the runtime would ignore the factors."""
    what = rope.rope_type or "this rope"
    if rope.arch in LONGROPE_ARCHS and "rope_freqs.weight" in rope.tensors:
        raise ExportRefused(f"llama.cpp: the {rope.arch} architecture reads rope_factors_long/short, never "
                            f"rope_freqs, so the {rope.rope_type or 'rope'} factors would be ignored; "
                            f"{what} cannot be exported for {rope.arch}")
    if rope.arch in SWA_ROPE_ARCHS + DEEPSEEK2_ARCHS and rope.tensors:
        raise ExportRefused(f"llama.cpp: the llama.cpp of {LLAMA_CPP} rotates {rope.arch} with no frequency "
                            f"factors (its graph passes ggml_rope_ext none; {', '.join(rope.tensors)} would be "
                            f"ignored), so {what} cannot be exported for {rope.arch}")


def check_arch_layers(rope: GgufRope, kv: dict[str, Any], src: str | os.PathLike = "the GGUF") -> None:
    """``ExportRefused`` (one line) when per-layer-type metadata (``rope.swa_types``) goes into a GGUF
    whose llama.cpp graph would not apply it per layer: an architecture outside ``SWA_ROPE_ARCHS``,
    or a gemma3 GGUF without ``attention.sliding_window`` > 0 (llama.cpp then rotates every layer as
    a global one). ``kv``: the GGUF's metadata (key → value)."""
    if not rope.swa_types:
        return
    if rope.arch not in SWA_ROPE_ARCHS:
        raise ExportRefused(f"llama.cpp: {src} is a {rope.arch} GGUF; the llama.cpp of {LLAMA_CPP} gives "
                            f"sliding-window layers their own rope only in {', '.join(SWA_ROPE_ARCHS)}, so this "
                            "per-layer-type patch cannot be written into it; give the GGUF of the same model")
    window = kv.get(f"{rope.arch}.attention.sliding_window")
    if rope.arch == "gemma3" and not (isinstance(window, (int, float)) and window > 0):
        raise ExportRefused(f"llama.cpp: {src} has no {rope.arch}.attention.sliding_window, so the llama.cpp of "
                            f"{LLAMA_CPP} rotates every layer as a global one; give a GGUF with sliding-window "
                            "layers (the converter writes the window unless sliding_window_pattern is 1)")


def _check_same_model(fields: dict, arch: str, rope: GgufRope, src: Path) -> None:
    """``ExportRefused`` when the GGUF's rotary dim or rope base is not the patched model's (a GGUF of
    another model); keys absent from the GGUF are not checked. ``fields``: ``_read_gguf``'s."""
    dim = fields.get(f"{arch}.rope.dimension_count", (None, None))[1]
    base = fields.get(f"{arch}.rope.freq_base", (None, None))[1]
    base_swa = fields.get(f"{arch}.rope.freq_base_swa", (None, None))[1]
    try:
        dim, base = (None if dim is None else int(dim)), (None if base is None else float(base))
        base_swa = None if base_swa is None else float(base_swa)
    except (TypeError, ValueError):
        raise InvalidInput(f"{src}: {arch}.rope.dimension_count / freq_base are not numbers (a corrupted GGUF)") \
            from None
    if rope.dim is not None and dim is not None and dim != rope.dim:
        raise ExportRefused(f"llama.cpp: {src} has {arch}.rope.dimension_count {int(dim)} but the "
                            f"patched model's rotary dim is {rope.dim}; give the GGUF of the same model")
    if rope.base is not None and base is not None:
        theirs = base
        if abs(theirs - rope.base) > 1e-6 * abs(rope.base):
            raise ExportRefused(f"llama.cpp: {src} has {arch}.rope.freq_base {theirs:g} but the patched model's "
                                f"rope_theta is {rope.base:g}; give the GGUF of the same (unpatched) model")
    if rope.base_swa is not None and base_swa is not None and abs(base_swa - rope.base_swa) > 1e-6 * abs(rope.base_swa):
        raise ExportRefused(f"llama.cpp: {src} has {arch}.rope.freq_base_swa {base_swa:g} but the patched model's "
                            f"sliding layers' rope_theta is {rope.base_swa:g}; give the GGUF of the same (unpatched) "
                            "model")


def read_gguf_rope(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(kv, tensors)`` of a GGUF for ``llama_cpp_rope``: every scalar/string key (arrays left out)
    and the rope tensors (``ROPE_TENSORS``) as float32 arrays. Raises ``InvalidInput`` for a file
    that is missing or not a GGUF (cut short or corrupted included); ``GgufUnavailable`` without
    the ``gguf`` package."""
    gguf = gguf_module()
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{path}: no such GGUF file")
    reader, fields = _read_gguf(gguf, path)
    kv = {name: contents for name, (f, contents) in fields.items()
          if f.types and f.types[0] != gguf.GGUFValueType.ARRAY and not name.startswith("GGUF.")}
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors if t.name in ROPE_TENSORS}
    return kv, tensors
