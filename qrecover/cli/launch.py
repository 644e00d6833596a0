"""``--procs``: run a CPU compression as several processes through torch's elastic launcher (torchrun's engine).

One process with N threads keeps N cores busy only inside large operations (the matrix products); the Python
between them, the small operations and the per-column loops of GPTQ and palettization run on one core. N processes
with one thread each split the calibration windows and the candidate jobs instead (:mod:`qrecover.distributed`),
and write the bytes one process writes. Measured on the default model, ``compress --bpw 3.7 --encodings quick``,
2 cores, machine otherwise idle (2026-11-26): one process with 2 threads 395 s wall, 2 processes with one thread
each 348 s, the same ``model.safetensors`` sha256.

``--procs auto`` (the default) picks one process per usable core on the CPU, as many as the memory holds
(:data:`BYTES_PER_PROCESS` times the model's float32 bytes each), and one process where a second interpreter's
start-up (seconds) would outweigh the split: on CUDA (one process per GPU is ``torchrun``'s job), for a model under
:data:`MIN_SPLIT_BYTES`, or on one core.

The allocator: the commands that run a model, typed at the console, restart themselves (``exec``, same process) with
gperftools' tcmalloc preloaded where it is installed, and the processes ``--procs`` starts inherit it
(:func:`restart_with_tcmalloc`, :func:`allocator_env`). glibc's malloc returns large freed blocks to the kernel and
page-faults them in again zeroed; tcmalloc reuses them: the quick compress 22% and a CPU recovery run 22% faster,
the same bytes (docs/compress.md). ``QRECOVER_MALLOC=system`` keeps the C library's allocator.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import NoReturn

from ..errors import QRecoverError

#: peak resident memory of one compress process, as a multiple of the model's float32 bytes: measured 6.2x on the
#: default model (3.34 GB for 538 MB; 4.13 GB for rank 0 of two), rounded up
BYTES_PER_PROCESS = 8
#: a model whose float32 weights are smaller compresses in one process under ``--procs auto``
MIN_SPLIT_BYTES = 100 * 2**20
#: at most this many processes under ``--procs auto`` (each holds the model; the ordered sums pass rank to rank)
MAX_AUTO = 8


#: set in the environment of the processes :func:`relaunch` starts (they leave reporting an interruption to it)
LAUNCHED = "QRECOVER_PROCS_CHILD"

#: ``system`` keeps the C library's allocator (no restart of a console command, nothing preloaded in the processes
#: :func:`relaunch` starts); anything else (the default) preloads tcmalloc where it is installed (:func:`allocator_env`)
MALLOC_ENV = "QRECOVER_MALLOC"
#: gperftools' tcmalloc as Debian/Ubuntu (``libtcmalloc-minimal4``, which ``scripts/setup.sh`` installs) and others
#: name it, and the directories searched for it
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
LIB_DIRS = (f"{sys.prefix}/lib", "/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
            "/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/usr/local/lib64")


def tcmalloc_path(dirs: tuple[str, ...] = LIB_DIRS) -> str | None:
    """The first tcmalloc library found in ``dirs``, or None. (torch's own ``torch.backends.xeon.run_cpu`` looks for
    the unversioned development name only, which the runtime package does not install, so the search is ours.)"""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            if os.path.isfile(f"{d}/{name}"):
                return f"{d}/{name}"
    return None


def allocator_env(environ: dict[str, str], found: str | None) -> dict[str, str]:
    """The variables to add to the launched processes' environment so that they allocate with tcmalloc (``found``):
    glibc's malloc hands the large blocks of each window's activations and each candidate's temporaries back to the
    kernel when they are freed and takes them again zeroed, page by page; tcmalloc keeps and reuses them. Measured on
    the quick start (docs/compress.md): 32 M -> 2.5 M page faults, 97 -> 20 s of system time, -22% wall time, the same
    bytes. Nothing when ``QRECOVER_MALLOC=system``, when nothing was found, or when ``LD_PRELOAD`` is already set (the
    user's own choice)."""
    if environ.get(MALLOC_ENV, "").lower() == "system" or not found or environ.get("LD_PRELOAD"):
        return {}
    # tcmalloc reports every allocation over 1 GB on stderr by default (a large model's Fisher buffer); not a problem
    return {"LD_PRELOAD": found, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": environ.get(
        "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(2**62))}


#: the commands that run a model (the rest read files and print): :func:`with_tcmalloc` restarts these under tcmalloc
HEAVY_COMMANDS = frozenset({"compress", "recover", "finetune", "tune", "ppl", "eval", "pipeline", "export", "data"})


def with_tcmalloc(args: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a console command ``args`` restarts with so that it allocates with tcmalloc (:func:`allocator_env`),
    or none to go on as it is: only :data:`HEAVY_COMMANDS` (not their ``--help``) restart, where tcmalloc is installed,
    not opted out and no ``LD_PRELOAD`` is set yet. Measured (docs/compress.md): ``qrecover recover`` 16k tokens
    223 -> 173 s, the same adapter bytes; the quick compress -22%."""
    if not args or args[0] not in HEAVY_COMMANDS or "--help" in args or "-h" in args:
        return {}
    return allocator_env(dict(os.environ if environ is None else environ), tcmalloc_path())


def restart_with_tcmalloc(args: list[str]) -> None:
    """Replace this process by itself (same interpreter, flags and arguments: ``sys.orig_argv``) under tcmalloc where
    :func:`with_tcmalloc` says so; else return. An ``exec``: the same process id, so signals, exit codes and launchers
    (``torchrun``) see one process."""
    extra = with_tcmalloc(args)
    if extra:
        sys.stdout.flush(), sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, {**os.environ, **extra})


def parse_procs(value: str) -> int | None:
    """``--procs`` -> a count, or None for 'auto'."""
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise QRecoverError(f"--procs {value!r}: give a number of processes >= 1, or auto")
    return n


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def float32_bytes(path: Path) -> int:
    """The model's weights in float32 bytes: from the safetensors headers (element counts; nothing else is read),
    else from the files' sizes taken as 16-bit weights (``*.bin``, GGUF)."""
    from safetensors import safe_open

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    total = 0
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as st:
                total += sum(4 * math.prod(st.get_slice(k).get_shape()) for k in st.keys())
        else:
            total += 2 * f.stat().st_size
    return total


def auto_procs(model_bytes: int, cores: int, available: int) -> int:
    """``--procs auto`` on the CPU: one process per core, as many as ``available`` bytes hold, at most
    :data:`MAX_AUTO`; one for a model under :data:`MIN_SPLIT_BYTES`."""
    if model_bytes < MIN_SPLIT_BYTES:
        return 1
    n = min(cores, MAX_AUTO)
    while n > 1 and n * BYTES_PER_PROCESS * model_bytes > available:
        n -= 1
    return n


def procs_for(value: str, model: str | None, device: str) -> int:
    """How many processes ``compress --procs VALUE`` runs: 1 under a launcher already (torchrun, accelerate) and on
    CUDA for 'auto'; a given count on the CPU; :func:`auto_procs` for 'auto' on the CPU."""
    n = parse_procs(value)
    from ..distributed import launched  # lazy: pulls torch

    if launched() or n == 1:
        return 1
    import torch

    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if n is not None:
        if cuda:
            raise QRecoverError(f"--procs {value} runs processes on the CPU; on CUDA start one process per GPU with "
                                "torchrun --nproc_per_node N -m qrecover.cli compress ...")
        return n
    if cuda:
        return 1
    from ..hardware import available_memory
    from ..models import resolve

    path, _ = resolve(model)  # the default model is converted here, once, before the processes start
    return auto_procs(float32_bytes(path), usable_cores(), available_memory())


def relaunch(n: int, argv: list[str]) -> NoReturn:
    """Run ``qrecover ARGV`` as ``n`` processes (torch's elastic launcher, as ``torchrun --standalone``), one thread
    each (or the cores shared out), allocating with tcmalloc where it is installed (:func:`allocator_env`), and exit
    with rank 0's exit code; every process's output goes to this terminal (rank 0 alone prints progress and
    results)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the launcher's notes on shutting down after Ctrl-C, and its "failed (exitcode: 2) local_rank: 0 ..." line after a
    # process's own one-line error: silenced (each of its modules' loggers has its own level); a process that dies
    # without a word of its own (a signal, an abort) is reported below
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS") or usable_cores()) // n)
    # the launcher's own log directory (empty: nothing is redirected) in one we remove, not a torchelastic_* left in /tmp
    logs = tempfile.TemporaryDirectory(prefix="qrecover-launch-")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5, start_method="spawn",
                          logs_specs=DefaultLogsSpecs(log_dir=logs.name))
    os.environ.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), LAUNCHED: "1",
                       **allocator_env(dict(os.environ), tcmalloc_path())})
    try:
        elastic_launch(config, sys.executable)("-m", "qrecover.cli", *argv)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()  # the others were stopped by the launcher because of it
        code = first.exitcode or 1
        if code < 0 or code > 2:  # 1 and 2: the process printed its own error (and a traceback for 1)
            how = f"signal {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"exit code {code}"
            print(f"error: compress process {rank} of {n} ended with {how}; no checkpoint was written", file=sys.stderr)
        sys.exit(128 - code if code < 0 else code)
    except (KeyboardInterrupt, SignalException) as e:  # Ctrl-C: the launcher passes the signal on to the processes,
        # each removes its temporary files on the way out (qrecover.distributed.join), and this one reports it once
        sig = e.sigval if isinstance(e, SignalException) else signal.SIGINT
        print("interrupted: nothing was written", file=sys.stderr)
        sys.exit(128 + int(sig))
    finally:
        logs.cleanup()
    sys.exit(0)
