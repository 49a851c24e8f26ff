"""bench/memory_estimate.py: the byte count against arithmetic, the fake-tensor trace against the same step on
real tensors, the longest length against traces around it. (Its agreement with the H100's measured peaks is
in docs/gpu.md: a GPU cannot be a test's oracle here.)"""

import re

import pytest
import torch

from bench import memory_estimate as est


def test_the_count_follows_storages_not_tensors():
    count = est.PeakBytes()
    with count:
        a = torch.empty(1000)  # 4,000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4,000
        view = a.view(10, 100)  # no storage of its own
        a.add_(1.0)  # in place: none either
        assert count.now == 8000
        del a, view
        assert count.now == 4000  # a's storage went with its last view
        c = torch.empty(250, dtype=torch.int32)  # 1,000
        assert count.now == 5000
    assert count.peak == 8000
    del b, c


def _real_step(n: int) -> tuple[int, int]:
    """The estimated step on real CPU tensors, counted the same way: (base bytes, peak bytes)."""
    from bench.memory import _model
    from ropescale.lm_head import OutputHead, causal_lm_loss
    from ropescale.training.loop import enable_checkpointing
    from ropescale.training.lora import LoraSettings, apply_lora

    est._register_attention()
    model, _ = _model("small", n, "cpu", 1)
    model.set_attn_implementation(est.ATTENTION)
    enable_checkpointing(model)
    model = apply_lora(model, LoraSettings())
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.zeros(1, n, dtype=torch.long)
    count = est.PeakBytes()
    for t in (*model.parameters(), *model.buffers(), ids):
        count.track(t)
    base = count.now
    head = OutputHead(model)
    head.verified = True
    with count:
        loss = causal_lm_loss(model, ids, head=head)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return base, count.peak


def test_the_fake_trace_counts_what_the_real_step_allocates():
    """Oracle: the same step run on real tensors (nothing faked), counted storage by storage."""
    base, peak = _real_step(512)
    got = est.estimate("small", 512, layers=1)
    assert got["base_gib"] * est.GiB == base
    assert got["peak_gib"] * est.GiB == peak


def test_longest_is_the_last_length_that_fits():
    fits, over = (est.estimate("small", n, layers=1)["peak_gib"] for n in (6144, 7168))
    card = (fits + over) / 2
    got = est.longest("small", card, layers=1, probes=(2048, 4096))
    assert got["longest"] == 6144 and got["peak_gib"] == fits


def test_offload_books_each_layers_input_to_the_host():
    """activation_offload's trace: what the checkpointed layers keep — their input, n × hidden float32 values
    each — is in host memory, and the device's peak is lower by about as much."""
    n, layers = 2048, 3
    base = est.estimate("small", n, layers=layers)
    off = est.estimate("small", n, layers=layers, stack="offload")
    assert base["host_gib"] == 0
    assert off["host_gib"] * est.GiB == layers * n * 256 * 4
    assert base["peak_gib"] - off["peak_gib"] >= (layers - 1) * n * 256 * 4 / est.GiB


def test_an_unknown_stack_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="--stack tiled: unknown; stacks: baseline, offload, offload"):
        est.estimate("small", 1024, stack="tiled")


TOO_SHORT = "a training step needs at least 2 tokens (one to predict from the other)"


@pytest.mark.parametrize(("args", "line"), [
    (["--length", "0"], f"--length 0: {TOO_SHORT}"),
    (["--length", "1024,1"], f"--length 1: {TOO_SHORT}"),
    (["--layers", "0"], "--layers 0: a model needs at least 1 decoder layer"),
])
def test_a_step_without_tokens_or_layers_is_one_line_and_exit_1(args, line):
    """Length 0 ended in a reshape error's traceback, layers 0 in PEFT's "target modules not found" one: the
    script's own line instead, before any trace (1024 is not traced first), nothing on stdout."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "bench" / "memory_estimate.py"), "--shape", "small",
                           "--card", "", *args], capture_output=True, text=True, timeout=300, cwd=root)
    assert (done.returncode, done.stdout, done.stderr.strip()) == (1, "", line)


def test_the_estimator_refuses_them_itself():
    with pytest.raises(SystemExit, match=f"^--length 0: {re.escape(TOO_SHORT)}$"):
        est.estimate("small", 0)
    with pytest.raises(SystemExit, match="^--layers 0: a model needs at least 1 decoder layer$"):
        est.estimate("small", 512, layers=0)


@pytest.mark.skipif(not __import__("ropescale.training.tiling").training.tiling.tiled_mlp_available(),
                    reason="DeepSpeed is not installed (ropescale[scale])")
def test_the_tiled_mlp_lowers_the_recomputed_layers_peak():
    """The recomputed layer's MLP — gate, up and their product, 3 × n × f bf16 values at once (the 8B shape,
    one layer) — is what tiling slices: the traced peak drops by at least two thirds of it."""
    n, f = 8192, 14336
    off = est.estimate("8b", n, layers=1, stack="offload")
    tiled = est.estimate("8b", n, layers=1, stack="offload+tiled")
    assert off["peak_gib"] - tiled["peak_gib"] >= 2 * n * f * 2 / est.GiB


@pytest.mark.skipif(not __import__("ropescale.training.tiling").training.tiling.tiled_mlp_available(),
                    reason="DeepSpeed is not installed (ropescale[scale])")
def test_tiled_norms_and_autocast_adapters_lower_the_recomputed_layers_peak():
    """What the recomputed layer still holds after tiling its MLP is float32 [n, hidden]: PEFT's copy of each
    adapter's input (q, k, v, o) and the RMSNorms' intermediates and backward temporaries. Tiled norms and the
    adapters on autocast's path (the 8B shape, one layer) drop the traced peak by at least four of them."""
    n, hidden = 8192, 4096
    tiled = est.estimate("8b", n, layers=1, stack="offload+tiled")
    new = est.estimate("8b", n, layers=1, stack="offload+tiled+norms+amp")
    assert new["base_gib"] == tiled["base_gib"]
    assert tiled["peak_gib"] - new["peak_gib"] >= 4 * n * hidden * 4 / est.GiB
