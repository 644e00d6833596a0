"""Prepared data (``qrecover data prepare``) and its loader: the shards hold exactly the mix loader's tokens and
labels (checked against a direct tokenization with the real SmolLM2 tokenizer), any worker count writes the
same bytes, rank slices partition the global order, resume is exact on any world size, and every bad input
(another tokenizer, a truncated or corrupted shard, a bad mix, an unreachable hub) ends with one line and
leaves nothing on disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from char_tok import CharTok
from cli_helpers import run

from qrecover.data import mix as mixmod
from qrecover.data import prepare as prepmod
from qrecover.data.chat import IGNORE
from qrecover.data.decontam import EvalSet, build_index
from qrecover.data.mix import MixLoader, encode_document
from qrecover.data.mix_recipe import load_mix
from qrecover.data.prepare import prepare_data
from qrecover.data.shards import ShardLoader, read_data_manifest
from qrecover.errors import QRecoverError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # error messages on one console line
    monkeypatch.setattr(mixmod, "cache_dir", lambda: tmp_path / "cache")
    import qrecover.data.decontam as dc

    monkeypatch.setattr(dc, "cache_dir", lambda: tmp_path / "cache")


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def write_sources(root: Path) -> Path:
    """A text directory, a chat jsonl, a sharded jsonl directory (nested, one blank row) and a parquet directory
    (several row groups); returns the recipe path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    (root / "text").mkdir(parents=True)
    for i in range(3):
        (root / "text" / f"f{i}.txt").write_text(_text(rng, 120 + 40 * i))
    with open(root / "chat.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"messages": [{"role": "user", "content": _text(rng, 8)},
                                             {"role": "assistant", "content": _text(rng, 20 + i)}]}) + "\n")
    (root / "web" / "sub").mkdir(parents=True)
    for i in range(3):
        with open(root / "web" / ("sub" if i == 2 else "") / f"part-{i}.jsonl", "w") as f:
            for j in range(5):
                f.write(json.dumps({"text": "   " if (i, j) == (1, 2) else _text(rng, 30 + j)}) + "\n")
    (root / "pq").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": [_text(rng, 25 + j) for j in range(6)]}), root / "pq" / f"part-{i}.parquet", row_group_size=4)
    recipe = root / "mix.toml"
    recipe.write_text("""
[[source]]
name = "docs"
kind = "text"
weight = 2
path = "text"

[[source]]
name = "chat"
kind = "jsonl"
weight = 1
path = "chat.jsonl"

[[source]]
name = "web jsonl"
kind = "jsonl"
weight = 1
path = "web"

[[source]]
name = "web-parquet"
kind = "parquet"
weight = 1
path = "pq"
""")
    return recipe


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok) -> tuple[Path, Path]:
    """``(recipe, prepared dir)``: shards of 300 tokens, so sequences cross shard boundaries."""
    root = tmp_path_factory.mktemp("shards")
    recipe = write_sources(root / "src")
    prepare_data(recipe, root / "out", tokenizer=tok, workers=1, shard_tokens=300, decontaminate=False, show_progress=False)
    return recipe, root / "out"


def direct(recipe: Path, tok) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Per source: (ids, labels, document lengths) by encode_document on each document in base order."""
    loader = MixLoader(recipe, tok, seq_len=1, total_tokens=1, show_progress=False)
    out = {}
    for src in loader.mix.sources:
        docs = loader._open_docs(src)
        ids, labels, lengths = [], [], []
        for i in range(len(docs)):
            a, b = encode_document(tok, docs.get(i))
            if a:
                ids += a
                labels += b
                lengths.append(len(a))
        out[src.name] = (ids, labels, lengths)
    return out


def stored(out: Path, row: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.concatenate([np.load(out / sh["tokens"]["path"], mmap_mode="r") for sh in row["shards"]])
    mask = np.concatenate([np.unpackbits(np.load(out / sh["mask"]["path"]), bitorder="little")[: sh["n_tokens"]]
                           for sh in row["shards"]]).astype(bool)
    return ids, mask, np.load(out / row["documents_file"]["path"])


# --- prepare ---------------------------------------------------------------------------------------------


def test_shards_equal_direct_tokenization(prepared, tok):
    recipe, out = prepared
    m = read_data_manifest(out)
    ref = direct(recipe, tok)
    assert m["dtype"] == "uint16" and [s["name"] for s in m["sources"]] == ["docs", "chat", "web jsonl", "web-parquet"]
    assert m["mix"] == load_mix(recipe).to_dict() and m["decontamination"] is None
    for row in m["sources"]:
        ids, labels, lengths = ref[row["name"]]
        got, mask, offsets = stored(out, row)
        assert got.dtype == np.uint16 and row["tokens"] == len(ids) == len(got)
        assert got.tolist() == ids
        assert np.where(mask, got.astype(np.int64), IGNORE).tolist() == labels  # the chat loss mask is encode_document's
        assert offsets.tolist() == np.cumsum([0] + lengths).tolist() and row["documents"] == len(lengths)
        assert row["loss_tokens"] == sum(lab != IGNORE for lab in labels) and row["complete"]
        assert [sh["n_tokens"] for sh in row["shards"][:-1]] == [300] * (len(row["shards"]) - 1)
    chat = next(r for r in m["sources"] if r["name"] == "chat")
    assert 0 < chat["loss_tokens"] < chat["tokens"]  # only assistant tokens carry loss
    web = next(r for r in m["sources"] if r["name"] == "web jsonl")
    assert web["documents_read"] == 15 and web["documents"] == 14  # the blank row is read, not kept


def test_workers_write_identical_bytes(prepared, tok, tmp_path):
    recipe, out1 = prepared
    prepare_data(recipe, tmp_path / "w2", tokenizer=tok, workers=2, shard_tokens=300, decontaminate=False, show_progress=False)
    m1, m2 = read_data_manifest(out1), read_data_manifest(tmp_path / "w2")
    files = lambda m: [(f["path"], f["sha256"]) for s in m["sources"]  # noqa: E731
                       for f in [s["documents_file"]] + [x for sh in s["shards"] for x in (sh["tokens"], sh["mask"])]]
    assert files(m1) == files(m2) and m1["data_id"] == m2["data_id"] and m2["stats"]["workers"] == 2
    assert len(files(m1)) > 12


def test_tokens_cap_stops_each_source_at_its_share(prepared, tok, tmp_path):
    recipe, full = prepared
    m = prepare_data(recipe, tmp_path / "cap", tokenizer=tok, workers=2, tokens=600, decontaminate=False, show_progress=False)
    ref = direct(recipe, tok)
    for row in m["sources"]:
        cap = int(np.ceil(600 * row["fraction"]))
        lengths = ref[row["name"]][2]
        n = int(np.searchsorted(np.cumsum(lengths), cap)) + 1  # documents until the share is reached
        assert row["tokens"] == sum(lengths[:n]) >= cap and not row["complete"]
        ids, _, _ = stored(tmp_path / "cap", row)
        assert ids.tolist() == ref[row["name"]][0][: row["tokens"]]


def test_decontamination_drops_and_reports(tmp_path, tok):
    recipe = write_sources(tmp_path / "src")
    rows = (tmp_path / "src" / "chat.jsonl").read_text().splitlines()
    leaked = json.loads(rows[3])["messages"][1]["content"]
    index = build_index([EvalSet("bench", [], lambda: iter([("q1", leaked)]))], use_cache=False)
    m = prepare_data(recipe, tmp_path / "out", tokenizer=tok, workers=2, exclude=index, decontaminate=False, show_progress=False)
    chat = next(r for r in m["sources"] if r["name"] == "chat")
    rep = m["decontamination"]["sources"]["chat"]
    assert rep["documents_dropped"] == 1 and rep["removed"][0]["doc"] == f"chat.jsonl@{sum(len(r) + 1 for r in rows[:3])}"
    assert rep["removed"][0]["item_id"] == "q1" and rep["scanned"] == 6
    assert chat["documents"] == 5 and chat["documents_read"] == 6
    expect = sum(len(encode_document(tok, json.loads(r)["messages"])[0]) for i, r in enumerate(rows) if i != 3)
    assert chat["tokens"] == expect
    assert m["decontamination"]["index"]["fingerprint"] == index.fingerprint


# --- the loader ------------------------------------------------------------------------------------------


def test_sequences_are_windows_of_the_streams(prepared, tok):
    recipe, out = prepared
    ref = direct(recipe, tok)
    loader = ShardLoader(out, tok, seq_len=64, total_tokens=64 * 60, seed=3)
    names = [s["name"] for s in loader.sources]
    seen: dict[str, list[int]] = {n: [] for n in names}
    for i, item in enumerate(loader):
        s = int(loader._src[i])
        start = loader._window(s, int(loader._local[i]))
        ids, labels, _ = ref[names[s]]
        assert item["source"] == names[s] and item["input_ids"].dtype == torch.long
        assert item["input_ids"].tolist() == ids[start : start + 64] and item["labels"].tolist() == labels[start : start + 64]
        seen[names[s]].append(start)
    assert [len(seen[n]) for n in names] == loader.targets == [24, 12, 12, 12]
    # within an epoch each window once; every prefix within one sequence of its share
    for n in names:
        w = loader._streams[names.index(n)].tokens // 64
        assert len(set(seen[n][:w])) == min(w, len(seen[n]))
    counts = np.cumsum(np.eye(4)[loader._src], 0)
    k = np.arange(1, loader.num_sequences + 1)[:, None]
    assert np.abs(counts - k * np.asarray(loader.targets) / loader.num_sequences).max() < 1


@pytest.mark.parametrize("world", [2, 3])
def test_rank_slices_partition_the_order(prepared, tok, world, monkeypatch):
    _, out = prepared
    total = 32 * 36
    order = [(s["input_ids"], s["labels"]) for s in ShardLoader(out, tok, seq_len=32, total_tokens=total)]
    b = 2
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for rank in range(world):
        loader = ShardLoader(out, tok, seq_len=32, total_tokens=total)
        read = []
        orig = loader.sequence
        monkeypatch.setattr(loader, "sequence", lambda i, orig=orig, read=read: (read.append(i), orig(i))[1])
        for k, (ids, labels) in enumerate(loader.batches(b, rank, world)):
            assert ids.shape == labels.shape == (b, 32)
            for j in range(b):
                got[k * b * world + rank + j * world] = (ids[j], labels[j])
        assert read and all(i % world == rank for i in read) and len(read) == len(set(read))  # its own sequences only
    n = len(order) // (b * world) * (b * world)
    assert sorted(got) == list(range(n))
    for i in range(n):
        assert torch.equal(got[i][0], order[i][0]) and torch.equal(got[i][1], order[i][1])


def test_resume_is_exact_on_any_world(prepared, tok):
    _, out = prepared
    total = 32 * 40
    full = [s["input_ids"] for s in ShardLoader(out, tok, seq_len=32, total_tokens=total, seed=5)]
    a = ShardLoader(out, tok, seq_len=32, total_tokens=total, seed=5)
    it = iter(a)
    first = [next(it)["input_ids"] for _ in range(13)]
    state = json.loads(json.dumps(a.state_dict()))
    b = ShardLoader(out, tok, seq_len=32, total_tokens=total, seed=5)
    b.load_state_dict(state)
    rest = [s["input_ids"] for s in b]
    assert all(torch.equal(x, y) for x, y in zip(first + rest, full)) and len(first + rest) == len(full)
    # 2 ranks x batch 2 for 3 steps, then 1 rank x batch 4 (the same global batch of 4) from rank 0's state
    r0 = ShardLoader(out, tok, seq_len=32, total_tokens=total, seed=5)
    batches = r0.batches(2, 0, 2)
    for _ in range(3):
        next(batches)
    one = ShardLoader(out, tok, seq_len=32, total_tokens=total, seed=5)
    one.load_state_dict(r0.state_dict())
    ids, _ = next(one.batches(4, 0, 1))
    assert all(torch.equal(ids[j], full[12 + j]) for j in range(4))
    assert one.report()["sequences"] == 16 and sum(s["sequences"] for s in one.report()["sources"].values()) == 16
    with pytest.raises(QRecoverError, match="different settings"):
        ShardLoader(out, tok, seq_len=32, total_tokens=total, seed=6).load_state_dict(state)
    with pytest.raises(QRecoverError, match="on-the-fly mix loader"):
        b.load_state_dict({"version": 1, "config": {}, "sequences": 0, "sources": {}})


def test_other_tokenizer_refused(prepared):
    _, out = prepared
    fp = read_data_manifest(out)["tokenizer"]["fingerprint"]
    with pytest.raises(QRecoverError) as e:
        ShardLoader(out, CharTok(), seq_len=32)
    msg = str(e.value)
    assert fp[:16] in msg and mixmod.tokenizer_fingerprint(CharTok())[:16] in msg and "prepare it again" in msg and "\n" not in msg


def test_truncated_or_corrupted_shard_detected(prepared, tok, tmp_path):
    import shutil

    _, out = prepared
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    row = read_data_manifest(bad)["sources"][2]
    path = bad / row["shards"][1]["tokens"]["path"]
    data = path.read_bytes()
    path.write_bytes(data[:-6])
    with pytest.raises(QRecoverError) as e:
        ShardLoader(bad, tok, seq_len=32)
    assert "truncated" in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    path.write_bytes(bytes(flipped))
    ShardLoader(bad, tok, seq_len=32)  # same size: only the hash notices
    with pytest.raises(QRecoverError, match="does not match its sha256"):
        ShardLoader(bad, tok, seq_len=32, verify="sha256")


def test_loader_errors(prepared, tok, tmp_path):
    _, out = prepared
    with pytest.raises(QRecoverError, match="fewer tokens than one sequence"):
        ShardLoader(out, tok, seq_len=4096)
    with pytest.raises(QRecoverError, match="rank=2 must be"):
        next(ShardLoader(out, tok, seq_len=32).batches(1, 2, 2))
    with pytest.raises(QRecoverError, match="not prepared data"):
        ShardLoader(tmp_path, tok)


# --- CLI and failures --------------------------------------------------------------------------------------


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if name in p.name]


def test_cli_prepare_and_bad_mix(prepared, tiny_model_dir, tmp_path, capsys):
    recipe, ref = prepared
    code, out, err = run(["data", "prepare", recipe, "--out", tmp_path / "cli", "--model", tiny_model_dir, "--workers", "2",
                          "--shard-tokens", "300", "--no-decontaminate", "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["data_id"] == read_data_manifest(ref)["data_id"] and summary["sources"]["chat"]["shards"] >= 2
    code, _, err = run(["data", "prepare", recipe, "--out", tmp_path / "cli", "--model", tiny_model_dir], capsys)
    assert code == 2 and "already exists; pass --overwrite" in err
    code, _, err = run(["data", "prepare", tmp_path / "nope.toml", "--out", tmp_path / "x"], capsys)
    assert code == 2 and "nope.toml" in err and "does not exist" in err
    bad = tmp_path / "bad.toml"
    bad.write_text('[[source]]\nname = "a"\nkind = "csv"\nweight = 1\n')
    code, _, err = run(["data", "prepare", bad, "--out", tmp_path / "x"], capsys)
    assert code == 2 and "unknown kind 'csv'" in err
    assert not (tmp_path / "x").exists() and _leftovers(tmp_path, ".x.tmp") == []


def test_error_midway_leaves_nothing(tmp_path, tok, tiny_model_dir, capsys):
    recipe = write_sources(tmp_path / "src")
    with open(tmp_path / "src" / "web" / "sub" / "part-2.jsonl", "a") as f:
        f.write("{not json\n")
    code, _, err = run(["data", "prepare", recipe, "--out", tmp_path / "o", "--model", tiny_model_dir, "--workers", "2",
                        "--no-decontaminate"], capsys)
    assert code == 2 and "part-2.jsonl@" in err and "is not valid JSON" in err
    assert not (tmp_path / "o").exists() and _leftovers(tmp_path, ".o.tmp") == []


def test_interrupt_leaves_nothing(tmp_path, tok, monkeypatch):
    recipe = write_sources(tmp_path / "src")
    calls = []

    def interrupt(self):
        calls.append(self.rel)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return orig(self)

    orig = prepmod._ShardWriter.close
    monkeypatch.setattr(prepmod._ShardWriter, "close", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(recipe, tmp_path / "o", tokenizer=tok, workers=2, decontaminate=False, show_progress=False)
    assert len(calls) == 2 and not (tmp_path / "o").exists() and _leftovers(tmp_path, ".o.tmp") == []


def test_hf_unreachable_is_one_line(tmp_path, tok, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    recipe = tmp_path / "hf.toml"
    recipe.write_text('[[source]]\nname = "smol"\nkind = "hf"\nweight = 1\ndataset = "HuggingFaceTB/smoltalk"\nconfig = "all"\n')
    with pytest.raises(QRecoverError, match="without an end; pass --tokens"):
        prepare_data(recipe, tmp_path / "o", tokenizer=tok, decontaminate=False, show_progress=False)
    with pytest.raises(QRecoverError) as e:
        prepare_data(recipe, tmp_path / "o", tokenizer=tok, tokens=1000, decontaminate=False, show_progress=False)
    assert "cannot open the Hugging Face dataset 'HuggingFaceTB/smoltalk'" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()


def test_recover_trains_from_prepared_data(prepared, tiny_ckpt, tmp_path, capsys):
    _, data = prepared
    out = tmp_path / "lora"
    code, _, err = run(["recover", tiny_ckpt, "--data", data, "--tokens", "128", "--seq-len", "32", "--batch-size", "2",
                        "--objective", "ce", "--init", "zero", "--no-decontaminate", "--out", out, "--json"], capsys)
    assert code == 0, err
    report = json.loads((out / "data_report.json").read_text())
    assert report["kind"] == "shards" and report["sequences"] == 4 and report["data_id"] == read_data_manifest(data)["data_id"]
    code, _, err = run(["recover", tiny_ckpt, "--data", data, "--tokens", "128", "--out", tmp_path / "l2"], capsys)
    assert code == 2 and "--no-decontaminate" in err and not (tmp_path / "l2").exists()
    other = tmp_path / "chartok"
    text_only = tmp_path / "text.toml"
    text_only.write_text(f'[[source]]\nname = "docs"\nkind = "text"\nweight = 1\npath = "{data.parent / "src" / "text"}"\n')
    prepare_data(text_only, other, tokenizer=CharTok(), workers=1, decontaminate=False, show_progress=False)
    code, _, err = run(["recover", tiny_ckpt, "--data", other, "--tokens", "128", "--no-decontaminate", "--out", tmp_path / "l3"], capsys)
    assert code == 2 and "another tokenizer" in err and "qrecover data prepare" in err and not (tmp_path / "l3").exists()


def test_cli_help(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "data" in out
    code, out, err = run(["data", "prepare", "--help"], capsys)
    assert code == 0, err
    for opt in ("--out", "--model", "--workers", "--tokens", "--shard-tokens", "--overwrite", "--no-decontaminate", "Examples"):
        assert opt in out, opt
    code, out, _ = run(["recover", "--help"], capsys)
    assert code == 0 and "--data" in out


def test_hf_streaming_source(tmp_path, tok):
    """kind 'hf' through a local builder (no hub needed): the parent streams, workers tokenize, --tokens ends it."""
    write_sources(tmp_path / "src")
    web = sorted((tmp_path / "src" / "web").rglob("*.jsonl"))
    hf = tmp_path / "hf.toml"
    hf.write_text(f'[[source]]\nname = "stream"\nkind = "hf"\nweight = 1\ndataset = "json"\ndata_files = "{web[0]}"\n')
    m = prepare_data(hf, tmp_path / "o", tokenizer=tok, workers=2, tokens=100, decontaminate=False, show_progress=False)
    rows = [json.loads(line)["text"] for line in web[0].read_text().splitlines()]
    lengths = [len(encode_document(tok, r)[0]) for r in rows]
    n = int(np.searchsorted(np.cumsum(lengths), 100)) + 1
    row = m["sources"][0]
    assert row["tokens"] == sum(lengths[:n]) and row["documents"] == n and not row["complete"]
    ids, _, _ = stored(tmp_path / "o", row)
    assert ids.tolist() == [t for r in rows[:n] for t in encode_document(tok, r)[0]]
