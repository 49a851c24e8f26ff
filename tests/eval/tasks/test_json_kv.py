"""``json_kv`` (HELMET's JSON key-value retrieval): every prompt is HELMET's template filled with its own pairs, byte
for byte; the metric is HELMET's on hand-made outputs; samples fill L with the model's tokenizer, each from its own
seed; HELMET's cut from the end; refusals in one line; the task end to end on a tiny model and on the bundled one.

The oracles are HELMET's and lost-in-the-middle's code, transcribed below from the repositories (both MIT):
princeton-nlp/HELMET 4526dfb (``data.py::load_json_kv``, ``utils.py``, ``model_utils.py::tokenize``) and
nelson-liu/lost-in-the-middle 29b8a6d (``prompting.py::get_kv_retrieval_prompt``)."""

import json
import re
import string

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli import main
from eval.config import build_config
from eval.sweep import run_sweep
from eval.tasks import get_task
from eval.tasks.prompts import PromptError
from eval.tasks.synthetic.json_kv import json_kv_score
from eval.tasks.synthetic.json_kv_gen import draw_kv
from ropescale.models import REFERENCE_MODEL

UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


# --- HELMET 4526dfb, data.py::load_json_kv: the templates and the demos, as written there
def helmet_prompt(context, demos, question, shots):
    user_template = ("{context}\n\nExtract the value corresponding to the specified key in the JSON object "
                     "below.\n\n{demos}Key: {question}")
    system_template = "Corresponding value:"
    prompt_template = user_template + "\n" + system_template
    demo_template = "Key: {key}\nCorresponding value:{value}"
    demo_text = "\n\n".join([demo_template.format(key=key, value=" " + value) for key, value in demos[:shots]]) + (
        "\n\n" if shots > 0 else "")
    return prompt_template.format(context=context, demos=demo_text, question=question)


# --- lost-in-the-middle 29b8a6d, prompting.py::get_kv_retrieval_prompt: the JSON object of the records
def litm_records(data):
    formatted_kv_records = ""
    for index, record in enumerate(data):
        start_character = "{" if index == 0 else " "
        data_string = f'"{record[0]}": "{record[1]}"'
        end_character = ",\n" if index != len(data) - 1 else "}"
        formatted_kv_records += start_character + data_string + end_character
    return formatted_kv_records


# --- HELMET 4526dfb, utils.py: normalize_answer, substring_exact_match_score, parse_output; and load_json_kv's
# post_process (its substring_exact_match: the raw output's and the parsed output's, the better of the two)
def helmet_normalize_answer(s):
    def remove_articles(text):
        return re.sub(r'\b(a|an|the)\b', ' ', text)

    def white_space_fix(text):
        return ' '.join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return ''.join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def helmet_substring_exact_match_score(prediciton, ground_truth):
    return helmet_normalize_answer(ground_truth) in helmet_normalize_answer(prediciton)


def helmet_parse_output(output, prefix="Answer:"):
    def lstrip_string(s, sub):
        return re.sub(f'^{re.escape(sub)}', '', s, flags=re.IGNORECASE)
    patterns = [re.compile(f"(?:{prefix})(.*)(?:\n|$)", flags=re.IGNORECASE), re.compile(r"(?:^)(.*)(?:\n|$)")]
    for pat in patterns:
        matches = pat.search(output)
        if matches is not None:
            return lstrip_string(matches[1].strip(), prefix).strip()
    return None


def helmet_subem(prediction, answer):
    mets = max(helmet_substring_exact_match_score(prediction, a) for a in answer)
    parsed_pred = helmet_parse_output(prediction, "corresponding value:")
    new_mets = max(helmet_substring_exact_match_score(parsed_pred, a) for a in answer)
    return max(mets, new_mets)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))


def make(tok, **options):
    cls = get_task("json_kv")
    return cls(cls.Options(**{"cache": False, **options}), tokenizer=tok, train_length=128)


def parts(prompt):
    """A prompt read back without the code under test: the JSON object (in order), the demos, the question."""
    context, rest = prompt.split("\n\nExtract the value corresponding", 1)
    pairs = json.loads(context, object_pairs_hook=list)
    demos = re.findall(r"Key: (\S+)\nCorresponding value: (\S+)", rest)
    (question,) = re.findall(r"\nKey: (\S+)\nCorresponding value:$", prompt)
    return pairs, demos, question


@pytest.mark.parametrize("shots,length", [(2, 1024), (1, 512), (0, 512), (2, 2048)])
def test_every_prompt_is_helmets_template_filled_with_its_own_pairs(tok, shots, length):
    task = make(tok, num_samples=4, shots=shots, tokens_to_generate=40)
    for ex in task.examples(length):
        s = ex.sample
        pairs, demos, question = parts(s.prompt)
        assert s.prompt == helmet_prompt(litm_records(pairs), demos, question, shots)  # byte for byte
        assert s.input + s.answer_prefix == s.prompt and s.answer_prefix == "Corresponding value:"
        keys = [k for k, _ in pairs]
        assert len(demos) == shots and len(set(keys)) == len(keys) and not {k for k, _ in demos} & set(keys)
        assert all(UUID4.fullmatch(x) for pair in pairs + demos for x in pair)
        assert keys[s.index] == question and s.outputs == (dict(pairs)[question],)


def test_samples_fill_the_length_with_the_models_tokenizer(tok):
    """Counted here with the tokenizer: every prompt + budget ≤ L; sample 0 (the size search's probe) holds as many
    pairs as fit (one more would not); the others, shrunk from its size, fall short of L by less than two pairs."""
    L, budget = 1024, 40
    task = make(tok, num_samples=5, tokens_to_generate=budget)
    examples = task.examples(L)
    total = [len(tok(ex.sample.prompt)["input_ids"]) + budget for ex in examples]
    assert all(t <= L for t in total) and [ex.sample.length for ex in examples] == total
    n0 = len(parts(examples[0].sample.prompt)[0])
    bigger = draw_kv(42, L, 0, n0 + 1, 2)
    assert len(tok(bigger.prompt)["input_ids"]) + budget > L
    pair = max(len(tok(f'"{k}": "{v}",\n ')["input_ids"]) for k, v in parts(examples[0].sample.prompt)[0])
    assert all(L - t < 2 * pair for t in total), (total, pair)


def test_each_sample_has_its_own_seed(tok):
    a = make(tok, num_samples=3, tokens_to_generate=40).examples(512)
    b = make(tok, num_samples=5, tokens_to_generate=40).examples(512)
    c = make(tok, num_samples=3, tokens_to_generate=40, seed=7).examples(512)
    d = make(tok, num_samples=3, tokens_to_generate=40).examples(600)
    assert [x.sample for x in b[:3]] == [x.sample for x in a]
    assert not {x.sample.prompt for x in c} & {x.sample.prompt for x in a}
    assert not {x.sample.prompt for x in d} & {x.sample.prompt for x in a}
    assert len({x.sample.index for x in b}) > 1  # the gold pair's position is drawn per sample


CASES = [  # (output, gold): hand-made outputs and what HELMET's metric must say of them, by hand
    (" 3f2a1c4e-1b2d-4c3e-9f00-aa11bb22cc33", "3f2a1c4e-1b2d-4c3e-9f00-aa11bb22cc33", True),
    ("The value is 3F2A1C4E-1B2D-4C3E-9F00-AA11BB22CC33.", "3f2a1c4e-1b2d-4c3e-9f00-aa11bb22cc33", True),
    ("3f2a1c4e1b2d4c3e9f00aa11bb22cc33", "3f2a1c4e-1b2d-4c3e-9f00-aa11bb22cc33", True),  # hyphens are punctuation
    ("3f2a1c4e-1b2d-4c3e-9f00-aa11bb22cc3", "3f2a1c4e-1b2d-4c3e-9f00-aa11bb22cc33", False),  # one digit short
    ("\n\nKey: x\nCorresponding value: Corresponding value: ab-cd\n", "ab-cd", True),
    ("corresponding value:\n", "ab-cd", False),
    ("", "ab-cd", False),
    ("a b", "the a b", True),  # articles go: "the a b" → "b", in "a b" → "b"
    ("an apple", "apple", True),
    ("ab cd", "abcd", False),  # spaces stay
    ("x\nCorresponding VALUE: 1234-5678 and more\ny", "12345678", True),
]


@pytest.mark.parametrize("output,gold,want", CASES)
def test_the_metric_is_helmets(output, gold, want):
    assert helmet_subem(output, [gold]) == want  # the hand-made expectation holds for HELMET's function
    assert json_kv_score(output, [gold]) == want


def test_the_helmet_cut_from_the_end(tok):
    """``pairs`` fixed: a context too long for L is cut as HELMET's tokenize cuts it (transcribed below)."""
    L, budget = 1024, 100
    task = make(tok, num_samples=2, pairs=40, tokens_to_generate=budget)
    for i, ex in enumerate(task.examples(L)):
        draft = draw_kv(42, L, i, 40, 2)
        sample = {"context": draft.context, "demos": draft.demos, "question": draft.pairs[draft.gold][0]}
        # HELMET model_utils.py::tokenize, no chat template, a fast tokenizer
        prompt = helmet_prompt(sample["context"], sample["demos"], sample["question"], 2)
        input_len = len(tok([prompt])["input_ids"][0])
        assert input_len > L - budget  # the case is a cut
        truncate_length = input_len - (L - budget)
        context_tokens = tok([sample["context"]], return_offsets_mapping=True)
        new_context = sample["context"][:context_tokens["offset_mapping"][0][-truncate_length][0]]
        want = helmet_prompt(new_context, sample["demos"], sample["question"], 2)
        assert ex.sample.prompt == want and len(ex.ids) + budget <= L
    record = task.combine([[(0, ""), (1, "")]], task.examples(L), length=L, strategy=None)
    assert record["gold_in_context"] <= 2 and max(record["pairs"]) < 40


def test_lengths_that_cannot_hold_a_sample_are_refused_in_one_line(tok):
    with pytest.raises(PromptError, match=r"^json_kv at 256 tokens: no example fits: one pair, 2 demos and the "
                                          r"question take \d+ tokens with the generation budget, more than 256$"):
        make(tok, num_samples=1).examples(256)
    with pytest.raises(PromptError, match=r"^json_kv: length 100 leaves no room for a prompt beside the generation "
                                          r"budget of 100 tokens"):
        make(tok, num_samples=1).examples(100)
    with pytest.raises(PromptError, match=r"^json_kv at 300 tokens: no example fits: the prompt without its context"):
        make(tok, num_samples=1, pairs=5).examples(300)


def hf_greedy(model, ids, n, eos):
    """transformers' generate, greedy, one prompt: the oracle for the harness's batched decoding."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    gen = out[0, len(ids):].tolist()
    return gen[: gen.index(eos)] if eos in gen else gen


def test_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir):
    """The records' scores recomputed from transformers' generate and HELMET's metric."""
    cfg = build_config({"task": "json_kv", "model": str(tiny_model_dir), "lengths": [512], "device": "cpu",
                        "strategies": ["vanilla", "yarn"],
                        "json_kv": {"num_samples": 3, "batch_size": 2, "tokens_to_generate": 8, "shots": 1}})
    records = run_sweep(cfg, tmp_path / "run", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = get_task("json_kv")(cfg.options, tokenizer=tok, train_length=32).examples(512)
    with torch.no_grad():
        preds = [tok.decode(hf_greedy(model, ex.ids, 8, tok.eos_token_id), skip_special_tokens=True)
                 for ex in examples]
    r = records[0]
    assert (r["strategy"], r["length"]) == ("vanilla", 512) and r["predictions"] == preds
    want = [float(helmet_subem(p, list(ex.sample.outputs))) for p, ex in zip(preds, examples)]
    assert r["sample_scores"] == want and r["subem"] == round(100 * sum(want) / 3, 2)
    assert r["prompt_tokens"] == [len(ex.ids) for ex in examples] and r["prompt_tokens_max"] <= 512 - 8
    assert records[1]["strategy"] == "yarn" and "substring exact match" in (tmp_path / "run" / "results.md").read_text()


def test_end_to_end_on_the_bundled_model_from_the_cli(tmp_path):
    """``ropescale eval --task json_kv`` on the bundled model (T = 128) at 2T and 4T, a frequency strategy and a
    relative-position rule; a second run reads its samples from the cache (the relative-position rule decodes one
    prompt at a time through its kernel: the slow half, so the second run leaves it out)."""
    args = ["eval", "--task", "json_kv", "--model", "reference", "--lengths", "256,512", "--set",
            "json_kv.num_samples=2", "--set", "json_kv.shots=0", "--set", "json_kv.tokens_to_generate=8",
            "--device", "cpu", "-q", "--strategy", "yarn"]
    res = CliRunner().invoke(main, [*args, "--strategy", "self_extend", "-o", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in (tmp_path / "a" / "results.jsonl").read_text().splitlines()]
    assert sorted((r["strategy"], r["length"]) for r in recs) == [("self_extend", 256), ("self_extend", 512),
                                                                 ("yarn", 256), ("yarn", 512)]
    assert all(0 <= r["subem"] <= 100 and r["prompt_tokens_max"] + 8 <= r["length"] for r in recs)
    res = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    again = [json.loads(x) for x in (tmp_path / "b" / "results.jsonl").read_text().splitlines()]
    assert all(r["generation"]["cached"] for r in again)
    assert [r["predictions"] for r in again] == [r["predictions"] for r in recs if r["strategy"] == "yarn"]


def test_a_gold_pair_cut_from_the_context_has_no_depth(tok):
    # pairs far past L: HELMET's cut leaves a few pairs, the gold (index 0 … 511) mostly beyond them; its depth
    # index / (kept − 1) was reported as e.g. 257.5 on a 0 … 1 scale
    task = make(tok, num_samples=4, pairs=512, tokens_to_generate=8)
    examples = task.examples(512)
    record = task.combine([[(i, "") for i in range(4)]], examples, length=512, strategy=None)
    depths = record["gold_depths"]
    assert all(d is None or 0 <= d <= 1 for d in depths) and None in depths
    assert [d is not None for d in depths] == [ex.sample.index < n for ex, n in zip(examples, record["pairs"])]


def test_more_pairs_than_tokens_is_refused_before_drawing_them(tok):
    # pairs: 10**7 at 512 drew and tokenized ten million pairs to keep three: the run did not come back
    with pytest.raises(PromptError, match=r"^json_kv at 512 tokens: pairs=10000000 is more than 512 tokens can hold"):
        make(tok, num_samples=1, pairs=10**7, tokens_to_generate=8).examples(512)
