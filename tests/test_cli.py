"""Tests for the ``qrecover`` command line, run in-process through ``qrecover.cli.main(argv)``.

Checks: ``--help`` of the app and of every command exits 0 and lists the command's options;
``compress --json`` on the tiny model prints JSON with the measured bpw and writes a checkpoint that
``info`` (JSON and table) and ``ppl --json`` (finite perplexity > 1) read; bad input exits with code 2,
an ``error:`` message naming the problem on stderr and no traceback: missing model, ``--bpw 0``,
``--bpw -1``, ``--bits 5``, ``--bits x``, an existing ``--out``, an infeasible ``--bpw 1.0``, ``info`` on
a directory that is not a checkpoint, bad ``ppl`` window counts; and error messages are printed
verbatim (a path with brackets is not eaten as console markup).
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from cli_helpers import run

from qrecover.cli import main

COMMANDS = {
    "compress": ["--bpw", "--uniform", "--model", "--bits", "--scope", "--scheme", "--group-size", "--block-size",
                 "--embedding-bits", "--allocation", "--calib-data", "--calib-samples", "--seq-len", "--out",
                 "--overwrite", "--json"],
    "info": ["--layers", "--json"],
    "ppl": ["--data", "--windows", "--seq-len", "--json"],
}


def flat(s: str) -> str:
    """Whitespace collapsed: the console wraps long messages."""
    return " ".join(s.split())


def expect_error(argv, capsys, *needles):
    code, out, err = run(argv, capsys)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    msg = flat(err)
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_app_help(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for c in COMMANDS:
        assert c in out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_help(command, capsys):
    code, out, err = run([command, "--help"], capsys)
    assert code == 0, err
    for opt in COMMANDS[command]:
        assert opt in out, (command, opt)
    assert "Examples" in out


@pytest.fixture(scope="module")
def cli_ckpt(tiny_model_dir, tmp_path_factory):
    """``(out dir, exit code, stdout)`` of one ``compress --json`` run on the tiny model."""
    out = tmp_path_factory.mktemp("cli") / "ck"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main(["compress", "--model", str(tiny_model_dir), "--bpw", "5", "--calib-samples", "2", "--seq-len", "64",
                  "--bits", "2,3,4", "--out", str(out), "--json"])  # the tiny_ckpt fixture's menu
            code = 0
        except SystemExit as e:
            code = e.code or 0
    return out, code, buf.getvalue()


def test_compress_json(cli_ckpt, tiny_ckpt):
    """The printed summary is valid JSON (and only JSON on stdout) with the measured bpw of the written files."""
    out, code, stdout = cli_ckpt
    assert code == 0
    assert (out / "qrecover.json").is_file() and (out / "model.safetensors").is_file()
    summary = json.loads(stdout)
    man = json.loads((out / "qrecover.json").read_text())
    assert man["budget"]["bpw"] == 5.0 and man["calibration"]["windows"] == 2 and man["calibration"]["seq_len"] == 64
    assert summary["measured_bpw"] == man["measured_bpw"]
    assert summary["out"] == str(out)
    assert summary["bytes"]["total"] == man["bytes"]["total"]
    assert 4.2 < summary["measured_bpw"]["model"] <= 5.0
    # the same configuration through the API gives the same bytes (the pipeline is deterministic)
    api_man = json.loads((tiny_ckpt / "qrecover.json").read_text())
    assert man["weights_file"]["sha256"] == api_man["weights_file"]["sha256"]


def test_info_json(cli_ckpt, capsys):
    out = cli_ckpt[0]
    code, stdout, err = run(["info", out, "--json"], capsys)
    assert code == 0, err
    m = json.loads(stdout)
    assert m == json.loads((out / "qrecover.json").read_text())


def test_info_table(cli_ckpt, capsys):
    out = cli_ckpt[0]
    man = json.loads((out / "qrecover.json").read_text())
    code, stdout, err = run(["info", out, "--layers"], capsys)
    assert code == 0, err
    text = flat(err + stdout)
    assert "measured bpw" in text and f"{man['measured_bpw']['model']:.4f}" in text
    assert "LlamaForCausalLM" in text
    for name in man["layers"]:  # --layers lists every layer, under its full name (q/k/v/o differ at the end)
        assert name in text, name


def test_ppl_json(cli_ckpt, capsys):
    out = cli_ckpt[0]
    code, stdout, err = run(["ppl", out, "--windows", "2", "--seq-len", "32", "--json"], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    assert math.isfinite(r["ppl"]) and r["ppl"] > 1.0
    assert r["tokens"] == 2 * 31 and r["kind"] == "qrecover"
    assert r["measured_bpw"]["model"] <= 5.0


def test_ppl_names_its_text_and_the_adapter_it_applied(cli_ckpt, capsys, tmp_path):
    from qrecover.adapters.lora import attach_lora, base_identity, save_adapter
    from qrecover.loading import load

    out = cli_ckpt[0]
    save_adapter(attach_lora(load(out), rank=2), tmp_path / "ad", base_identity(out), 10**6)
    code, stdout, err = run(["ppl", out, "--windows", "1", "--seq-len", "16"], capsys)
    assert code == 0, err
    text = flat(err + stdout)
    assert "python-docs's eval split" in text and f"for {out}" in text and "adapter" not in text
    code, stdout, err = run(["ppl", out, "--windows", "1", "--seq-len", "16", "--adapter", tmp_path / "ad"], capsys)
    assert code == 0, err
    assert f"with adapter {tmp_path / 'ad'}" in flat(err + stdout)


def test_ppl_original_model(tiny_model_dir, capsys):
    code, stdout, err = run(["ppl", tiny_model_dir, "--windows", "1", "--seq-len", "16", "--json"], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    assert r["kind"] == "hf" and math.isfinite(r["ppl"]) and r["ppl"] > 1.0


# --- bad input -----------------------------------------------------------------------------------------------


def compress_args(model, out, *extra):
    return ["compress", "--model", model, "--calib-samples", "2", "--seq-len", "64", "--out", out, *extra]


def test_missing_model(tmp_path, capsys):
    expect_error(compress_args(tmp_path / "nope", tmp_path / "o", "--bpw", "5"), capsys, "error:", "does not exist")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bpw", ["0", "-1"])
def test_bpw_not_positive(bpw, tiny_model_dir, tmp_path, capsys):
    expect_error(compress_args(tiny_model_dir, tmp_path / "o", "--bpw", bpw), capsys, "error:", f"--bpw {float(bpw)}",
                 "must be positive")
    assert not (tmp_path / "o").exists()


def test_bpw_not_a_number(tiny_model_dir, tmp_path, capsys):
    code, _, err = run(compress_args(tiny_model_dir, tmp_path / "o", "--bpw", "abc"), capsys)
    assert code == 2 and "Traceback" not in err and "Invalid value for '--bpw'" in flat(err)


def test_bits_unsupported(tiny_model_dir, tmp_path, capsys):
    msg = expect_error(compress_args(tiny_model_dir, tmp_path / "o", "--bpw", "5", "--bits", "5"), capsys,
                       "error:", "does not support")
    assert "--bits 5" in msg or "bits=5" in msg, msg
    assert not (tmp_path / "o").exists()


def test_bits_not_integers(tiny_model_dir, tmp_path, capsys):
    expect_error(compress_args(tiny_model_dir, tmp_path / "o", "--bpw", "5", "--bits", "x"), capsys,
                 "error:", "--bits 'x'", "comma-separated integers")


def test_existing_out(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    expect_error(compress_args(tiny_model_dir, tmp_path / "o", "--bpw", "5"), capsys, "error:", "already exists",
                 "--overwrite")
    # a bad value is named first: fixing the output directory alone would not make the command work
    expect_error(compress_args(tiny_model_dir, tmp_path / "o", "--bpw", "5", "--encodings", "nope"), capsys, "error:",
                 "--encodings: 'nope' is not an encoding spec")


def test_infeasible_bpw(tiny_model_dir, tmp_path, capsys):
    expect_error(compress_args(tiny_model_dir, tmp_path / "o", "--bpw", "1.0"), capsys, "error:", "--bpw 1.0",
                 "smallest", "largest")
    assert not (tmp_path / "o").exists()


def test_info_not_a_checkpoint(tmp_path, capsys):
    expect_error(["info", tmp_path], capsys, "error:", "not a qrecover checkpoint")


def test_ppl_bad_windows(tmp_path, capsys):
    expect_error(["ppl", tmp_path, "--windows", "0"], capsys, "error:", "--windows 0")


def test_error_message_printed_verbatim(tmp_path, capsys):
    """Paths are user data: ``[ck]`` in a directory name must reach the user, not be parsed as console markup."""
    d = tmp_path / "run[ck]"
    d.mkdir()
    msg = expect_error(["info", d], capsys, "error:", "not a qrecover checkpoint")
    assert "run[ck]" in msg, msg


def test_error_message_is_not_wrapped_inside_a_path(tmp_path, capsys, monkeypatch):
    """A path longer than the console is one word in the message (the terminal wraps it): no newline is inserted into
    it, so it can be copied."""
    monkeypatch.setenv("COLUMNS", "40")
    d = tmp_path / ("a-directory-name-longer-than-the-console-" * 2)
    d.mkdir()
    code, _, err = run(["info", d], capsys)
    assert code == 2
    assert str(d) in err, err
    assert err.count("\n") == 1, err


def test_not_a_causal_lm(tiny_model_dir, tmp_path, capsys):
    """A model type with no causal-LM class (DistilBERT) is refused with a message, not a traceback."""
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertModel

    d = tmp_path / "distilbert"
    DistilBertModel(DistilBertConfig(vocab_size=1024, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).save_pretrained(d)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(d)
    expect_error(compress_args(d, tmp_path / "o", "--bpw", "5"), capsys, "error:", "causal")
    assert not (tmp_path / "o").exists()


def test_single_width_without_bpw_is_uniform(tiny_model_dir, tmp_path, capsys):
    """`--bits 4` and no `--bpw` gives a uniform model (every linear layer at 4 bits), as the issue asks;
    `--uniform` with `--bpw` is a contradiction (exit 2)."""
    out = tmp_path / "u4"
    code, stdout, err = run(["compress", "--model", str(tiny_model_dir), "--bits", "4", "--calib-samples", "1",
                             "--seq-len", "32", "--out", str(out), "--json"], capsys)
    assert code == 0, err
    man = json.loads((out / "qrecover.json").read_text())
    assert man["budget"]["bpw"] is None
    assert {v["bits"] for v in man["layers"].values() if v["kind"] == "linear"} == {4}
    code, _, err = run(["compress", "--model", str(tiny_model_dir), "--uniform", "--bpw", "5", "--bits", "4",
                        "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "contradict" in err


# --- bad model files and budgets: refused before any work, nothing left on disk ----------------------------


def _nothing_written(tmp_path, *inputs):
    """The output directory does not exist and no temporary directory was left beside it."""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(inputs)


def test_model_dir_without_weights(tiny_model_dir, tmp_path, capsys):
    d = tmp_path / "noweights"
    d.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    msg = expect_error(compress_args(d, tmp_path / "o", "--bpw", "5"), capsys, "error:", "noweights",
                       "has a config.json but no weights", "*.safetensors", "save_pretrained")
    assert msg.count("error:") == 1
    _nothing_written(tmp_path, "noweights")


def _write_gguf(path, n=256):
    """A small valid GGUF (v3): llama metadata and two float tensors (4 x 64 f32, n f16)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("a", np.arange(256, dtype=np.float32).reshape(4, 64))
    w.add_tensor("b", np.ones(n, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.mark.parametrize("keep, needle", [(-1, "is truncated: "), (-600, "is truncated: "), (40, "truncated or corrupted"),
                                          (3, "is not a GGUF file")])
def test_truncated_gguf(keep, needle, tmp_path, capsys):
    """A .gguf cut anywhere (in the tensor data, the header, the magic bytes) is refused from its header."""
    from qrecover.models import check_gguf

    whole = _write_gguf(tmp_path / "whole.gguf")
    check_gguf(tmp_path / "whole.gguf")  # the complete file passes
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    msg = expect_error(compress_args(cut, tmp_path / "o", "--bpw", "5"), capsys, "error:", "cut.gguf", needle,
                       "pass a complete .gguf file")
    if needle == "is truncated: ":
        assert f"{len(whole[:keep]):,} bytes, its GGUF header describes {len(whole):,}" in msg, msg
    _nothing_written(tmp_path, "whole.gguf", "cut.gguf")


def test_not_a_gguf_file(tmp_path, capsys):
    f = tmp_path / "model.gguf"
    f.write_text('{"not": "a gguf"}\n')
    expect_error(compress_args(f, tmp_path / "o", "--bpw", "5"), capsys, "error:", "model.gguf",
                 "is not a GGUF file", "b'{\"no'", "pass a complete .gguf file")
    _nothing_written(tmp_path, "model.gguf")


@pytest.mark.parametrize("bpw", ["inf", "-inf", "nan"])
def test_bpw_not_finite(bpw, tiny_model_dir, tmp_path, capsys):
    expect_error(compress_args(tiny_model_dir, tmp_path / "o", "--bpw", bpw), capsys, "error:",
                 f"--bpw {float(bpw)}", "must be positive and finite", "--bpw 3.7")
    _nothing_written(tmp_path)


# --- encodings as specs, finalize, device (appended with the staged compress) ---------------------------------


def test_compress_help_lists_spec_options(capsys):
    code, out, _ = run(["compress", "--help"], capsys)
    assert code == 0
    for opt in ("--encodings", "--embedding-encodings", "--scheme-param", "--no-finalize", "--device", "gptq:4/g64"):
        assert opt in out, opt


@pytest.mark.parametrize("args, needles", [
    (["--encodings", "palettize:4,gtpq:4/g64"], ["'gtpq:4/g64'", "unknown scheme", "registered schemes"]),
    (["--encodings", "palettize:4:2"], ["'palettize:4:2'", "integer width"]),
    (["--encodings", "blockwise:4/b48"], ["'blockwise:4/b48'", "block_size=48", "divisor"]),
    (["--encodings", "palettize:4/g7"], ["'palettize:4/g7'", "group_size=7", "divide"]),
    (["--embedding-encodings", "blockwise:4/zz"], ["--embedding-encodings", "'blockwise:4/zz'", "option 'zz'"]),
    (["--scheme-param", "group_size"], ["--scheme-param 'group_size' must be KEY=VALUE"]),
    (["--bits", "2,3", "--scheme-param", "nonsense=1"], ["'palettize'", "no parameter(s) ['nonsense']"]),
    (["--scheme-param", "nonsense=1"], ["--scheme-param nonsense", "'rot-mixed-blocks'", "drop it"]),
    (["--device", "tpu"], ["--device 'tpu'", "cpu, cuda"]),
])
def test_bad_spec_exit_2(args, needles, tiny_model_dir, tmp_path, capsys):
    msg = expect_error(["compress", "--model", str(tiny_model_dir), "--out", str(tmp_path / "x"), *args], capsys, *needles)
    assert msg.count("error:") == 1
    assert not (tmp_path / "x").exists()


def test_transform_without_mapping_exit_2(tiny_model_dir, tmp_path, capsys):
    """A transform whose check() refuses the architecture: one-line error, exit 2, before calibration."""
    from qrecover.errors import QRecoverError
    from qrecover.transforms import Transform, register_transform

    @register_transform
    class _NoMap(Transform):
        name = "t_nomap"

        def check(self, model):
            raise QRecoverError(f"t_nomap has no mapping for {type(model).__name__}; supported: (none)")

    expect_error(["compress", "--model", str(tiny_model_dir), "--encodings", "t_nomap+palettize:4,palettize:2",
                  "--out", str(tmp_path / "x")], capsys, "t_nomap has no mapping for LlamaForCausalLM")
    assert not (tmp_path / "x").exists()


def test_uniform_spec_no_finalize_and_info_layers(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "u"
    code, stdout, err = run(["compress", "--model", str(tiny_model_dir), "--encodings", "blockwise:4/b32/asym",
                             "--no-finalize", "--device", "cpu", "--calib-samples", "1", "--seq-len", "16",
                             "--out", str(out), "--json"], capsys)
    assert code == 0, err
    s = json.loads(stdout)
    assert s["finalize"] is False and s["budget"]["bpw"] is None
    code, stdout, err = run(["info", str(out), "--layers"], capsys)
    assert code == 0, err
    assert "blockwise:4/b32/asym" in stdout and "model.layers.1.mlp.down_proj" in stdout
    assert "finalize" in flat(err + stdout)


@pytest.mark.parametrize("command", [["recover"], ["tune", "--out", "T"], ["finetune", "--init-adapter", "A", "--data", "D",
                                                                           "--out", "F"]])
def test_commands_on_a_checkpoint_name_a_missing_one_as_such(command, capsys, tmp_path):
    """``recover``, ``tune`` and ``finetune`` take a compressed checkpoint: a path that does not exist is named as a
    checkpoint, with how to make one (not as a model to download), exit 2, nothing written."""
    missing = tmp_path / "ckpt"
    argv = [command[0], str(missing), *[str(tmp_path / a) if a in ("T", "A", "D", "F") else a for a in command[1:]]]
    expect_error(argv, capsys, f"checkpoint '{missing}' does not exist", "qrecover compress --out DIR")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["recover"], ["tune", "--out", "T"], ["finetune", "--init-adapter", "A", "--data", "D",
                                                                           "--out", "F"]])
def test_commands_on_a_checkpoint_name_a_directory_that_is_none(command, capsys, tmp_path):
    """A directory that exists but holds neither a checkpoint's manifest nor a model's config is named as not a
    checkpoint (before: "has no config.json: not a Hugging Face model directory"), exit 2, nothing written."""
    empty = tmp_path / "ckpt"
    empty.mkdir()
    argv = [command[0], str(empty), *[str(tmp_path / a) if a in ("T", "A", "D", "F") else a for a in command[1:]]]
    expect_error(argv, capsys, f"'{empty}' is not a qrecover checkpoint (no qrecover.json)", "qrecover compress --out DIR")
    assert list(tmp_path.iterdir()) == [empty] and list(empty.iterdir()) == []


@pytest.mark.parametrize("flag,value", [("--calib-samples", "0"), ("--seq-len", "-5")])
def test_compress_window_flags_named_in_errors(flag, value, tiny_model_dir, tmp_path, capsys):
    expect_error(compress_args(tiny_model_dir, tmp_path / "o", flag, value), capsys, f"{flag} {value} must be positive, e.g. {flag} ")
    assert not (tmp_path / "o").exists()


def _commands(cmd, path=()):
    """Every (sub)command of the click tree typer builds, with its argv prefix."""
    yield list(path), cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_help_shows_bracketed_text_as_written(capsys):
    """typer renders help as rich markup, where ``[train-gpu]`` or ``[[source]]`` would be taken for a style tag and
    vanish; every bracketed word in a help text, an option's help or an epilog must reach ``--help`` as written."""
    import re

    import typer.main

    from qrecover.cli import app

    checked = 0
    for path, cmd in _commands(typer.main.get_command(app)):
        texts = [cmd.help or "", cmd.epilog or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        wanted = [m.replace("\\[", "[") for t in texts for m in re.findall(r"\\?\[[^\]\n]*\]+", t)]
        if not wanted:
            continue
        code, out, err = run([*path, "--help"], capsys)
        assert code == 0, err
        shown = "".join(out.split())
        for w in wanted:
            assert "".join(w.split()) in shown, (path, w)
            checked += 1
    assert checked >= 4  # [train-gpu] (recover, finetune), [tune], [[source]] at least
