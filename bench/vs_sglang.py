"""hicache against SGLang's own HiCache, side by side in one run (the control-plane speed targets).

Runs `../shared/peers/sglang_bench.py --cache hicache` (SGLang 0.5.23's radix tree + host tier,
in the peer venv that `../shared/peers/setup-sglang.sh` builds) and the equivalent
`hicache replay` alternately, ROUNDS times each, on the same trace and config: 200k L1 + 400k
L2 tokens, page 64, write_through, one request per step, 32 bytes per token, no L3, no
verification. Prints, per round and as medians:

- wall of the whole replay, each side, and hicache / SGLang (target <= 1.0);
- hicache's control plane per request (time inside cache calls) against SGLang's whole time
  per request (wall / requests, everything included) (target <= 0.3);
- the hit-rate shares of L1 and L2 on both sides.

Without the peer venv it says so and exits 0 (nothing to compare against).

    python bench/vs_sglang.py [--rounds 3] [--limit N] [--trace PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
PEER_PYTHON = Path.home() / ".cache" / "hicache-peers" / "sglang" / "bin" / "python"
DEVICE, HOST, PAGE = 200_000, 400_000, 64


def run_sglang(trace: Path, limit: int | None, out: Path) -> dict:
    cmd = [
        str(PEER_PYTHON),
        str(PEERS / "sglang_bench.py"),
        "--trace",
        str(trace),
        "--cache",
        "hicache",
        "--capacity",
        str(DEVICE),
        "--page-size",
        str(PAGE),
        "--write-policy",
        "write_through",
        "--json",
        str(out),
    ]
    if limit:
        cmd += ["--limit", str(limit)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    row = json.loads(out.read_text().strip().splitlines()[-1])
    total = row["input_tokens"]
    return {
        "wall": row["wall_s"],
        "requests": row["reqs"],
        "l1": (row["hit_rate"] - row.get("l2_hit_rate", 0.0)),
        "l2": row.get("l2_hit_rate", 0.0),
        "tokens": total,
    }


def run_hicache(trace: Path, limit: int | None, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "hicache.cli.main",
        "replay",
        "--trace",
        str(trace),
        "--storage",
        "none",
        "--no-verify",
        "--kv",
        "mha:1:1:8:float16",
        "--device-tokens",
        str(DEVICE),
        "--host-tokens",
        str(HOST),
        "--write-policy",
        "write_through",
        "--page-size",
        str(PAGE),
        "--batch",
        "1",
        "--json",
        str(out),
    ]
    if limit:
        cmd += ["--limit", str(limit)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    s = json.loads(out.read_text())
    tokens = s["input_tokens"]
    return {
        "wall": s["wall_s"],
        "requests": s["requests"],
        "control_us": s["control_us_per_request"],
        "l1": s["hit_tokens"]["device"] / tokens,
        "l2": s["hit_tokens"]["host"] / tokens,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--trace", type=Path, default=ROOT / "data" / "mooncake_synthetic_trace.jsonl")
    args = ap.parse_args()
    if not PEER_PYTHON.exists():
        print(f"no peer venv at {PEER_PYTHON}: run `bash {PEERS / 'setup-sglang.sh'}` first")
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            # alternate which side runs first, so drift in the machine's load hits both
            order = ("sglang", "hicache") if i % 2 == 0 else ("hicache", "sglang")
            got = {}
            for side in order:
                out = Path(tmp) / f"{side}{i}.json"
                got[side] = (run_sglang if side == "sglang" else run_hicache)(
                    args.trace, args.limit, out
                )
            sg, hc = got["sglang"], got["hicache"]
            sg_per_req_us = sg["wall"] / sg["requests"] * 1e6
            row = {
                "round": i,
                "sglang_wall": sg["wall"],
                "hicache_wall": hc["wall"],
                "wall_ratio": hc["wall"] / sg["wall"],
                "sglang_us_per_req": sg_per_req_us,
                "hicache_control_us": hc["control_us"],
                "control_ratio": hc["control_us"] / sg_per_req_us,
                "l1": (hc["l1"], sg["l1"]),
                "l2": (hc["l2"], sg["l2"]),
            }
            rows.append(row)
            print(
                f"round {i}: wall hicache {hc['wall']:.2f} s / SGLang {sg['wall']:.2f} s "
                f"= {row['wall_ratio']:.2f}; control {hc['control_us']:.0f} us/req / SGLang "
                f"{sg_per_req_us:.0f} us/req = {row['control_ratio']:.2f}; "
                f"L1 {hc['l1']:.4f}/{sg['l1']:.4f} L2 {hc['l2']:.4f}/{sg['l2']:.4f}",
                flush=True,
            )
    med = statistics.median
    print(
        f"median of {len(rows)}: wall ratio {med(r['wall_ratio'] for r in rows):.2f} "
        f"(target <= 1.0), control ratio {med(r['control_ratio'] for r in rows):.2f} "
        f"(target <= 0.3)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
