"""Compression on several processes: ``torchrun --nproc_per_node 2 -m qrecover.cli compress`` (gloo, CPU) writes the
bytes of one process, and a process that fails leaves nothing on disk.

The tiny model (tests/conftest.py) on 3 calibration windows (split 2 + 1: an uneven share), for the default menu
(mixed-blocks, whole-model budget: the embedding's ten candidates are shared out too) and for a GPTQ menu: every
file of the checkpoint has the sha256 of the 1-process checkpoint, the manifest's too once its timing fields (when
it was written, how long it took) are set aside. :mod:`qrecover.distributed`'s pieces are checked alone: the window
spans, the job assignment, and the ordered sums against a plain sequential float64 sum.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from qrecover.api import compress
from qrecover.config import CompressConfig
from qrecover.distributed import OrderedSum, World
from qrecover.errors import QRecoverError

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with the gloo backend is not available in this torch build")

ROOT = Path(__file__).parents[1]
RUN = dict(bpw=4.3, calib_samples=3, seq_len=64)  # the linear layers take several encodings (both menus)
MENUS = {"default": None, "gptq": "gptq:3/g64,gptq:4/g64"}
TIMING = ("created", "seconds", "prepare_seconds")

FAIL_AT_COMMIT = '''"""Rank 1 fails where rank 0 has the whole checkpoint written in its temporary directory."""
import os
from qrecover import distributed
from qrecover.cli import main

if os.environ["RANK"] == "1":
    def fail(self):
        raise RuntimeError("rank 1 fails before the checkpoint is committed")
    distributed.World.barrier = fail
main()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(entry: list[str], *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), *entry, "compress", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _cli_args(model: Path, out: Path, menu: str | None) -> list[str]:
    return ["--model", str(model), "--bpw", str(RUN["bpw"]), "--calib-samples", str(RUN["calib_samples"]),
            "--seq-len", str(RUN["seq_len"]), "--out", str(out), "--json", *(["--encodings", menu] if menu else [])]


def _digests(ckpt: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir())}


def _close(a, b) -> bool:
    """``a == b`` for JSON values, floats to 1e-12 relative."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
    return a == b


def _differences(a, b, path: str = "") -> list[str]:
    """The JSON paths where ``a`` and ``b`` are not :func:`_close` (for the failure message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [f"{path}: keys {sorted(a.keys() ^ b.keys())}"] * (a.keys() != b.keys()) + [
            d for k in a.keys() & b.keys() for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if _close(a, b) else [f"{path}: {a!r} != {b!r}"[:300]]


def _manifest(ckpt: Path) -> dict:
    m = json.loads((ckpt / "qrecover.json").read_text())
    for k in TIMING:
        m.pop(k)
    m["finalize"].pop("seconds")
    return m


@pytest.mark.parametrize("menu", list(MENUS))
def test_two_processes_write_the_bytes_of_one(menu, tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process (OMP_NUM_THREADS=1): the damage sums then agree to 1e-12; with
    try:  # two threads here they differed at 1e-8 (another reduction order), the weights identical either way
        compress(CompressConfig(model=str(tiny_model_dir), encodings=MENUS[menu], **RUN), out=one, show_progress=False)
    finally:
        torch.set_num_threads(threads)
    proc = _torchrun(["-m", "qrecover.cli"], *_cli_args(tiny_model_dir, two, MENUS[menu]))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    report, end = json.JSONDecoder().raw_decode(proc.stdout.strip())
    assert end == len(proc.stdout.strip()) and report["out"] == str(two)  # rank 0's report only

    a, b = _digests(one), _digests(two)
    assert a.keys() == b.keys() and "model.safetensors" in a
    assert {k: v for k, v in a.items() if k != "qrecover.json"} == {k: v for k, v in b.items() if k != "qrecover.json"}
    # the weights above are byte-identical; the manifest's damage sums may differ in their last bits (summed over
    # the gathered jobs in another order), so its floats are compared to 1e-12 relative, everything else exactly
    assert _close(_manifest(one), _manifest(two)), _differences(_manifest(one), _manifest(two))[:10]
    labels = {v["label"] for v in _manifest(two)["layers"].values() if v["kind"] == "linear"}
    assert len(labels) > 1  # the budget made choices (a uniform result would hide a wrong damage table)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_a_failing_process_leaves_nothing(tiny_model_dir, tmp_path):
    """Rank 1 raises at the barrier before the commit, when rank 0 has written every file into its temporary
    directory: the launch fails and neither the checkpoint nor a temporary directory is left."""
    script = tmp_path / "fail_at_commit.py"
    script.write_text(FAIL_AT_COMMIT)
    out = tmp_path / "ckpts" / "two"
    proc = _torchrun([str(script)], *_cli_args(tiny_model_dir, out, MENUS["gptq"]))
    assert proc.returncode != 0
    assert "rank 1 fails before the checkpoint is committed" in proc.stdout + proc.stderr
    assert not out.exists()
    assert list((tmp_path / "ckpts").iterdir()) == []


def test_more_processes_than_windows_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    """Refused before the model is read (as the first of 2 processes: no collective is reached)."""
    import qrecover.stages.candidates as candidates

    monkeypatch.setattr(candidates, "join", lambda: World(0, 2))
    monkeypatch.setattr(candidates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(QRecoverError, match=r"--calib-samples 1 is fewer than the 2 processes; give at least one window per process"):
        compress(CompressConfig(model=str(tiny_model_dir), **{**RUN, "calib_samples": 1}), out=tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_spans_cover_the_windows_in_order_and_rank_0_holds_window_0():
    for n, size in [(3, 2), (32, 3), (5, 5), (7, 4)]:
        spans = [World(r, size).span(n) for r in range(size)]
        assert [i for s in spans for i in range(n)[s]] == list(range(n))
        assert all(s.stop > s.start for s in spans) and spans[0].start == 0


def test_share_gives_every_job_to_exactly_one_process_balanced_by_cost():
    costs = [7.0, 1.0, 3.0, 3.0, 5.0, 1.0, 2.0]
    shares = [World(r, 3).share(costs) for r in range(3)]
    assert sorted(j for s in shares for j in s) == list(range(len(costs)))
    loads = [sum(costs[j] for j in s) for s in shares]
    assert max(loads) - min(loads) <= max(costs) and max(loads) < sum(costs) / 2
    assert World().share(costs) == list(range(len(costs)))


def test_take_gives_every_job_to_exactly_one_process_the_costliest_first(monkeypatch):
    """World.take: jobs claimed from the store's counter, costliest first, by whichever process asks next (two
    simulated processes, the second free sooner, takes more); one process runs every job in order; no store: the
    static share."""
    import itertools

    from qrecover import distributed

    class Store:  # the launch's key-value store: an atomic counter per key
        def __init__(self):
            self.values: dict[str, int] = {}

        def add(self, key: str, n: int) -> int:
            self.values[key] = self.values.get(key, 0) + n
            return self.values[key]

    store = Store()
    monkeypatch.setattr(distributed, "_store", lambda: store)
    monkeypatch.setattr(distributed, "_TAKES", itertools.repeat(7))  # both simulated processes at the same call
    costs = [1.0, 5.0, 3.0, 3.0, 9.0]
    a, b = World(0, 2).take(costs), World(1, 2).take(costs)
    assert [next(a), next(b), next(b), next(b), next(a)] == [4, 1, 2, 3, 0]
    assert list(a) == [] and list(b) == [] and list(store.values) == ["qrecover/take/7"]
    assert list(World().take(costs)) == [0, 1, 2, 3, 4]
    monkeypatch.setattr(distributed, "_store", lambda: None)
    assert [list(World(r, 2).take(costs)) for r in range(2)] == [World(r, 2).share(costs) for r in range(2)]


def test_shared_factors_are_computed_once_across_processes_and_give_the_same_candidates(monkeypatch):
    """q and k read one Hessian, down_proj another: each inverse-Hessian factor (palettization's and act-order GPTQ's)
    is computed by exactly one of 2 processes, and the candidates made with the gathered factors are bit for bit the
    one-process candidates."""
    from dataclasses import dataclass, field

    from qrecover.schemes.feedback import inverse_hessian_factor
    from qrecover.stages.candidates import quantize_shared, share_factors
    from qrecover.stages.specs import parse_encodings

    torch.manual_seed(0)
    encs = parse_encodings("palettize:3,palettize:3/b64,gptq:4/g64")
    x, x2 = torch.randn(256, 128), torch.randn(256, 192)
    h, h2 = x.T @ x / 256, x2.T @ x2 / 256
    units = {n: (torch.randn(shape), encs, st, None) for n, shape, st in
             [("q", (64, 128), {"hessian": h, "input_sq": h.diagonal()}), ("k", (32, 128), {"hessian": h, "input_sq": h.diagonal()}),
              ("down", (64, 192), {"hessian": h2, "input_sq": h2.diagonal()})]}
    calls = []
    import qrecover.schemes.feedback as fb
    import qrecover.schemes.gptq as gq
    import qrecover.schemes.palettize as pal

    def counted(hessian, *a, **k):
        calls.append(hessian.shape[0])
        return inverse_hessian_factor(hessian, *a, **k)
    for mod in (fb, gq, pal):
        monkeypatch.setattr(mod, "inverse_hessian_factor", counted)

    @dataclass(frozen=True)
    class Half(World):  # two processes simulated in turn: gather returns what each has contributed
        parts: list = field(default_factory=lambda: [None, None], compare=False)

        def gather(self, obj):
            self.parts[self.rank] = obj
            return [p for p in self.parts if p is not None]

    parts: list = [None, None]
    cache1: dict = {}
    share_factors(units, Half(1, 2, parts), cache1)
    ones = len(calls)
    cache0: dict = {}
    share_factors(units, Half(0, 2, parts), cache0)
    assert sorted(calls) == [128, 128, 192, 192] and 0 < ones < 4  # 2 Hessians x 2 factor kinds, each once, split
    calls.clear()
    got = quantize_shared(units, World(), cache0)  # rank 0 now runs every job with the gathered factors
    assert calls == []
    ref = quantize_shared(units, World())
    for n in units:
        for (a, da), (b, db) in zip(got[n], ref[n]):
            assert da == db and all(torch.equal(a.tensors[t], b.tensors[t]) for t in a.tensors)


def test_ordered_sum_is_the_sequential_float64_sum():
    """One process: the same bits as adding the windows' values one after another (a pairwise sum differs)."""
    torch.manual_seed(0)
    values = [torch.randn(64, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (64,)) for _ in range(9)]
    acc = OrderedSum()
    ref = values[0]
    for v in values:
        acc.add("h", v)
    for v in values[1:]:
        ref = ref + v
    assert torch.equal(acc.reduce()["h"], ref)
    pairwise = (values[0] + values[1] + values[2] + values[3]) + (values[4] + values[5] + values[6] + values[7] + values[8])
    assert not torch.equal(pairwise, ref)  # the order matters: why the reduction keeps one process's
    ids, rows = torch.tensor([3, 1, 3]), torch.randn(3, 4, dtype=torch.float64)
    acc.index_add("f", (5, 4), ids, rows)
    assert torch.equal(acc.reduce()["f"], torch.zeros(5, 4, dtype=torch.float64).index_add_(0, ids, rows))


STARTS_SEEN = '''"""Each start of a Python process records its rank (- outside a launch), its id and whether tcmalloc is
mapped into it."""
import os

with open("/proc/self/maps") as f:
    mapped = "tcmalloc" in f.read()
with open(os.environ["QRECOVER_TEST_MAPS"], "a") as f:
    f.write(f"{os.environ.get('RANK', '-')} {os.getpid()} {mapped}\\n")
'''


def _starts(log) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()]


def test_procs_option_launches_the_processes_itself(tiny_model_dir, tmp_path):
    """``qrecover compress --procs 2`` (no torchrun) runs 2 processes through torch's elastic launcher: rank 0's
    report alone, the bytes of one process, and tcmalloc in both processes where it is installed (scripts/setup.sh
    installs it; the system allocator otherwise)."""
    from qrecover.cli.launch import MALLOC_ENV, tcmalloc_path

    one, two, tmp, hook, maps = (tmp_path / n for n in ("one", "two", "tmp", "hook", "starts"))
    for d in (tmp, hook):
        d.mkdir()
    (hook / "sitecustomize.py").write_text(STARTS_SEEN)
    compress(CompressConfig(model=str(tiny_model_dir), encodings=MENUS["gptq"], **RUN), out=one, show_progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp),
           "QRECOVER_TEST_MAPS": str(maps),
           "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for k in ("LD_PRELOAD", MALLOC_ENV):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "qrecover.cli", "compress", *_cli_args(tiny_model_dir, two, MENUS["gptq"]),
                           "--procs", "2"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    report, end = json.JSONDecoder().raw_decode(proc.stdout.strip())
    assert end == len(proc.stdout.strip()) and report["out"] == str(two)
    assert _digests(one)["model.safetensors"] == _digests(two)["model.safetensors"]
    assert list(tmp.iterdir()) == []  # no temporary directory left behind (the launcher's torchelastic_* logs were)
    seen = {rank: mapped for rank, _, mapped in _starts(maps) if rank != "-"}
    assert seen == {"0": str(tcmalloc_path() is not None), "1": str(tcmalloc_path() is not None)}


def test_launched_processes_allocate_with_tcmalloc_unless_told_not_to(tmp_path):
    """The launched processes' allocator: tcmalloc where one of its names is in the searched directories, the first
    directory first; nothing where ``QRECOVER_MALLOC=system``, where ``LD_PRELOAD`` is the user's already, or where
    none is installed. tcmalloc's report of allocations over 1 GB is silenced unless the user set its threshold."""
    from qrecover.cli.launch import MALLOC_ENV, allocator_env, tcmalloc_path

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert tcmalloc_path((str(a), str(b))) is None
    (b / "libtcmalloc.so.4").write_bytes(b"")
    assert tcmalloc_path((str(a), str(b))) == f"{b}/libtcmalloc.so.4"
    (a / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert tcmalloc_path((str(a), str(b))) == f"{a}/libtcmalloc_minimal.so.4"
    lib = "/x/libtcmalloc_minimal.so.4"
    assert allocator_env({}, lib) == {"LD_PRELOAD": lib, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**62)}
    assert allocator_env({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, lib)["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"
    assert allocator_env({MALLOC_ENV: "system"}, lib) == {}
    assert allocator_env({MALLOC_ENV: "tcmalloc"}, lib)["LD_PRELOAD"] == lib
    assert allocator_env({"LD_PRELOAD": "/y/libjemalloc.so.2"}, lib) == {}
    assert allocator_env({}, None) == {}


def test_commands_that_run_a_model_restart_themselves_under_tcmalloc(tmp_path, monkeypatch):
    """``qrecover ppl|recover|compress|...`` from the console replace their process by itself with tcmalloc preloaded
    (same process id, one error message, exit code 2 for bad input); ``info``/``gate``/``report`` and ``--help`` do
    not restart, nor a process that has ``LD_PRELOAD`` already or ``QRECOVER_MALLOC=system``."""
    import qrecover.cli.launch as launch

    lib = "/x/libtcmalloc_minimal.so.4"
    monkeypatch.setattr(launch, "tcmalloc_path", lambda: lib)
    assert launch.with_tcmalloc(["recover", "ckpt"], {})["LD_PRELOAD"] == lib
    assert launch.with_tcmalloc(["compress", "--bpw", "3.7"], {})["LD_PRELOAD"] == lib
    for args in (["info", "ckpt"], ["gate", "r.json"], ["recover", "--help"], ["compress", "-h"], []):
        assert launch.with_tcmalloc(args, {}) == {}, args
    assert launch.with_tcmalloc(["recover", "ckpt"], {"LD_PRELOAD": "/y/lib.so"}) == {}
    assert launch.with_tcmalloc(["recover", "ckpt"], {launch.MALLOC_ENV: "system"}) == {}
    monkeypatch.setattr(launch, "tcmalloc_path", lambda: None)
    assert launch.with_tcmalloc(["recover", "ckpt"], {}) == {}
    monkeypatch.undo()

    hook, log = tmp_path / "hook", tmp_path / "starts"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STARTS_SEEN)
    env = {**os.environ, "QRECOVER_TEST_MAPS": str(log),
           "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for k in ("LD_PRELOAD", launch.MALLOC_ENV):
        env.pop(k, None)
    missing = tmp_path / "no-such-model"
    proc = subprocess.run([sys.executable, "-m", "qrecover.cli", "ppl", str(missing)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.count(f"model {str(missing)!r} does not exist") == 1, proc.stderr
    starts = _starts(log)
    if launch.tcmalloc_path() is None:
        assert [m for _, _, m in starts] == ["False"]
    else:
        assert len({pid for _, pid, _ in starts}) == 1 and [m for _, _, m in starts] == ["False", "True"]
    log.unlink()
    env[launch.MALLOC_ENV] = "system"
    subprocess.run([sys.executable, "-m", "qrecover.cli", "ppl", str(missing)], env=env, capture_output=True, timeout=300,
                   cwd=ROOT)
    assert [m for _, _, m in _starts(log)] == ["False"]


KILL_RANK_1 = """
import os, signal
if os.environ.get("RANK") == "1" and os.environ.get("QRECOVER_TEST_KILL"):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_procs_failures_are_reported_once(tiny_model_dir, tmp_path):
    """``--procs 2``: a bad value that every process refuses ends with its one-line error, exit 2, and none of the
    launcher's own log lines; a process killed by a signal, which prints nothing itself, is named with the signal,
    and the exit code is the shell's 128 + signal; no checkpoint either way."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_RANK_1)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = tmp_path / "ckpt"
    args = [sys.executable, "-m", "qrecover.cli", "compress", *_cli_args(tiny_model_dir, out, MENUS["gptq"]), "--procs", "2"]
    proc = subprocess.run([*args, "--bpw", "0.5"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.count("error: --bpw 0.5") == 1, proc.stderr[-3000:]
    assert "exitcode" not in proc.stderr and "local_rank" not in proc.stderr, proc.stderr[-3000:]
    proc = subprocess.run(args, env={**env, "QRECOVER_TEST_KILL": "1"}, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    assert "error: compress process 1 of 2 ended with signal SIGKILL; no checkpoint was written" in proc.stderr
    assert "exitcode" not in proc.stderr and not out.exists()


def test_procs_bad_value_and_auto_rule(tiny_model_dir, tmp_path):
    from qrecover.cli.launch import MIN_SPLIT_BYTES, auto_procs, float32_bytes, parse_procs, procs_for

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "qrecover.cli", "compress", "--model", str(tiny_model_dir), "--procs", "0",
                           "--out", str(tmp_path / "o")], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "--procs '0': give a number of processes >= 1, or auto" in proc.stderr
    assert not (tmp_path / "o").exists()
    assert parse_procs("auto") is None and parse_procs("3") == 3
    gb = 2**30
    assert auto_procs(MIN_SPLIT_BYTES - 1, 16, 100 * gb) == 1  # small model: the start-up outweighs the split
    assert auto_procs(gb, 2, 100 * gb) == 2 and auto_procs(gb, 64, 1000 * gb) == 8  # a core each, at most 8
    assert auto_procs(gb, 4, 20 * gb) == 2  # 8 bytes per float32 byte and process: 2 fit in 20 GB, not 3
    assert auto_procs(gb, 4, 4 * gb) == 1
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    numel = sum(p.numel() for p in model.parameters())  # the tied head counted once, as it is stored
    assert float32_bytes(tiny_model_dir) == 4 * numel
    assert procs_for("auto", str(tiny_model_dir), "cpu") == 1  # the tiny model is under the split size


INTERRUPT_AT_COMMIT = '''"""Ctrl-C reaches the launching process when rank 0 has the whole checkpoint in its temporary directory."""
import os
import signal
import time

if os.environ.get("RANK") == "0":
    from qrecover import distributed

    def interrupt(self):
        os.kill(os.getppid(), signal.SIGINT)  # the launcher (qrecover compress --procs 2 itself)
        time.sleep(120)  # until the launcher passes the signal on

    distributed.World.barrier = interrupt
'''


def test_procs_interrupted_leaves_nothing(tiny_model_dir, tmp_path):
    """Ctrl-C during a ``--procs 2`` compression: exit 130, one line saying so, no checkpoint, no temporary directory
    (the launcher passes the signal on and each process removes its own files)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(INTERRUPT_AT_COMMIT)  # imported by every Python process of the launch
    out, tmp = tmp_path / "ckpts" / "two", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "qrecover.cli", "compress", *_cli_args(tiny_model_dir, out, MENUS["gptq"]),
                           "--procs", "2"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 130, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert proc.stderr.count("interrupted: nothing was written") == 1, proc.stderr[-6000:]
    assert not out.exists() and list((tmp_path / "ckpts").iterdir()) == [] and list(tmp.iterdir()) == []
