import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import build, tiny_gemma3_config, tiny_llama_config

T = 64  # tiny_llama_config's max_position_embeddings: the training window
D = 16  # its head_dim (64 hidden / 4 heads): the rotary dim
THETA = 10000.0
LONG = [1.0 + 0.5 * i for i in range(D // 2)]
SHORT = [1.0 + 0.01 * i for i in range(D // 2)]

# every frequency strategy with an export hook, with non-default settings where they exist
FREQUENCY = {
    "vanilla": ("vanilla", {}),
    "linear": ("linear", {"factor": 4.0}),
    "ntk": ("ntk", {"factor": 4.0}),
    "dynamic_ntk": ("dynamic_ntk", {"factor": 2.0}),
    "yarn": ("yarn", {"factor": 4.0}),
    "yarn_attention": ("yarn", {"factor": 4.0, "attention_factor": 1.3}),
    "yarn_betas": ("yarn", {"factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0}),
    "llama3": ("llama3", {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    "longrope": ("longrope", {"factor": 4.0, "short_factor": SHORT, "long_factor": LONG}),
    "longrope_attention": ("longrope", {"factor": 4.0, "short_factor": SHORT, "long_factor": LONG,
                                        "attention_factor": 1.5}),
}
RELATIVE = {"rerope": {"window": 16}, "leaky_rerope": {"window": 16, "k": 4.0},
            "self_extend": {"group_size": 4, "window": 16}, "dca": {}, "string": {}}


def served(model, engine: str, name: str, length: int, **params):
    """A copy of ``model`` patched with ``name`` and translated by ``engine`` for ``length`` tokens:
    ``(ropescale's rope, the engine's translation, the engine's re-implemented rope)``."""
    import ropescale
    from ropescale.serving import get_engine
    from ropescale.serving.rope import ropescale_rope

    eng = get_engine(engine)
    with ropescale.patch(copy.deepcopy(model), name, **params) as handle:
        translation = eng.translate(handle, length)
        return ropescale_rope(handle, length), translation, eng.rope(translation, length, handle.context)


def patched(name: str, **params):
    from transformers import LlamaForCausalLM

    import ropescale

    model = build(LlamaForCausalLM, tiny_llama_config())
    ropescale.patch(model, name, **params)
    return model


G_T, G_D = 64, 16  # tiny_gemma3_config's window and head_dim
LOCAL, GLOBAL = 10000.0, 1000000.0  # its sliding and full_attention rope_theta, as Gemma 3 ships them


def gemma3_patched(name: str, *, layer_types=None, full=None, **params):
    """A tiny Gemma 3 (``tiny_gemma3_config(**full)``) patched with ``name`` (default layer types: the
    global ones only, as ropescale patches Gemma 3)."""
    from transformers import Gemma3ForCausalLM

    import ropescale

    model = build(Gemma3ForCausalLM, tiny_gemma3_config(**(full or {})))
    ropescale.patch(model, name, layer_types=layer_types, **params)
    return model


@pytest.fixture
def make_patched():
    return patched


def vanilla_inv_freq(base: float = THETA, d: int = D) -> torch.Tensor:
    """θ_i = b^(−2i/d), float64 [d/2]."""
    return torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size, read_only=False)``: a new tmpfs of ``size`` (``"300k"``) under ``tmp_path`` — a
    real full disk or read-only file system —, unmounted afterwards. Skips where it cannot be
    mounted (not Linux, not root, no mount permission in a container)."""
    mounted = []

    def mount(size: str, read_only: bool = False):
        if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root on Linux")
        point = tmp_path / f"tmpfs-{len(mounted)}"
        point.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if read_only else ""), "tmpfs",
                              str(point)], capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", str(point)], check=False)
