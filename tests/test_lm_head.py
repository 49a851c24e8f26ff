"""The chunked LM head (``ropescale.lm_head``) against full logits computed the textbook way:
every supported family (soft-capping, logit scaling and tied heads among them), the fallback for
a head it cannot reproduce, and the training loss with its gradients."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers as T

from ropescale.lm_head import OutputHead, causal_lm_loss, chunk_size_for
from ropescale.runs.scoring import score_windows
from ropescale.runs.windows import make_windows
from tests.families import COMMON, FAMILIES, family_model


def _extra_families():
    """Families whose forward does more than ``lm_head`` (not RoPE-patch families of their own)."""
    gemma3 = FAMILIES["gemma3"]
    return {
        "gemma3_softcap": (gemma3[0], gemma3[1], {**gemma3[2], "final_logit_softcapping": 3.0}),
        "cohere": (T.CohereConfig, T.CohereForCausalLM, {"logit_scale": 0.37}),
        "granite": (T.GraniteConfig, T.GraniteForCausalLM, {"logits_scaling": 2.5}),
        "hyperclovax": (T.HyperCLOVAXConfig, T.HyperCLOVAXForCausalLM, {"logits_scaling": 0.85}),  # × s
        # small Mamba-2 mixer (the defaults: 128 heads, state 256, chunks of 256 — 6 s to build, 2.5 s a forward)
        "falcon_h1": (T.FalconH1Config, T.FalconH1ForCausalLM, {"lm_head_multiplier": 0.8, "mamba_d_ssm": 64,
                                                                "mamba_n_heads": 4, "mamba_d_state": 16,
                                                                "mamba_chunk_size": 16}),
    }


ALL = {**FAMILIES, **_extra_families()}


def _model(name):
    if name in FAMILIES:
        return family_model(name)
    cfg_cls, model_cls, extra = ALL[name]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**COMMON, **extra)).eval()


@torch.no_grad()
def full_logit_nll(model, ids):
    """Oracle: the model's own full logits, log-softmax in float64, gathered by hand."""
    logp = model(input_ids=ids, use_cache=False).logits.double().log_softmax(-1)  # [b, n, V]
    return -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # [b, n-1]


@pytest.mark.parametrize("name", sorted(ALL))
def test_chunked_perplexity_equals_full_logits(name):
    model = _model(name)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (70, 45)]
    windows = make_windows([len(d) for d in docs], 20)
    with _no_warning():
        score = score_windows(model, docs, windows, length=20, batch_size=2, logits_chunk=3)
    total = 0.0
    for w in windows:
        ids = docs[w.doc][w.start : w.end][None]
        total += float(full_logit_nll(model, ids)[0, w.score_from - w.start - 1 :].sum())
    assert score.tokens == sum(w.end - w.score_from for w in windows)
    assert score.nll == pytest.approx(total, rel=1e-6)


class _no_warning:
    """No warning may be raised inside (the head must be reproduced, not fall back)."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self._log = self._ctx.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        fallbacks = [str(w.message) for w in self._log if "chunked LM head" in str(w.message)]
        assert not fallbacks, fallbacks


@pytest.mark.parametrize("name", ["granite", "hyperclovax", "falcon_h1", "gemma2", "cohere"])
def test_scaled_heads_in_bfloat16_equal_full_logits(name):
    """In bfloat16 too: the head is reproduced (no fallback) and scores as the model's own logits."""
    model = _model(name).to(torch.bfloat16)
    with torch.no_grad():  # logits of a few units: a wrong scale is many bf16 ulps off
        model.get_output_embeddings().weight.mul_(30.0)
    docs = [torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(6))]
    windows = make_windows([48], 24)
    with _no_warning():
        score = score_windows(model, docs, windows, length=24, logits_chunk=5)
    total = sum(float(full_logit_nll(model, docs[0][w.start : w.end][None])[0, w.score_from - w.start - 1 :].sum())
                for w in windows)
    assert score.nll == pytest.approx(total, rel=1e-3)  # bf16 logits: float32 loss of the same values


class _ScaledHead(T.LlamaForCausalLM):
    """A family that multiplies its logits by a factor ropescale does not know."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.85
        return out


def test_unknown_scale_is_caught_in_bfloat16():
    torch.manual_seed(0)
    model = _ScaledHead(FAMILIES["llama"][0](**COMMON)).eval().to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    head = OutputHead(model)
    with torch.no_grad():
        hidden, own = head.run(input_ids=ids)
    assert "max |Δlogit|" in head.check(hidden, own)


def test_head_only_training_recomputes_chunks_in_backward():
    """With the decoder frozen (only the head trains, as LoRA on lm_head does), the chunks must
    still be checkpointed: no [*, V]-sized tensor is kept for backward."""
    model = _model("llama").train()
    model.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    kept = []

    def pack(t):
        kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = causal_lm_loss(model, ids, chunk_size=8)
    assert not [s for s in kept if s and s[-1] == COMMON["vocab_size"] and len(s) > 1 and s[-2] > 1
                and s != tuple(model.lm_head.weight.shape)], kept
    loss.backward()
    ref = _model("llama")
    ref.requires_grad_(False)
    ref.lm_head.weight.requires_grad_(True)
    ref(input_ids=ids, labels=ids).loss.backward()
    assert torch.allclose(model.lm_head.weight.grad, ref.lm_head.weight.grad, rtol=1e-5, atol=1e-7)


class _DoubledHead(T.LlamaForCausalLM):
    """A family whose forward post-processes logits in a way ropescale does not know."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0 + 0.5
        return out


def test_unknown_head_falls_back_with_a_warning_and_the_same_numbers():
    cfg_cls, _, _ = FAMILIES["llama"]
    torch.manual_seed(0)
    model = _DoubledHead(cfg_cls(**COMMON)).eval()
    docs = [torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(5))]
    windows = make_windows([60], 20)
    with pytest.warns(UserWarning, match="does not reproduce the model's logits"):
        score = score_windows(model, docs, windows, length=20, logits_chunk=4)
    total = sum(float(full_logit_nll(model, docs[0][w.start : w.end][None])[0, w.score_from - w.start - 1 :].sum())
                for w in windows)
    assert score.nll == pytest.approx(total, rel=1e-6)


def test_check_names_the_difference():
    model = _model("llama")
    head = OutputHead(model)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, own = head.run(input_ids=ids)
    assert hidden.shape == (2, 9, COMMON["hidden_size"]) and own.shape == (2, 1, COMMON["vocab_size"])
    assert head.check(hidden, own) is None
    assert "max |Δlogit|" in head.check(hidden, own + 1e-2)


def test_chunk_size_from_budget():
    # V = 128,256, float32 eval: logits + log-softmax, 8 bytes per position and row → 261 positions
    assert chunk_size_for(128_256, 1, budget=256 * 2**20) == 261
    # bfloat16 training: bf16 logits, float32 copy, log-softmax, gradient: 14 bytes; batch 2
    assert chunk_size_for(128_256, 2, budget=256 * 2**20, training=True, dtype=torch.bfloat16) == 74
    assert chunk_size_for(10**9, 8, budget=1) == 1


@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3"])
def test_training_loss_and_gradients_equal_the_plain_loss(name):
    model = _model(name).train()
    model.config.attention_dropout = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(2))
    plain = ref(input_ids=ids, labels=ids, use_cache=False).loss
    plain.backward()
    loss = causal_lm_loss(model, ids, chunk_size=5)
    loss.backward()
    assert float(loss) == pytest.approx(float(plain), rel=1e-5)
    worst = 0.0
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), n
            continue
        worst = max(worst, float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)))
    assert worst <= 1e-5


def test_training_loss_ignores_masked_labels():
    model = _model("llama")
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :9] = -100
    plain = model(input_ids=ids, labels=labels, use_cache=False).loss
    assert float(causal_lm_loss(model, ids, labels=labels, chunk_size=4)) == pytest.approx(float(plain), rel=1e-5)


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from ropescale.runs.scoring import score_windows
    from ropescale.runs.windows import make_windows

    def anon():  # anonymous resident memory: live tensors, not library pages a busy machine may evict
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32768, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    n = 4096
    docs = [torch.randint(0, 32768, (n,))]
    windows = make_windows([n], n)
    score_windows(model, docs, windows, length=n, logits_chunk=8)  # warm-up: allocator, kernels
    before, peak, done = anon(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)
    t = threading.Thread(target=sample)
    t.start()
    score_windows(model, docs, windows, length=n, logits_chunk=int(sys.argv[1]))
    done.set()
    t.join()
    print(json.dumps({"before": before, "peak": max(peak[0], anon())}))
""")


def test_perplexity_memory_is_not_n_times_v(tmp_path):
    """One 4,096-token window at V = 32,768: full logits would be 512 MiB per float32 copy (and
    ≥ 1 GiB with the log-softmax); the chunked head must stay far below one copy."""
    script = tmp_path / "mem.py"
    script.write_text(_MEMORY_SCRIPT)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, str(script), "64"], capture_output=True, text=True, env=env,
                         check=True, timeout=300).stdout
    m = json.loads(out.strip().splitlines()[-1])
    grew = m["peak"] - m["before"]
    one_copy = 4096 * 32768 * 4
    assert grew < one_copy / 4, f"scoring grew RSS by {grew / 2**20:.0f} MiB"
