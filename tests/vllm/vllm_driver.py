"""Runs vLLM (CPU build) with or without hicache's connector and writes what it generated.

Run as a script by tests/vllm (vLLM spawns its engine core, hence the __main__ guard, and each
scenario gets a fresh process): `python vllm_driver.py SPEC.json OUT.json`. SPEC keys:
model (a directory), prompts (lists of token ids), prompts_by_pass ({"n": prompts} for pass
n), passes (how many times the prompts run), reset_between (call reset_prefix_cache()
between passes), reset_connector (that reset empties the connector's L2 too), salts (a
cache_salt or null per pass), connector (null: vLLM alone, else kv_connector_extra_config),
connector_class and connector_module (another connector: tests/vllm/sabotage.py's),
max_tokens, block_size, max_model_len, num_gpu_blocks_override, kv_cache_gib, log_stats
(vLLM's stat loggers on: the connector's Prometheus counters and vllm:num_preemptions are
read after every pass), kv_events (an endpoint, e.g. ipc:///tmp/x: vLLM publishes KV cache
events there and this process subscribes), store_mode ({"n": [path, text]}: write text to
path before pass n: tests/vllm/flaky_store.py's cue), abort_passes (passes run through the
engine API, every odd request aborted after abort_after_steps steps).
OUT: one entry per pass, each a list per prompt of {token_ids, logprobs, num_cached_tokens}
(null: aborted). OUT.extra.json: {"metrics": [per pass: {counter: cumulative value}],
"events": [{type, medium, block_hashes, parent_block_hash, token_ids}, ...]}.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable


class EventTap:
    """Subscribes to vLLM's ZMQ KV event publisher and keeps every event it receives."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.events: list[dict] = []
        self._arrived = threading.Condition()  # notified after each batch joins `events`
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart()
            batch = [
                {
                    "type": type(ev).__name__,
                    "medium": getattr(ev, "medium", None),
                    "block_hashes": [str(h) for h in getattr(ev, "block_hashes", [])],
                    "parent_block_hash": str(getattr(ev, "parent_block_hash", None)),
                    "token_ids": list(getattr(ev, "token_ids", [])),
                }
                for ev in decoder.decode(frames[-1]).events
            ]
            with self._arrived:
                self.events.extend(batch)
                self._arrived.notify_all()

    def close(self, done: Callable[[list[dict]], bool], timeout: float = 60.0) -> list[dict]:
        """The events received once `done(events)` holds: the publishers send from their own
        threads, so the last batches may still be on their way when generation returns. Past
        `timeout` seconds, what has arrived (the test then says what is missing)."""
        with self._arrived:
            self._arrived.wait_for(lambda: done(self.events), timeout)
        self._stop.set()
        self._thread.join(5)
        return list(self.events)


def announced(total: dict) -> Callable[[list[dict]], bool]:
    """Whether every event the connector's counters promise has arrived: a BlockStored on the
    CPU medium per page stored to or prefetched into L2, and at least one on STORAGE once
    anything was written to L3."""
    cpu = total.get("l2_store_pages", 0) + total.get("hit_l3_pages", 0)
    l3 = 1 if total.get("l3_write_pages", 0) else 0

    def done(events: list[dict]) -> bool:
        stored = [e["medium"] for e in events if e["type"] == "BlockStored"]
        return stored.count("CPU") >= cpu and stored.count("STORAGE") >= l3

    return done


def hicache_counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter

    out: dict = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name.startswith("vllm:hicache_"):
            name = m.name.removeprefix("vllm:hicache_")
            out[name] = out.get(name, 0) + int(m.value)
        elif isinstance(m, Counter) and m.name == "vllm:num_preemptions":
            out["vllm_num_preemptions"] = out.get("vllm_num_preemptions", 0) + int(m.value)
    return out


SLIDING_WINDOW = 48  # the hybrid models' window: a block and a half at block size 32


def make_model(path: str, *, kind: str = "llama", layers: int = 2, seed: int = 0) -> None:
    """A random-weight tiny model (head size 64) saved with save_pretrained: a Llama, or a
    hybrid one that vLLM gives two KV cache groups (full attention and a sliding window of
    SLIDING_WINDOW tokens): "gemma3" (sliding, full, sliding, full) or "gptoss" (the same
    alternation, mixture of experts)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hybrid = dict(num_hidden_layers=4, sliding_window=SLIDING_WINDOW)
    if kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, **common)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "gemma3":
        types = ["sliding_attention", "full_attention"] * 2
        config = transformers.Gemma3TextConfig(layer_types=types, **hybrid, **common)
        model = transformers.Gemma3ForCausalLM(config)
    elif kind == "gptoss":
        config = transformers.GptOssConfig(
            num_local_experts=4, num_experts_per_tok=2, **hybrid, **common
        )
        model = transformers.GptOssForCausalLM(config)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    model.config.torch_dtype = "float32"
    model.save_pretrained(path)


def result_of(o) -> dict | None:
    if o is None:
        return None
    return {
        "token_ids": list(o.outputs[0].token_ids),
        "logprobs": [
            [t, d[t].logprob] for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)
        ],
        "num_cached_tokens": o.num_cached_tokens,
    }


def generate_aborting(llm, prompts: list, params, after_steps: int) -> list:
    """Every prompt submitted, `after_steps` engine steps run, then every odd-numbered request
    aborted mid-flight (in the middle of its loads, stores or decoding); the rest run to the
    end. Aborted requests come back as None."""
    engine = llm.llm_engine
    ids = [f"abort-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    done: dict = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps == after_steps:
            engine.abort_request([rid for i, rid in enumerate(ids) if i % 2])
    assert steps > after_steps, "every request finished before the abort"
    return [None if i % 2 else done[rid] for i, rid in enumerate(ids)]


def run(spec: dict, extra: dict) -> list:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict = {}
    tap = None
    if spec.get("kv_events"):
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec["kv_events"]
        )
        tap = EventTap(spec["kv_events"])
    if spec.get("log_stats"):
        kw["disable_log_stats"] = False
    if spec.get("num_gpu_blocks_override"):
        kw["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=spec.get("connector_class", "HiCacheConnector"),
            kv_connector_module_path=spec.get("connector_module", "hicache.integrations.vllm"),
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 1024),
        max_num_seqs=8,
        enable_prefix_caching=True,
        seed=0,
        enforce_eager=spec.get("enforce_eager", True),
        **kw,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=2, ignore_eos=True
    )
    passes = []
    extra["metrics"] = []
    for n in range(spec.get("passes", 1)):
        if n and spec.get("reset_between", True):
            assert llm.reset_prefix_cache(reset_connector=spec.get("reset_connector", False))
        mode = (spec.get("store_mode") or {}).get(str(n))  # [path, text]: flaky_store's cue
        if mode:
            with open(mode[0], "w") as f:
                f.write(mode[1])
        by_pass = spec.get("prompts_by_pass")
        prompts = [
            TokensPrompt(prompt_token_ids=p) for p in (by_pass or {}).get(str(n), spec["prompts"])
        ]
        salts = spec.get("salts")  # one salt (or null) per pass
        if salts and salts[n]:
            for p in prompts:
                p["cache_salt"] = salts[n]
        if n in spec.get("abort_passes", ()):
            outs = generate_aborting(llm, prompts, params, spec.get("abort_after_steps", 2))
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        passes.append([result_of(o) for o in outs])
        if spec.get("log_stats"):
            extra["metrics"].append(hicache_counters(llm))
    if tap is not None:
        extra["events"] = tap.close(announced(extra["metrics"][-1] if extra["metrics"] else {}))
    return passes


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2], kind=sys.argv[3] if len(sys.argv) > 3 else "llama")
        sys.exit(0)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    extra: dict = {}
    result = run(spec, extra)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    with open(sys.argv[2] + ".extra.json", "w") as f:
        json.dump(extra, f)
