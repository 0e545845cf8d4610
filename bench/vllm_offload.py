"""Prefill throughput of vLLM with and without a KV offloading connector.

A multi-turn workload whose working set overflows vLLM's own KV cache: CONVERSATIONS
conversations take turns, one request at a time (round robin); each turn's prompt is the
conversation so far (every earlier prompt and reply) plus TOKENS new random tokens, greedy,
MAX_TOKENS generated tokens (1-4: prefill dominates). vLLM's cache is cut to a few blocks more
than one conversation (`num_gpu_blocks_override`), so by a conversation's next turn vLLM has
evicted most of it; a connector with a host tier large enough for every conversation can serve
the earlier turns back. Turn 0 (every prompt is new everywhere) is run but not measured.

Three configurations, each in its own process holding one vLLM instance for the whole run, take
turns round by round (the order rotates each round, with a 2 s pause before each so the last
instance's busy-polling stops) so that the machine's load hits them alike:

- `vllm`: vLLM alone, prefix caching on;
- `hicache`: with `HiCacheConnector` (`hicache.integrations.vllm`), L2 sized to hold the
  working set, no L3;
- `offloading`: vLLM's built-in `OffloadingConnector` (CPU offloading, `cpu_bytes_to_use` the
  same size). vLLM 0.32 refuses it on a CPU platform; the start-up error is printed in one
  line and the configuration reported as not runnable.

`--configs vllm,hicache,offloading,vllm-large` adds a reference: vLLM alone with a KV cache
large enough for every conversation (its own prefix cache then serves what the connectors
would: the most a host tier can approach).
`hicache-layerwise` (layer-wise L2 loads on) and `hicache-l3` (an L2 of about one conversation
and a file store as L3: earlier turns come back from L3 through asynchronous loads) are two
more optional configurations.

Each round uses fresh conversations (the same tokens in every configuration) and starts with
`reset_prefix_cache(reset_connector=True)`. Printed per configuration over the measured turns
of every round: wall seconds, prompt tokens per second (every prompt token counts, whether
computed or served from a cache), tokens vLLM reported as cached (`num_cached_tokens`, split
into vLLM's own prefix cache and the connector's by vLLM's `prefix_cache_hits` and
`external_prefix_cache_hits` counters), hicache's L2 counters, and the ratio of throughput to
vLLM alone; then whether the generated token ids are identical across configurations, and
the load average (other work on the machine moves these figures a lot: see
docs/benchmarks.md). --json writes every round's results, per-request timings included.

`--model gemma3` runs a hybrid model instead: a random-weight Gemma 3 whose layers alternate
a sliding window (`--window`, default 128 tokens) and full attention, which vLLM's hybrid KV
cache manager runs as two KV cache groups (the connector's `SupportsHMA` path, docs/vllm.md);
vLLM's cache is then sized for both groups.

The model is a random-weight Llama (transformers' `save_pretrained` into a temporary
directory; head size 64 and block size 32, as vLLM's CPU attention wants; float32), token-id
prompts (`skip_tokenizer_init`). Run (after `make vllm-env`):

    .venv-vllm/bin/python bench/vllm_offload.py
    .venv-vllm/bin/python bench/vllm_offload.py --rounds 3 --conversations 4 --turns 6 --tokens 256

About 3 minutes on 2 cores with the defaults (the vLLM starts take ~25 s each), 4 with
vllm-large. Each configuration's vLLM log goes to a file in the temporary directory (kept with
--keep).

Cores: vLLM's CPU build binds the model's OpenMP threads to the cores it does not reserve for
its engine core and front end, and it reserves one more core whenever a KV connector is
configured (for NIXL). On 2 cores that leaves too few, so vLLM gives up reserving and a
connector's model runs on both cores while vLLM alone runs on one: a 1.4x head start that has
nothing to do with the connector. Every configuration therefore gets the same
`VLLM_CPU_NUM_OF_RESERVED_CPU` (--reserved-cpus, default 1: vLLM alone's own choice here); the
start-up line prints the cores each one got.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

CONFIGS = ("vllm", "hicache", "offloading")
OPTIONAL = ("vllm-large", "hicache-layerwise", "hicache-l3")
# vllm-large: vLLM alone with a KV cache that holds every conversation; hicache-layerwise:
# hicache with layer-wise loads on (each layer's copy waited for just before that layer); hicache-l3: hicache with an
# L2 of one conversation and a file store as L3 (earlier turns come back from L3, loaded
# asynchronously while vLLM keeps the request waiting).
HEAD_DIM = 64  # vLLM's CPU attention supports 64, not smaller
DTYPE_BYTES = 4  # float32
PAUSE_S = 2.0  # before each round: the last instance's worker busy-polls for 1 s after a step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds per configuration")
    p.add_argument("--conversations", type=int, default=4, help="conversations per round")
    p.add_argument(
        "--turns", type=int, default=8, help="turns per conversation (turn 0 unmeasured)"
    )
    p.add_argument("--tokens", type=int, default=256, help="new prompt tokens per turn")
    p.add_argument("--max-tokens", type=int, default=2, help="tokens generated per turn")
    p.add_argument("--block-size", type=int, default=32, help="vLLM block size (multiple of 32)")
    p.add_argument(
        "--gpu-blocks",
        type=int,
        default=0,
        help="vLLM's KV cache in blocks (0: one longest conversation plus 4 blocks)",
    )
    p.add_argument(
        "--model",
        choices=("llama", "gemma3"),
        default="llama",
        help="gemma3: a hybrid model, layers alternating sliding window (--window) and full "
        "attention, which vLLM runs as two KV cache groups",
    )
    p.add_argument("--window", type=int, default=128, help="gemma3's sliding window (tokens)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512, help="hidden size (heads = hidden / 64)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration (-1: vLLM's own choice, "
        "which reserves one more core when a KV connector is configured)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    p.add_argument("--json", help="write every round's results (per request timings) here")
    args = p.parse_args(argv)
    if args.block_size % 32:
        p.error("--block-size must be a multiple of 32 (vLLM's CPU attention)")
    if args.turns < 2:
        p.error("--turns must be at least 2 (turn 0 is not measured)")
    args.configs = [c for c in args.configs.split(",") if c]
    bad = set(args.configs) - set(CONFIGS + OPTIONAL)
    if bad:
        p.error(f"unknown configs {sorted(bad)}; known: {', '.join(CONFIGS + OPTIONAL)}")
    return args


def geometry(args: argparse.Namespace) -> dict:
    """Sizes derived from the flags: context length, vLLM's blocks, the host tier's bytes."""
    bs = args.block_size
    longest = args.turns * (args.tokens + args.max_tokens)  # last prompt + its reply
    max_model_len = math.ceil((longest + 1) / bs) * bs
    gpu_blocks = args.gpu_blocks or max_model_len // bs + 4
    large_blocks = args.conversations * (max_model_len // bs) + 4
    if args.model == "gemma3":  # two groups draw on one block pool: one conversation of each
        gpu_blocks = args.gpu_blocks or 2 * (max_model_len // bs) + 8
        large_blocks = 2 * args.conversations * (max_model_len // bs) + 8
    kv_token = 2 * args.layers * args.kv_heads * HEAD_DIM * DTYPE_BYTES
    working_set = args.conversations * max_model_len * kv_token  # one round's conversations
    return {
        "max_model_len": max_model_len,
        "gpu_blocks": gpu_blocks,
        "large_blocks": large_blocks,
        "kv_bytes_per_token": kv_token,
        "working_set_bytes": working_set,
        "host_bytes": max(2 * working_set, 64 << 20),
    }


def make_model(path: str, args: argparse.Namespace, max_len: int) -> None:
    """A random-weight Llama or Gemma 3 saved with save_pretrained (as tests/vllm's, but sized
    by flags)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // HEAD_DIM,
        num_key_value_heads=args.kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=max(1024, max_len),
        bos_token_id=1,
        eos_token_id=2,
    )
    if args.model == "gemma3":
        types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)
        ]
        gemma = Gemma3TextConfig(
            **shape, sliding_window=args.window, layer_types=types, pad_token_id=0
        )
        gemma.torch_dtype = "float32"
        Gemma3ForCausalLM(gemma).save_pretrained(path)
        return
    LlamaForCausalLM(LlamaConfig(**shape, torch_dtype="float32")).save_pretrained(path)


# ------------------------------------------------------------------ one configuration's process


def connector_config(name: str, geo: dict, tmp: Path):
    from vllm.config import KVTransferConfig

    if name.startswith("hicache"):
        extra: dict = {"host_bytes": geo["host_bytes"]}
        if name == "hicache-layerwise":
            extra["layerwise_loads"] = True
        if name == "hicache-l3":
            extra["host_bytes"] = geo["working_set_bytes"] // 4  # about one conversation
            extra["storage"] = f"file:{tmp / 'l3-store'}"
        return KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    if name == "offloading":
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": geo["host_bytes"]},
        )
    return None


def counters(llm) -> dict[str, float]:
    """vLLM's counters (prefix cache, prompt tokens) and the connector's, summed over labels."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):
            name = m.name.removeprefix("vllm:")
            out[name] = out.get(name, 0) + m.value
    return out


def conversation_tokens(seed: int, rnd: int, conv: int, turn: int, n: int, vocab: int) -> list:
    r = random.Random(f"{seed}/{rnd}/{conv}/{turn}")
    return [r.randrange(3, vocab) for _ in range(n)]


def run_round(llm, args: argparse.Namespace, rnd: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    assert llm.reset_prefix_cache(reset_connector=True)
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    outputs: list[list[int]] = []
    requests: list[list] = []  # [turn, conversation, prompt tokens, cached, seconds]
    prompt_tokens = cached = 0
    wall = 0.0
    before: dict[str, float] = {}
    for turn in range(args.turns):
        if turn == 1:
            before = counters(llm)
        for c in range(args.conversations):
            prompt = history[c] + conversation_tokens(
                args.seed, rnd, c, turn, args.tokens, args.vocab
            )
            t0 = time.perf_counter()
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            dt = time.perf_counter() - t0
            reply = list(out.outputs[0].token_ids)
            history[c] = prompt + reply
            outputs.append(reply)
            requests.append([turn, c, len(prompt), out.num_cached_tokens or 0, round(dt, 5)])
            if turn:
                wall += dt
                prompt_tokens += len(prompt)
                cached += out.num_cached_tokens or 0
    after = counters(llm)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    return {
        "wall": wall,
        "prompt_tokens": prompt_tokens,
        "cached": cached,
        "counters": delta,
        "outputs": outputs,
        "requests": requests,
    }


def worker(name: str, args: argparse.Namespace, geo: dict, model: str, log: str, conn) -> None:
    """Holds one vLLM instance; runs a round per ("round", n) message, until ("stop",)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # vLLM's engine core (a spawned process) inherits these
    os.dup2(fd, 2)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.reserved_cpus >= 0:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    try:
        from vllm import LLM

        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            dtype="float32",
            block_size=args.block_size,
            max_model_len=geo["max_model_len"],
            num_gpu_blocks_override=geo["large_blocks" if name == "vllm-large" else "gpu_blocks"],
            max_num_seqs=4,
            enable_prefix_caching=True,
            enforce_eager=True,
            seed=args.seed,
            disable_log_stats=False,
            kv_transfer_config=connector_config(name, geo, Path(log).parent),
        )
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints it
        traceback.print_exc()
        sys.stdout.flush()
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        try:
            conn.send(("result", run_round(llm, args, msg[1])))
        except BaseException as e:  # noqa: BLE001 - the same
            traceback.print_exc()
            sys.stdout.flush()
            conn.send(("error", f"{type(e).__name__}: {e}"))
            break
    del llm
    conn.send(("stopped", None))


# ------------------------------------------------------------------------------- the parent


def root_cause(log: Path, fallback: str) -> str:
    """The first exception line in a vLLM log (the worker's own, before the engine core's and
    the front end's wrappers), else fallback."""
    text = log.read_text(errors="replace") if log.exists() else ""
    for line in text.splitlines():
        msg = line
        if re.match(r"^\(\S+ pid=\d+\) ", line):  # a process's log line: errors only
            if " ERROR " not in line or "] " not in line:
                continue
            msg = line.split("] ", 1)[1]
        m = re.match(r"^((?:[\w.]+\.)?(?:[A-Z]\w*)?(?:Error|Exception)): (.+)$", msg.strip())
        if m and "Engine core initialization failed" not in msg:
            return f"{m.group(1)}: {m.group(2)}"
    return fallback


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def start(name, args, geo, model, tmp: Path):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    log = tmp / f"{name}.log"
    proc = ctx.Process(target=worker, args=(name, args, geo, model, str(log), child))
    t0 = time.perf_counter()
    proc.start()
    kind, info = parent.recv() if parent.poll(900) else ("error", "no answer in 900 s")
    if kind != "ready":
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        return None, root_cause(log, info)
    m = re.search(r"core ids=(\[[\d, ]*\])", log.read_text(errors="replace"))
    cores = f"model's OMP threads on cores {m.group(1)}" if m else "OMP binding not logged"
    print(
        f"  {name}: vLLM started in {time.perf_counter() - t0:.0f} s, {cores} (log {log})",
        flush=True,
    )
    return (proc, parent), None


def fmt_int(x: float) -> str:
    return f"{round(x):,}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    geo = geometry(args)
    tmp = Path(tempfile.mkdtemp(prefix="hicache-vllm-bench-"))
    ws_conv = geo["max_model_len"] // args.block_size
    print(
        f"model: {'Gemma 3 (sliding window ' + str(args.window) + ' / full, alternating)' if args.model == 'gemma3' else 'Llama'} "
        f"{args.layers} layers, hidden {args.hidden}, {args.hidden // HEAD_DIM} heads "
        f"({args.kv_heads} KV) of {HEAD_DIM}, float32, random weights; "
        f"KV {geo['kv_bytes_per_token']} B/token"
    )
    print(
        f"workload: {args.conversations} conversations x {args.turns} turns x {args.tokens} new "
        f"tokens (+{args.max_tokens} generated), {args.rounds} rounds; longest prompt "
        f"{(args.turns - 1) * (args.tokens + args.max_tokens) + args.tokens} tokens"
    )
    print(
        f"vLLM's KV cache: {geo['gpu_blocks']} blocks of {args.block_size} "
        f"(a conversation at its end: {ws_conv} blocks; all {args.conversations}: "
        f"{ws_conv * args.conversations}; vllm-large: {geo['large_blocks']}); "
        f"host tier {geo['host_bytes'] / 2**20:.0f} MiB "
        f"(working set {geo['working_set_bytes'] / 2**20:.1f} MiB)"
    )
    print(f"load average at start: {load_average()}", flush=True)
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    failed: dict[str, str] = {}
    workers: dict = {}
    try:
        make_model(str(tmp / "model"), args, geo["max_model_len"])
        for name in args.configs:
            w, why = start(name, args, geo, str(tmp / "model"), tmp)
            if w is None:
                failed[name] = why
                print(f"  {name}: not runnable: {why}", flush=True)
            else:
                workers[name] = w
        for rnd in range(args.rounds):
            live = [c for c in args.configs if c in workers]
            order = live[rnd % len(live) :] + live[: rnd % len(live)] if live else []
            for name in order:
                proc, conn = workers[name]
                time.sleep(PAUSE_S)
                conn.send(("round", rnd))
                kind, info = conn.recv()
                if kind != "result":
                    failed[name] = info
                    print(f"  {name}: round {rnd} failed: {info}", flush=True)
                    del workers[name]
                    proc.join(30)
                    continue
                results[name].append(info)
                print(
                    f"  round {rnd} {name}: {info['wall']:.2f} s, "
                    f"{info['prompt_tokens'] / info['wall']:,.0f} prompt tokens/s, "
                    f"{info['cached']:,} cached (load {load_average()})",
                    flush=True,
                )
    finally:
        for proc, conn in workers.values():
            try:
                conn.send(("stop",))
                if conn.poll(60):
                    conn.recv()
            except (OSError, EOFError):
                pass
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    report(args, results, failed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "geometry": geo, "failed": failed, **results}, f)
    print(f"load average at end: {load_average()}")
    return 0


def report(args: argparse.Namespace, results: dict[str, list[dict]], failed: dict) -> None:
    print()
    print(
        "| config | wall s (measured turns) | prompt tokens | prompt tokens/s | cached tokens "
        "(vLLM's / connector's) | hicache L2 pages loaded / stored | tokens/s ratio to vLLM |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rate: dict[str, float] = {}
    for name in args.configs:
        rows = results[name]
        if not rows:
            continue
        wall = sum(r["wall"] for r in rows)
        tokens = sum(r["prompt_tokens"] for r in rows)
        rate[name] = tokens / wall
    base = rate.get("vllm")
    for name in args.configs:
        rows = results[name]
        if not rows:
            why = failed.get(name, "no rounds")
            print(f"| {name} | not runnable: {why} | | | | | |")
            continue
        wall = sum(r["wall"] for r in rows)
        tokens = sum(r["prompt_tokens"] for r in rows)
        cached = sum(r["cached"] for r in rows)
        c: dict[str, float] = {}
        for r in rows:
            for k, v in r["counters"].items():
                c[k] = c.get(k, 0) + v
        own, ext = c.get("prefix_cache_hits", 0), c.get("external_prefix_cache_hits", 0)
        l2 = (
            f"{fmt_int(c.get('hicache_l2_load_pages', 0))} / "
            f"{fmt_int(c.get('hicache_l2_store_pages', 0))}"
            if name.startswith("hicache")
            else ""
        )
        ratio = f"{rate[name] / base:.2f}" if base else ""
        per_round = ", ".join(f"{r['prompt_tokens'] / r['wall']:,.0f}" for r in rows)
        print(
            f"| {name} | {wall:.2f} | {tokens:,} | {rate[name]:,.0f} ({per_round}) | "
            f"{cached:,} ({fmt_int(own)} / {fmt_int(ext)}) | {l2} | {ratio} |"
        )
    ran = [n for n in args.configs if len(results[n]) == args.rounds]
    if len(ran) >= 2:
        ref = [o for r in results[ran[0]] for o in r["outputs"]]
        diff = [n for n in ran[1:] if [o for r in results[n] for o in r["outputs"]] != ref]
        if diff:
            print(f"\ngreedy token ids: DIFFER from {ran[0]} in {', '.join(diff)}")
        else:
            print(f"\ngreedy token ids: identical across {', '.join(ran)} ({len(ref)} requests)")
    if len(ran) >= 2 and args.rounds > 1:
        med = {
            n: statistics.median(r["prompt_tokens"] / r["wall"] for r in results[n]) for n in ran
        }
        print("median per-round tokens/s: " + ", ".join(f"{n} {v:,.0f}" for n, v in med.items()))


if __name__ == "__main__":
    sys.exit(main())
