"""CLI options derived from config dataclasses (:mod:`qrecover.cli.config_options`): a field becomes an option with
its default, flag, short alias and help text, a ``negate`` bool is turned off by its flag, ``cli=False`` fields are
not options, ``only`` picks fields in order; every RecoverConfig field is an option of ``qrecover recover`` with the
dataclass's own default, and compress's, finetune's and tune's config options are their configs' fields."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from qrecover.cli import app as qrecover_app
from qrecover.cli.config_options import config_command
from qrecover.config import CompressConfig
from qrecover.fields import DictConfig, doc_field
from qrecover.recovery.config import FinetuneConfig, RecoverConfig, TuneConfig


@dataclass
class Toy(DictConfig):
    size: int = doc_field(3, "how many", short="-s")
    keep: bool = doc_field(True, "keep the cache", flag="--no-keep", negate=True)
    name: str | None = doc_field(None, "a name")
    hidden: int = doc_field(1, "set by the command itself", cli=False)


def toy_app() -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @config_command(Toy)
    def run(path: str = typer.Argument(...), config: dict | None = None) -> None:
        print(json.dumps({"path": path, **config}))

    return app


def test_fields_become_options():
    r = CliRunner().invoke(toy_app(), ["p"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"path": "p", "size": 3, "keep": True, "name": None}
    r = CliRunner().invoke(toy_app(), ["p", "-s", "5", "--no-keep", "--name", "q"])
    assert json.loads(r.output) == {"path": "p", "size": 5, "keep": False, "name": "q"}
    assert Toy(**{k: v for k, v in json.loads(r.output).items() if k != "path"}).size == 5


def test_help_and_refusals():
    r = CliRunner().invoke(toy_app(), ["--help"])
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "--size" in text and "How many." in text and "Turn off: keep the cache." in text
    assert "--hidden" not in text
    r = CliRunner().invoke(toy_app(), ["p", "--hidden", "2"])
    assert r.exit_code == 2
    r = CliRunner().invoke(toy_app(), ["p", "--size", "x"])
    assert r.exit_code == 2


def test_every_recover_config_field_is_a_recover_option():
    cmd = typer.main.get_command(qrecover_app).commands["recover"]
    params = {p.name: p for p in cmd.params}
    for f in dataclasses.fields(RecoverConfig):
        if f.metadata.get("cli") is False:  # the command's own option (recover's --mix is a path, checked with --data)
            continue
        p = params[f.name]
        assert p.opts[0] == f.metadata.get("flag", "--" + f.name.replace("_", "-")), f.name
        assert p.default == (False if f.metadata.get("negate") else f.default), f.name


def test_only_names_the_fields_in_order_where_config_stands():
    app = typer.Typer(add_completion=False)

    @app.command()
    @config_command(Toy, only=("name", "size"))
    def run(path: str = typer.Argument(...), config: dict | None = None, last: int = typer.Option(0, "--last")) -> None:
        print(json.dumps({"path": path, "last": last, **config}))

    cmd = typer.main.get_command(app)
    assert [p.name for p in cmd.params] == ["path", "name", "size", "last"]
    r = CliRunner().invoke(app, ["p", "-s", "5", "--last", "2"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"path": "p", "last": 2, "name": None, "size": 5}
    assert CliRunner().invoke(app, ["p", "--no-keep"]).exit_code == 2


@pytest.mark.parametrize("command,cls,own", [("compress", CompressConfig, ("bpw", "bits")), ("finetune", FinetuneConfig, ()),
                                             ("tune", TuneConfig, ("mix",))])
def test_config_fields_of_compress_finetune_and_tune_are_their_options(command, cls, own):
    """Each option named as a field of the command's config (but those it takes in a form of its own: ``own``) has the
    field's flag, short alias, default and help text."""
    params = {p.name: p for p in typer.main.get_command(qrecover_app).commands[command].params}
    fields = [f for f in dataclasses.fields(cls) if f.name in params and f.name not in own]
    assert len(fields) >= 8, command
    for f in fields:
        p = params[f.name]
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        assert "/".join([p.opts[0], *p.secondary_opts]) == flag and p.opts[1:] == [f.metadata.get("short")][:len(p.opts) - 1], f.name
        assert p.default == (False if f.metadata.get("negate") else f.default), f.name
        assert " ".join(f.metadata["help"].split())[1:] in " ".join(p.help.split()), f.name


def test_calibration_windows_default_to_64_and_32_for_the_quick_menu():
    """``--calib-samples`` unset: 64 windows for every menu but ``quick`` (32, the quick start's time); a given number
    wins either way; the resolved number is what a config (and so a checkpoint's manifest) records and reads back."""
    from qrecover.config import CALIB_SAMPLES, QUICK_CALIB_SAMPLES

    assert (CALIB_SAMPLES, QUICK_CALIB_SAMPLES) == (64, 32)
    assert CompressConfig().calib_samples == 64 and CompressConfig().encodings == "rot-mixed-blocks"
    assert CompressConfig(encodings="quick").calib_samples == 32
    assert CompressConfig(encodings="mixed-blocks").calib_samples == 64
    assert CompressConfig(scheme="gptq", bits=[4], bpw=None).calib_samples == 64
    assert CompressConfig(encodings="quick", calib_samples=48).calib_samples == 48
    again = CompressConfig.from_dict(json.loads(CompressConfig(encodings="quick").to_json()))
    assert again.calib_samples == 32 and again.to_dict() == CompressConfig(encodings="quick").to_dict()
    params = {p.name: p for p in typer.main.get_command(qrecover_app).commands["compress"].params}
    assert params["calib_samples"].default is None and "default: 64; 32 with --encodings quick" in params["calib_samples"].help
