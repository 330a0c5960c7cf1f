#!/usr/bin/env bash
# One-shot check of the scheduler engine on a CUDA machine that has torch + transformers but no
# internet, no meshlm install and no SmolLM2 weights:
#   1. the machine: nvidia-smi, python / torch / CUDA / transformers versions, meshlm imports;
#   2. the golden tests on tiny random models (tests/engine/test_tiny_golden.py and the tiny cases
#      of test_models.py): our engine vs HF transformers, greedy tokens + logprobs, under every
#      scheduling configuration, PD handover, bfloat16, sampling; engine AND HF on the device
#      (with the defaults there: Triton attention and CUDA graphs); tests/engine/test_cuda_graph.py
#      (graph replay vs eager) and the Triton kernels' tests (tests/unit/scheduler/test_triton_attention.py);
#   3. bench/bench_offline.py on the device with a random-weight model of SmolLM2-135M's exact
#      config (built here from .gpu/smollm2-config/): workloads (a) and (b), 64 prompts, bfloat16:
#      the engine as users get it (Triton attention + CUDA graphs) and HF at batch 64, then the
#      engine without graphs, and without graphs on torch_native attention (the old CUDA path);
#      if the time budget allows, float32 (HF batch size 64).
#
# Needs .gpu/smollm2-config/ (SmolLM2's config.json + tokenizer files; git-ignored: carry it). If
# .whl/ holds wheels (packages missing on the machine) they are installed into /tmp/site first.
# Everything is logged under $OUT (default /tmp/out): gpu_check.log (all), one log per step,
# tests.xml, bench_offline_<dtype>.json, results.txt (the PASS / FAIL / SKIP lines).
#
#   bash bench/gpu_check.sh                                  # on the GPU machine: ~4 min on an H200
#   GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh --quick     # plumbing smoke run on a CPU machine
#
# Environment: GPU_CHECK_DEVICE (cuda), GPU_CHECK_BUDGET_S (400: steps are cut to fit, later
# ones skipped), GPU_CHECK_WORK (/tmp/gpu_check: the random model), GPU_CHECK_WHEELS (.whl).
# Exit status 0 only when every step passed.

set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/out}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-400}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
CONFIG_DIR=$ROOT/.gpu/smollm2-config
MODEL_DIR=$WORK/smollm2-135m-random
QUICK=0
for arg in "$@"; do
    case $arg in
        --quick) QUICK=1 ;;
        *) echo "usage: bash bench/gpu_check.sh [--quick]" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT" "$WORK"
: > "$OUT/results.txt"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
SERVICES=$ROOT/services/common:$ROOT/services/scheduler:$ROOT/services/tokenizer
SERVICES=$SERVICES:$ROOT/services/detokenizer:$ROOT/services/gateway
export PYTHONPATH=$SERVICES${PYTHONPATH:+:$PYTHONPATH}

FAILED=0
SKIPPED=0
result() {  # STATUS NAME [DETAIL]
    local line="$1 $2${3:+ ($3)}"
    echo ">>> $line"
    echo "$line" >> "$OUT/results.txt"
    [[ $1 == FAIL ]] && FAILED=$((FAILED + 1))
    [[ $1 == SKIP ]] && SKIPPED=$((SKIPPED + 1))
    return 0
}

step() {  # NAME CAP_S CMD...: CMD under a timeout of min(CAP_S, budget left), logged to $OUT/NAME.log
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < 20)); then
        result SKIP "$name" "time budget of ${BUDGET}s spent"
        return 3
    fi
    echo
    echo "=== [$name] $(date -u +%H:%M:%S), timeout ${limit}s: $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=$?
    local took=$((SECONDS - t0))
    echo
    if ((rc == 0)); then
        result PASS "$name" "${took}s"
    elif ((rc == 124 || rc == 137)); then
        result FAIL "$name" "timed out after ${limit}s, log $OUT/$name.log"
    else
        result FAIL "$name" "exit $rc after ${took}s, log $OUT/$name.log"
    fi
    return $rc
}

main() {  # (body not indented: it holds heredocs)
echo "gpu_check: device $DEVICE, quick $QUICK, budget ${BUDGET}s, out $OUT, $(date -u)"
echo "repo $ROOT at $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"

# ---- 0. wheels of packages missing on the machine ---------------------------------------------
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if ((${#wheels[@]})); then
    step wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site "${wheels[@]}"
    export PYTHONPATH=/tmp/site:$PYTHONPATH
else
    echo "no wheels under $WHEELS: nothing to install"
fi

# The gRPC stubs are build outputs (git-ignored, so not carried): generate them, as test.sh does.
step stubs 60 python3 scripts/gen_protos.py

# ---- 1. the machine ----------------------------------------------------------------------------
if [[ $DEVICE == cuda ]]; then
    nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt" || result FAIL nvidia-smi
fi
step env 120 python3 - "$DEVICE" <<'EOF'
import importlib, os, platform, sys

import torch

device = sys.argv[1]
print("python", platform.python_version(), sys.executable)
print("PYTHONPATH", os.environ.get("PYTHONPATH"))
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
for name in ("transformers", "tokenizers", "safetensors", "numpy", "pytest", "grpc", "google.protobuf"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # noqa: BLE001 (just report)
        print(name, "not importable:", exc)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count(),
      "tf32 matmul", torch.backends.cuda.matmul.allow_tf32)
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print("gpu 0:", props.name, f"{props.total_memory / 2**30:.0f} GiB", f"sm_{props.major}{props.minor}",
          "bf16", torch.cuda.is_bf16_supported())
    x = torch.randn(1024, 1024, device="cuda")
    print("matmul on cuda ok:", torch.allclose((x @ x).cpu(), x.cpu() @ x.cpu(), atol=1e-2))
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("GPU_CHECK_DEVICE=cuda but torch sees no CUDA device")
from meshlm.scheduler.engine import Engine  # noqa: E402,F401 (meshlm importable from PYTHONPATH)
from meshlm.scheduler.model_executor.model_runner import resolve_device  # noqa: E402

print("meshlm engine importable; device auto ->", resolve_device("auto"))
EOF
env_rc=$?
if ((env_rc != 0)); then
    echo "the machine is not usable for this check; stopping"
    echo "GPU CHECK: FAIL (environment)" | tee -a "$OUT/results.txt"
    return 1
fi
if [[ ! -f $CONFIG_DIR/config.json || ! -f $CONFIG_DIR/tokenizer.json ]]; then
    result FAIL config "missing $CONFIG_DIR (carry .gpu/)"
fi

# ---- 2. golden tests on tiny random models, engine and HF on the device ----------------------
MESHLM_TEST_DEVICE=$DEVICE MESHLM_TEST_SKIP_SMOLLM=1 MESHLM_TEST_TOKENIZER=$CONFIG_DIR \
    step tests 180 python3 -m pytest -p no:cacheprovider -q -rs --timeout 120 --durations 10 \
    --junitxml "$OUT/tests.xml" tests/engine/test_tiny_golden.py tests/engine/test_models.py \
    tests/engine/test_cuda_graph.py tests/unit/scheduler/test_triton_attention.py

# ---- 3. throughput: random weights with SmolLM2-135M's exact config --------------------------
step model 90 python3 - "$CONFIG_DIR" "$MODEL_DIR" <<'EOF'
import shutil, sys, time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
if (dst / "model.safetensors").is_file():
    print("reusing", dst)
    sys.exit(0)
t0 = time.perf_counter()
shutil.rmtree(dst, ignore_errors=True)
dst.mkdir(parents=True)
for f in src.iterdir():
    shutil.copy2(f, dst / f.name)
config = AutoConfig.from_pretrained(src)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(dst)  # float32 safetensors (tied embeddings saved once) + config.json
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (src / f).exists():
        shutil.copy2(src / f, dst / f)
print(f"{type(model).__name__}: {n / 1e6:.1f}M parameters, saved to {dst} in {time.perf_counter() - t0:.1f}s:",
      sorted(p.name for p in dst.iterdir()))
EOF
model_rc=$?

bench() {  # NAME DTYPE CAP_S EXTRA_ARGS...
    local name=$1 dtype=$2 cap=$3
    shift 3
    step "bench_offline_$name" "$cap" python3 bench/bench_offline.py --model-path "$MODEL_DIR" \
        --device "$DEVICE" --dtype "$dtype" --json "$OUT/bench_offline_$name.json" "$@"
}
# The engine as users get it (Triton attention + CUDA graphs) against HF, then the engine's
# earlier CUDA path (eager, torch_native attention) and Triton without graphs, same workloads.
EAGER=(--systems ours --engine-arg disable_cuda_graph=true)
if ((model_rc != 0)); then
    result SKIP bench_offline "no model"
elif ((QUICK)); then
    bench float32 float32 240 --quick --num-prompts 4 --hf-batch-sizes 4 --threads 1
else
    # HF at batch 64 only: its best on both workloads (at 16, (b) alone takes over 2 minutes).
    bench bfloat16 bfloat16 150 --num-prompts 64 --hf-batch-sizes 64 --threads 4
    bench bfloat16-eager-triton bfloat16 60 --num-prompts 64 --threads 4 "${EAGER[@]}"
    bench bfloat16-eager-torch_native bfloat16 120 --num-prompts 64 --threads 4 "${EAGER[@]}" \
        --engine-arg attention_backend=torch_native
    if ((BUDGET - SECONDS >= 75)); then
        bench float32 float32 110 --num-prompts 64 --hf-batch-sizes 64 --threads 4
    else
        result SKIP bench_offline_float32 "$((BUDGET - SECONDS))s left of the ${BUDGET}s budget"
    fi
fi

# ---- summary -----------------------------------------------------------------------------------
echo
echo "=== summary ($SECONDS s) ==="
python3 - "$OUT" <<'EOF'
import glob, json, os, sys

runs = []  # (label, dtype, workload, result of ours, HF results)
for path in sorted(glob.glob(os.path.join(sys.argv[1], "bench_offline_*.json"))):
    with open(path) as f:
        data = json.load(f)
    dtype = data["args"]["dtype"]
    extra = data["args"].get("engine_args") or {}
    label = dtype + "".join(f" {k}={v}" for k, v in sorted(extra.items()))
    for name, res in data["results"].items():
        runs.append((label, dtype, name, res.get("ours"), res.get("hf", [])))
# HF's best per (dtype, workload) over every file, so the engine-only runs get a ratio too.
hf_best = {}
for _, dtype, name, _, hf in runs:
    for r in hf:
        if r["tps"] > hf_best.get((dtype, name), {"tps": 0})["tps"]:
            hf_best[(dtype, name)] = r
rows = []
for label, dtype, name, ours, _ in runs:
    best = hf_best.get((dtype, name))
    cells = [f"({name}) {label}", f"{ours['tps']:.0f}" if ours else "-",
             f"{best['tps']:.0f} @bs{best['batch_size']}" if best else "-",
             f"{ours['tps'] / best['tps']:.2f}x" if ours and best else "-"]
    if ours and ours.get("decode_steps"):
        cells.append(f"{(1 - ours['decode_forward_s'] / ours['decode_step_s']) * 100:.0f}%")
        cells.append(f"{ours['decode_step_s'] / ours['decode_steps'] * 1e3:.2f}")
        cells.append(str(ours.get("graph_replays", "-")))
    else:
        cells += ["-", "-", "-"]
    cells.append(f"{ours['peak_gpu_mib']:.0f}" if ours and "peak_gpu_mib" in ours else "-")
    cells.append(f"{best['peak_gpu_mib']:.0f}" if best and "peak_gpu_mib" in best else "-")
    rows.append(cells)
head = ["workload", "ours tok/s", "HF-best tok/s", "ours/HF", "decode ovhd", "ms/decode step",
        "graph replays", "ours GPU MiB", "HF GPU MiB"]
if rows:
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("(target on a GPU, issue 9: ours/HF >= 2x on (a) and (b) in bfloat16 with graphs on; on CUDA")
    print(" 'decode ovhd' means little: the forward's time is its launch, the step waits at sampling)")
else:
    print("no bench results")
EOF
cat "$OUT/results.txt"
if ((FAILED)); then
    echo "GPU CHECK: FAIL ($FAILED failed, ${SECONDS}s)" | tee -a "$OUT/results.txt"
    return 1
fi
local note=""
((SKIPPED)) && note=", $SKIPPED step(s) skipped"
echo "GPU CHECK: PASS (${SECONDS}s$note)" | tee -a "$OUT/results.txt"
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
