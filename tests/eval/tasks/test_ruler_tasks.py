"""The RULER tasks' lifecycle on a tiny model: greedy decoding against transformers' own
``generate``, RULER's scores from the predictions, the sample cache, refusals, the ``ruler`` suite's
records, tables and plots."""

import gzip
import json
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.config import ConfigError, build_config
from eval.sweep import run_sweep
from eval.tasks import get_task
from eval.tasks.prompts import PromptError
from eval.tasks.ruler.base import greedy_batch, model_template
from eval.tasks.ruler.cache import cached_samples
from eval.tasks.ruler.spec import RulerSample
from ropescale.errors import OutputError
from ropescale.models import REFERENCE_MODEL
from ropescale.patching import patch


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROPESCALE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))


def hf_greedy(model, ids, n, eos):
    """transformers' generate, greedy, one prompt: the oracle for greedy_batch."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    gen = out[0, len(ids):].tolist()
    return gen[: gen.index(eos)] if eos in gen else gen


@pytest.mark.parametrize("strategy", ["vanilla", "yarn"])
def test_batched_greedy_equals_generate(tiny_model_dir, strategy):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eos = model.generation_config.eos_token_id
    prompts = [list(range(5, 45)), list(range(100, 117)), list(range(300, 329))]  # 40, 17, 29 tokens: padded
    with torch.no_grad(), patch(model, strategy, original_max_position_embeddings=32,
                                **({"factor": 2.0} if strategy == "yarn" else {})):
        want = [hf_greedy(model, p, 12, eos) for p in prompts]
        got = greedy_batch(model, prompts, 12, [eos], "cpu")
    assert got == want and all(len(g) == 12 for g in got)


def test_greedy_stops_at_eos(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    p = list(range(5, 25))
    with torch.no_grad():
        free = greedy_batch(model, [p], 6, [], "cpu")[0]
        cut = greedy_batch(model, [p, p[:10]], 6, [free[2]], "cpu")[0]
    assert cut == free[:2]


def test_cache_reuses_and_extends(tmp_path):
    made = []

    def make(n):
        def go():
            made.append(n)
            return [RulerSample(i, f"p{i}", (str(i),), 10, " a") for i in range(n)]
        return go

    key = {"task": "x", "length": 64}
    s1, st1 = cached_samples(key, 3, make(3), directory=tmp_path)
    s2, st2 = cached_samples(key, 2, make(2), directory=tmp_path)  # fewer: a prefix of the stored ones
    s3, st3 = cached_samples(key, 4, make(4), directory=tmp_path)  # more: made again, stored
    _, st4 = cached_samples({**key, "length": 65}, 1, make(1), directory=tmp_path)
    assert made == [3, 4, 1]
    assert (st1.cached, st2.cached, st3.cached, st4.cached) == (False, True, False, False)
    assert s2 == s1[:2] and len(s3) == 4
    (tmp_path / st1.path.split("/")[-1]).write_text("torn")  # a torn file is made again, not an error
    assert cached_samples(key, 1, make(1), directory=tmp_path)[1].cached is False

    def refuse():
        made.append("refused")
        raise PromptError("x at 64 tokens: no example fits")

    for _ in range(2):  # the refusal is stored: the second one comes from the cache
        with pytest.raises(PromptError, match="^x at 64 tokens: no example fits$"):
            cached_samples({**key, "length": 66}, 1, refuse, directory=tmp_path)
    assert made.count("refused") == 1


def _made(log, n=2):
    def make():
        log.append(n)
        return [RulerSample(i, f"p{i}", (str(i),), 10, " a") for i in range(n)]
    return make


def _cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _foreign_gzip(path):
    with gzip.open(path, "wt") as f:
        json.dump([1, 2, 3], f)


def _foreign_samples(path):
    with gzip.open(path, "wt") as f:
        json.dump({"key": {"task": "x", "length": 64}, "samples": [{"index": 0}, {"index": 1}]}, f)


@pytest.mark.parametrize("spoil", [_cut_in_half, _foreign_gzip, _foreign_samples],
                         ids=["cut_in_half", "foreign_gzip", "foreign_samples"])
def test_a_cache_entry_that_does_not_read_as_one_is_made_again(tmp_path, spoil):
    """The docs' promise — a torn file is made again — held for text only: a gzip cut short raised
    EOFError, another gzip AttributeError (KeyError for an entry of other samples)."""
    made, key = [], {"task": "x", "length": 64}
    path = Path(cached_samples(key, 2, _made(made), directory=tmp_path)[1].path)
    spoil(path)
    samples, stats = cached_samples(key, 2, _made(made), directory=tmp_path)
    assert made == [2, 2] and not stats.cached and samples[1] == RulerSample(1, "p1", ("1",), 10, " a")
    assert cached_samples(key, 2, _made(made), directory=tmp_path)[1].cached and made == [2, 2]  # replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".lock"]


def test_a_file_in_place_of_the_cache_folder_is_one_line(tmp_path, monkeypatch, tok):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("ROPESCALE_CACHE", str(tmp_path / "file"))
    cls = get_task("niah_single_1")
    with pytest.raises(OutputError) as e:  # NotADirectoryError before
        cls(cls.Options(num_samples=1), tokenizer=tok, train_length=128).examples(512)
    assert str(e.value) == (f"the RULER sample cache {tmp_path / 'file' / 'ruler'} cannot be made: a file is in the "
                            f"way (ROPESCALE_CACHE={tmp_path / 'file'}); point ROPESCALE_CACHE at a folder, or set "
                            "cache: false in the task's options")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "ruler").write_text("")
    with pytest.raises(OutputError, match="cannot be made: a file is in the way"):  # FileExistsError before
        cached_samples({"task": "x"}, 1, _made([]), directory=tmp_path / "cache" / "ruler")


def test_a_cache_that_cannot_be_written_is_read_or_bypassed_with_one_warning(tmp_path, monkeypatch, caplog):
    """A read-only file system (OSError EROFS from the lock file, the folder, the entry's rename):
    entries there are read, others generated and not stored, one warning line per folder."""
    import errno

    import filelock

    from eval.tasks.ruler import cache as ruler_cache

    made, key = [], {"task": "x", "length": 64}
    stored = cached_samples(key, 2, _made(made), directory=tmp_path / "ro")[0]
    monkeypatch.setattr(ruler_cache, "_WARNED", set())

    def read_only(*_, **__):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(filelock.FileLock, "acquire", read_only)
    assert cached_samples(key, 2, _made(made), directory=tmp_path / "ro") == (stored, ANY)
    samples, stats = cached_samples({**key, "length": 65}, 2, _made(made), directory=tmp_path / "ro")
    assert made == [2, 2] and len(samples) == 2 and not stats.cached and stats.path == ""
    monkeypatch.setattr(Path, "mkdir", read_only)  # a folder not there yet, on a read-only file system
    assert cached_samples(key, 1, _made(made, 1), directory=tmp_path / "new")[1].cached is False
    monkeypatch.undo()
    monkeypatch.setattr(ruler_cache, "_WARNED", set())
    monkeypatch.setattr(ruler_cache.os, "replace", read_only)  # the lock is taken, the entry cannot be stored
    assert cached_samples({**key, "length": 66}, 1, _made(made, 1), directory=tmp_path / "ro")[1].path == ""
    assert made == [2, 2, 1, 1] and not list((tmp_path / "ro").glob(".*tmp*"))  # no half-written file left
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"the RULER sample cache {tmp_path / d} cannot be written (Read-only file system): samples "
                        "are generated and not stored (set ROPESCALE_CACHE to a writable folder to keep them)"
                        for d in ("ro", "new", "ro")]


def test_examples_come_from_the_cache_the_second_time(tok, tmp_path):
    cls = get_task("niah_single_1")
    t1 = cls(cls.Options(num_samples=2), tokenizer=tok, train_length=128)
    t2 = cls(cls.Options(num_samples=1, batch_size=3), tokenizer=tok, train_length=128)
    t3 = cls(cls.Options(num_samples=1, seed=1), tokenizer=tok, train_length=128)
    a, b, c = t1.examples(512), t2.examples(512), t3.examples(512)
    assert not t1.generation[512].cached and t2.generation[512].cached and not t3.generation[512].cached
    assert b == a[:1] and c[0].sample != a[0].sample


def test_lengths_that_cannot_hold_a_prompt_are_refused(tok):
    cls = get_task("niah_single_1")
    t = cls(cls.Options(num_samples=1, cache=False), tokenizer=tok, train_length=128)
    with pytest.raises(PromptError, match=r"^niah_single_1: length 128 leaves no room for a prompt beside the "
                                          r"generation budget of 128 tokens"):
        t.examples(128)
    with pytest.raises(PromptError, match=r"^niah_single_1 at 256 tokens: no example fits: every draw at the "
                                          r"smallest haystack \(size 5\) takes at least \d+ tokens with the "
                                          r"generation budget \(its fixed text\), more than 256$"):
        t.examples(256)
    fwe = get_task("fwe")(get_task("fwe").Options(num_samples=1, cache=False), tokenizer=tok, train_length=128)
    with pytest.raises(PromptError, match=r"^fwe at 128 tokens: a vocabulary of 1 coded words"):
        fwe.examples(128)


@pytest.mark.parametrize("task,length", [("niah_single_1", 375), ("niah_multikey_2", 384), ("niah_multikey_3", 512),
                                         ("niah_multiquery", 1000), ("vt", 800), ("cwe", 900)])
def test_no_draw_is_shorter_than_the_floor_a_refusal_is_decided_from(task, length, monkeypatch):
    """A length is refused from the text every draw holds (``floor``) with no draw at all; so the
    floor must never exceed a real draw. Lengths where the draws at the smallest haystack keep
    failing (the floor fits, the draws do not): 40 real draws each (max_draws), every one at least
    the floor — the generators' own draws are the oracle."""
    from eval.tasks.ruler import cwe_gen as ruler_cwe_gen
    from eval.tasks.ruler import niah_gen as ruler_niah_gen
    from eval.tasks.ruler import spec as ruler_spec
    from eval.tasks.ruler import vt_gen as ruler_vt_gen
    from tests.eval.tasks.test_ruler_golden import make_task

    seen = []

    def watched(attempt, size, incremental, *, what, floor, max_draws=None):
        def draw(s):
            try:
                return attempt(s)
            except ruler_spec.TooLong as e:
                if s <= incremental:
                    seen.append((e.total, floor(s)))
                raise
        return ruler_spec.shrink_until_fits(draw, size, incremental, what=what, floor=floor, max_draws=max_draws)

    for module in (ruler_niah_gen, ruler_vt_gen, ruler_cwe_gen):
        monkeypatch.setattr(module, "shrink_until_fits", watched)
    t = make_task(task, 42)
    t.options = t.Options(num_samples=1, seed=42, cache=False, max_draws=40)
    with pytest.raises(PromptError, match=rf"^{task} at {length} tokens: no example fits in max_draws=40 draws"):
        t.examples(length)
    assert len(seen) == 40
    assert all(total >= floor for total, floor in seen), min(total - floor for total, floor in seen)


def test_model_templates(tok):
    assert model_template("base", tok) == "{task_template}"
    assert model_template("[INST] {task_template} [/INST]", tok) == "[INST] {task_template} [/INST]"
    with pytest.raises(PromptError, match="the tokenizer has no chat template"):
        model_template("chat", tok)
    tok2 = AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))
    tok2.chat_template = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}{{ '<a>{x}' }}"
    # the chat text's braces go through two formats (the model template, then the prompt): doubled twice
    assert model_template("chat", tok2) == "<u>{task_template}</u><a>{{{{x}}}}"
    fwe = get_task("fwe")
    (ex,) = fwe(fwe.Options(num_samples=1, template="chat", cache=False), tokenizer=tok2,
                train_length=128).examples(1024)  # a KeyError 'x' before
    assert ex.sample.prompt.startswith("<u>") and "?</u><a>{x} Answer:" in ex.sample.prompt
    with pytest.raises(ConfigError, match="template: .*expected base, chat, or a model template"):
        build_config({"task": "vt", "lengths": [1024], "strategies": ["vanilla"], "vt": {"template": "oops"}})


BRACES = (r"; a literal brace is written \{\{\{\{ or \}\}\}\} \(the model template is formatted, then the joined "
          r"prompt\)$")


@pytest.mark.parametrize(("template", "message"), [
    ("[INST] {task_template} {system} [/INST]", r"\{system\} is not a placeholder of a model template \(the one "
                                                r"placeholder is \{task_template\}\)" + BRACES),
    ("[INST] {task_template} [/INST] {", r"a lone '\{' or '\}': the one placeholder is \{task_template\}" + BRACES),
    ("{task_template} }", r"a lone '\{' or '\}'"),
    ("{task_template} {{context}}", r"\{context\} is not a placeholder"),  # the prompt's format would fill it
    ("{task_template} {{", r"a lone '\{' or '\}'"),  # one brace left for the prompt's format
    ("{task_template!r}", r"\{task_template!r\} is not a placeholder"),
])
def test_a_model_template_that_the_formats_would_break_on_is_refused_when_read(template, message):
    """A stray placeholder was a KeyError and a lone brace a ValueError from deep in a generator, at
    the first cell; now one line under the option's key when the config is read."""
    with pytest.raises(ConfigError, match=r"^config: niah_single_1.template: " + message):
        build_config({"task": "niah_single_1", "lengths": [1024], "strategies": ["vanilla"],
                      "niah_single_1": {"template": template}})


def test_a_model_template_with_literal_braces_reaches_the_prompt(tok):
    cls = get_task("fwe")
    template = "<s>{{{{json}}}} {task_template}"
    cfg = build_config({"task": "fwe", "lengths": [1024], "strategies": ["vanilla"],
                        "fwe": {"template": template, "num_samples": 1, "cache": False}})
    (ex,) = cls(cfg.options, tokenizer=tok, train_length=128).examples(1024)
    assert ex.sample.prompt.startswith("<s>{json} Read the following coded text")


def test_a_task_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir):
    """Records of niah_single_1: RULER's score recomputed by hand from transformers' generate."""
    cfg = build_config({"task": "niah_single_1", "model": str(tiny_model_dir), "lengths": [512],
                        "strategies": ["vanilla", "yarn"], "device": "cpu",
                        "niah_single_1": {"num_samples": 2, "batch_size": 2, "tokens_to_generate": 8}})
    records = run_sweep(cfg, tmp_path / "run", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task("niah_single_1")(cfg.options, tokenizer=tok, train_length=32)
    examples = task.examples(512)
    with torch.no_grad():
        preds = [tok.decode(hf_greedy(model, ex.ids, 8, tok.eos_token_id), skip_special_tokens=True).strip()
                 for ex in examples]
    hits = [sum(r.lower() in p.lower() for r in ex.sample.outputs) / len(ex.sample.outputs)
            for p, ex in zip(preds, examples)]
    r = records[0]
    assert r["strategy"] == "vanilla" and r["score"] == round(100 * sum(hits) / 2, 2)
    assert r["prompt_tokens"] == [len(ex.ids) for ex in examples] and r["prompt_tokens_max"] <= 512 - 8
    assert r["predictions"] == preds and r["tokens_to_generate"] == 8 and r["metric"] == "string_match_all"
    assert "RULER score" in (tmp_path / "run" / "results.md").read_text()


def test_the_suite_end_to_end(tmp_path, tiny_model_dir, text_file):
    cfg = build_config({"task": "ruler", "model": str(tiny_model_dir), "data": str(text_file),
                        "lengths": [128, 256, 512], "strategies": ["vanilla", "ntk"], "device": "cpu",
                        "ruler": {"tasks": ["niah_single_1", "fwe"], "num_samples": 1, "tokens_to_generate": 8,
                                  # niah_single_1 at 256: the fixed text fits, no draw does (RULER draws forever)
                                  "max_draws": 300}})
    records = run_sweep(cfg, tmp_path / "run", progress=False)
    by = {(r["strategy"], r["length"]): r for r in records}
    none, short, long_ = by[("vanilla", 128)], by[("vanilla", 256)], by[("vanilla", 512)]
    assert none["score"] is None and none["tasks_scored"] == 0 and set(none["refused"]) == {"niah_single_1", "fwe"}
    assert list(short["scores"]) == ["fwe"] and "niah_single_1" in short["refused"] and short["tasks_scored"] == 1
    assert short["score"] == short["scores"]["fwe"]
    assert set(long_["scores"]) == {"niah_single_1", "fwe"} and not long_["refused"]
    assert long_["score"] == round(sum(long_["scores"].values()) / 2, 2)
    assert long_["per_task"]["fwe"]["generation"]["cached"] is False
    md = (tmp_path / "run" / "results.md").read_text()
    assert "| strategy | average | niah_single_1 | fwe |" in md and "Refused at this length: niah_single_1" in md
    assert "| vanilla | — | — | — |" in md
    assert (tmp_path / "run" / "task_heatmap.png").stat().st_size > 0
    assert (tmp_path / "run" / "score_vs_length.png").stat().st_size > 0
    # a second run (another folder) reads every sample from the cache
    again = run_sweep(cfg, tmp_path / "again", progress=False)
    assert all(t["generation"]["cached"] for r in again for t in r["per_task"].values())
    assert [r["scores"] for r in again] == [r["scores"] for r in records]
    assert json.loads(json.dumps(records[0]))  # records are JSON


def test_suite_options_are_checked():
    with pytest.raises(ConfigError, match=r"ruler.tasks: unknown task 'niah_single_9'"):
        build_config({"task": "ruler", "lengths": [1024], "strategies": ["vanilla"],
                      "ruler": {"tasks": ["niah_single_9"]}})
    with pytest.raises(ConfigError, match=r"ruler.tasks: passkey is not a RULER task"):
        build_config({"task": "ruler", "lengths": [1024], "strategies": ["vanilla"], "ruler": {"tasks": ["passkey"]}})
    cfg = build_config({"task": "ruler", "lengths": [1024], "strategies": ["vanilla"],
                        "ruler": {"tasks": ["niah_multikey", "niah_multikey_1"]}})
    assert cfg.options.tasks == ["niah_multikey_1"]  # the old name is an alias
