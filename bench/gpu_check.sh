#!/usr/bin/env bash
# Every device check of the CUDA path, as one script for a machine with a GPU and no network
# (docs/testing.md, "On a GPU machine"). Here, once: `make gpu-wheels` (the wheels the GPU image
# lacks, into .gpu-wheels/). There, from the checkout, with .gpu-wheels carried along:
#   bash bench/gpu_check.sh
# Parts, each time-boxed (about 8 minutes in all on an H200):
#   env          the GPU, torch, the wheels installed offline into a target dir on PYTHONPATH
#   tests-gpu    tests/gpu and tests/unit/kernels
#   determ       `hicache replay --deterministic` on the GPU, and the same with CUDA hidden:
#                the summaries must agree
#   transfer     bench/transfer.py --device cuda
#   pinning      bench/pinning.py (pinning GB/s against torch's pinned allocation), if present
#   replay       Llama-3-8B's KV (mha:32:8:128:bfloat16, 102,400 L1 / 204,800 L2 tokens):
#                --no-verify (link utilization) then --verify (its overhead)
#   tests-all    the rest of `pytest tests` (vLLM's aside) with HICACHE_TEST_DEVICE=cuda, in
#                the time left
# Logs go to $OUT (default /tmp/hicache-gpu-out), at most 8 files; the last thing printed is
# one summary table (also $OUT/summary.txt). Exit status: the number of parts that failed.
# GPU_CHECK_PARTS picks parts (default: "env tests determ transfer pinning replay"), e.g. a
# rerun of the replay alone; REPLAY_LIMIT / REPLAY_KV / REPLAY_DEVICE_TOKENS /
# REPLAY_HOST_TOKENS shrink the real-geometry replay (a dry run of the script on a CPU).
set -uo pipefail
OUT=${OUT:-/tmp/hicache-gpu-out}
SITE=${HICACHE_GPU_SITE:-/tmp/hicache-site}
PY=${PY:-python3}
LIMIT=${REPLAY_LIMIT:-100}
PARTS=" ${GPU_CHECK_PARTS:-env tests determ transfer pinning replay} "
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HICACHE_CACHE_DIR=/tmp/hicache-native
RESULTS=/tmp/hicache-gpu-results
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
ROWS=()
want() { [[ $PARTS == *" $1 "* ]]; }

# The whole script stays inside GPU_CHECK_SECONDS (default 470): a part gets at most its own
# limit and what is left; with under 10 s left it is skipped (exit 125 in the table).
DEADLINE=$(($(date +%s) + ${GPU_CHECK_SECONDS:-470}))

# part NAME LOG LIMIT_S CMD...: run CMD time-boxed, appending to $OUT/LOG, and keep a row
part() {
  local name=$1 log=$2 limit=$3 t0 rc left
  shift 3
  t0=$(date +%s)
  left=$((DEADLINE - t0))
  if ((left < 10)); then
    ROWS+=("$name|125|0")
    echo "== $name: skipped, the script's time is spent" | tee -a "$OUT/$log"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name: $* (at most ${limit}s)" >>"$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
  rc=$?
  ROWS+=("$name|$rc|$(($(date +%s) - t0))")
  echo "== $name: exit $rc after $(($(date +%s) - t0))s" | tee -a "$OUT/$log"
}

# -- env: the machine, then the wheels the image lacks (no network: offline, no deps)
if want env; then {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  git log -1 --format='commit %H %cd' 2>/dev/null || true
} >"$OUT/env.txt" 2>&1; fi
want env && part env env.txt 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$SITE" .gpu-wheels/*.whl
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
want env && part imports env.txt 30 $PY -c "import structlog, trio, outcome, sniffio, isal, msgspec, zmq, \
cryptography, redis, hicache.cache, hicache.kernels.streams.cuda; \
from hicache.kernels import cuda_driver_status; print(cuda_driver_status())"

# -- the tests of the CUDA data plane (the rest of the suite runs last, in the time left)
WORKERS=()
$PY -c "import xdist" 2>/dev/null && WORKERS=(-n 12)
want tests && part tests-gpu tests-gpu.txt 60 env HICACHE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
  "${WORKERS[@]}" tests/gpu tests/unit/kernels

# -- deterministic mode on the GPU: exits 0 with the summary a CPU gives
replay=($PY -m hicache.cli.main replay --quiet)
want determ && part determ-cuda determ.txt 30 "${replay[@]}" --deterministic --limit 100 \
  --json "$RESULTS/determ_cuda.json"
want determ && part determ-cpu determ.txt 30 env CUDA_VISIBLE_DEVICES= "${replay[@]}" --deterministic \
  --limit 100 --json "$RESULTS/determ_cpu.json"

# -- transfers and pinning against the contiguous copy / torch's pinned allocation
want transfer && part transfer transfer.txt 60 $PY bench/transfer.py --device cuda --reps 3
if want pinning && [ -f bench/pinning.py ]; then
  part pinning pinning.txt 30 $PY bench/pinning.py
fi

# -- a real geometry: link utilization, then what verification costs
geometry=(--kv "${REPLAY_KV:-mha:32:8:128:bfloat16}" --device-tokens "${REPLAY_DEVICE_TOKENS:-102400}"
  --host-tokens "${REPLAY_HOST_TOKENS:-204800}" --storage none --limit "$LIMIT")
want replay && part replay-noverify replay.txt 55 "${replay[@]}" "${geometry[@]}" --no-verify \
  --json "$RESULTS/noverify.json"
want replay && part replay-verify replay.txt 55 "${replay[@]}" "${geometry[@]}" --verify \
  --json "$RESULTS/verify.json"

# -- the rest of the suite with the test kit's pools on the GPU, in the time left
want tests && part tests-all tests-all.txt 240 env HICACHE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
  "${WORKERS[@]}" tests --ignore=tests/vllm --ignore=tests/gpu --ignore=tests/unit/kernels \
  --sim-seeds 200

# -- one table
printf '%s\n' "${ROWS[@]}" >"$RESULTS/rows"
$PY - "$RESULTS" "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path

results, out = Path(sys.argv[1]), Path(sys.argv[2])


def load(name):
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def tail(log, pattern):
    path = out / log
    if not path.exists():
        return ""
    hits = [line for line in path.read_text().splitlines() if re.search(pattern, line)]
    return hits[-1].strip() if hits else ""


figure = {
    "tests-gpu": tail("tests-gpu.txt", r"\d+ (passed|failed|skipped)"),
    "tests-all": tail("tests-all.txt", r"\d+ (passed|failed|skipped)"),
    "transfer": tail("transfer.txt", r"^[^=]"),
    "pinning": tail("pinning.txt", r"GB/s"),
    "imports": tail("env.txt", r"^\(") or tail("env.txt", r"Error"),
}
gpu, cpu = load("determ_cuda.json"), load("determ_cpu.json")
keys = ("hit_tokens", "bytes", "evictions", "verified_pages", "corrupt_pages")
if gpu and cpu:
    same = all(gpu[k] == cpu[k] for k in keys)
    figure["determ-cpu"] = f"summary on the GPU {'==' if same else '!='} on the CPU ({', '.join(keys)})"
nv, v = load("noverify.json"), load("verify.json")
if nv and "link" in nv:
    link = nv["link"]
    figure["replay-noverify"] = (
        f"link {link['utilization']:.2f} x ({link['moved_gbps']:.1f} of {link['reference_gbps']:.1f}"
        f" GB/s, run {link['run_s']:.1f} s, wall {nv['wall_s']:.1f} s)"
    )
if nv and v and "link" in nv and "link" in v:
    ratio = v["link"]["run_s"] / nv["link"]["run_s"]
    figure["replay-verify"] = (
        f"verify {ratio:.2f} x the --no-verify run ({v['verified_pages']:,} pages checked, "
        f"{v['corrupt_pages']} corrupt)"
    )
failed = 0
print(f"{'part':<16} {'exit':>4} {'s':>4}  figure")
for row in (results / "rows").read_text().split("\n"):
    if not row:
        continue
    name, rc, seconds = row.split("|")
    failed += rc != "0"
    print(f"{name:<16} {rc:>4} {seconds:>4}  {figure.get(name, '')}")
if gpu and cpu and not all(gpu[k] == cpu[k] for k in keys):
    failed += 1
sys.exit(min(failed, 100))
EOF
