import copy
import os
import sys

# Bytecode caches on, here and in every process the tests start (xdist workers, launched and CLI
# subprocesses): with PYTHONDONTWRITEBYTECODE=1 in the environment (as on the development and CI
# machines) each of them compiled the checkout's modules again and pytest rewrote the asserts of every
# test module again in each worker — 8 s of each worker's 24 s collection, ~0.5 s per subprocess.
# (The caches are `__pycache__/` folders, ignored by git.)
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# pytest-xdist runs one worker per core: each takes its share of the cores (two threads without workers),
# and so does every process a test starts (a CLI run, a crash runner, a memory probe): with OpenMP's
# default of one thread per core, a child of one worker spun on the core the other worker was using
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_THREADS)
os.environ["OMP_NUM_THREADS"] = str(_THREADS)

from ropescale.compat import cache_kwarg  # noqa: E402
from ropescale.models import REFERENCE_MODEL  # noqa: E402


def pytest_itemcollected(item):
    """The tests of a module that share a module- or class-scoped fixture run on one worker
    (``--dist loadgroup``): spread over workers, each would build that fixture again. (Marked as each
    test is collected: xdist reads the groups in its own ``pytest_collection_modifyitems``.)"""
    info = getattr(item, "_fixtureinfo", None)
    if info is None or item.get_closest_marker("xdist_group") is not None:
        return
    if any(defs[-1].scope in ("module", "class") for defs in info.name2fixturedefs.values()):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Stop where xdist's groups did not take: pytest 9.2 keeps node ids where pytest-xdist 3.8 does
    not write its group into them, so every group is silently spread over the workers (the census
    then computes each type on both) — hence ``pytest<9.2`` in the test extra."""
    census = [i for i in ids if i.startswith("tests/test_census.py::test_census[")]
    if node.config.getoption("dist") == "loadgroup" and census and not any("@" in i for i in census):
        raise pytest.UsageError(f"pytest-xdist did not group the census's tests under pytest {pytest.__version__}: "
                                "install the test extra's pytest (<9.2)")


@pytest.fixture(autouse=True)
def _worker_threads():
    """Each test leaves torch's thread count as it found it: runs in-process (a sweep, a search, a
    fine-tuning with ``threads: 2``) set it for the whole process, and two workers with two threads
    each on two cores spin in OpenMP (the suite took 18 instead of 13 minutes)."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """ropescale's cache (RULER samples) in a folder of this test process: workers never share it, and the
    tests never read or fill the user's ~/.cache/ropescale."""
    before = os.environ.get("ROPESCALE_CACHE")
    os.environ["ROPESCALE_CACHE"] = str(tmp_path_factory.mktemp("ropescale-cache"))
    yield
    if before is None:
        os.environ.pop("ROPESCALE_CACHE", None)
    else:
        os.environ["ROPESCALE_CACHE"] = before


def with_cache(cache) -> dict:
    """The KV cache as the installed transformers' models take it: ``{"cache": c}`` from 5.24,
    ``{"past_key_values": c}`` before (``ropescale.compat.cache_kwarg``)."""
    from transformers import LlamaForCausalLM

    return {cache_kwarg(LlamaForCausalLM): cache}


def tiny_llama_config(**rope):
    from transformers import LlamaConfig

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0} | rope
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rope_parameters=rope_parameters)


GEMMA3_LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's 5:1 pattern (global layer 5)


def tiny_gemma3_config(vocab_size=256, **full):
    """A tiny gemma3_text config with Gemma 3's layout: five sliding-window layers (window 16) then a
    global one, head_dim 16, T = 64, and per-layer-type ``rope_parameters`` as Gemma 3 ships them —
    sliding 10 000, full 1 000 000 — ``full`` added to the full_attention type's (``rope_type`` …:
    the 4B+ configs ship linear ×8 there). ``query_pre_attn_scalar`` = head_dim, the softmax scale
    llama.cpp's gemma3 uses below 27B."""
    from transformers import Gemma3TextConfig

    rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "default", "rope_theta": 1000000.0, **full}}
    return Gemma3TextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                            max_position_embeddings=64, sliding_window=16, layer_types=list(GEMMA3_LAYER_TYPES),
                            rope_parameters=rope_parameters)


def build(config_cls_model, config, state_dict=None, seed=0):
    """Model from a deep-copied config (models keep a reference to their config)."""
    torch.manual_seed(seed)
    model = config_cls_model(copy.deepcopy(config)).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


@pytest.fixture
def tiny_llama():
    from transformers import LlamaForCausalLM

    return build(LlamaForCausalLM, tiny_llama_config())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny random Llama with the bundled tokenizer (fast CLI/sweep tests)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, max_position_embeddings=32,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def sharp_model_dir(tmp_path_factory, tiny_model_dir):
    """``tiny_model_dir``'s model with its LM head × 40: a random model's next-token distributions
    are nearly uniform, so what a patch moves them by (KL ~ 1e-8) drowns in float32 rounding; a
    larger head makes them peaked, as a trained model's are."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    path = tmp_path_factory.mktemp("sharp-model")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    """A saved tiny random Gemma 3 (``tiny_gemma3_config``) with the bundled tokenizer."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    cfg = tiny_gemma3_config(vocab_size=len(tok))
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-gemma3")
    Gemma3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    from ropescale.reference import kjv

    path = tmp_path_factory.mktemp("text") / "ruth.txt"
    path.write_text(dict(kjv.split("heldout"))["Ruth"])
    return path
