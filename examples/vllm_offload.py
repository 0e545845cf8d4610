"""vLLM with hicache's L2 (host memory) and L3 (a file store shared by two vLLM instances).

    .venv-vllm/bin/python examples/vllm_offload.py            # make vllm-env first
    .venv-vllm/bin/python examples/vllm_offload.py --model /path/to/hf/model --storage file:/tmp/kv

Without --model it builds a random-weight tiny Llama (transformers, save_pretrained), so it runs
offline on the CPU build of vLLM; prompts are token ids (skip_tokenizer_init). The first
instance computes three prompts sharing a prefix, then runs them again after emptying vLLM's
own prefix cache: vLLM reports the connector's tokens as cached (L2). A second instance, a
fresh process with an empty L1 and L2, shares only the file store and gets the prefixes from
L3. docs/vllm.md has every kv_connector_extra_config key.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile


def build_tiny_llama(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # CPU attention supports 64, not 16
        max_position_embeddings=1024,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)


def prompts() -> list[list[int]]:
    r = random.Random(1)
    prefix = [r.randrange(3, 512) for _ in range(100)]
    return [prefix + [r.randrange(3, 512) for _ in range(n)] for n in (20, 45, 70)]


def run_instance(model: str, storage: str, label: str, passes: int, policies: dict) -> None:
    # vLLM's CPU build otherwise reserves most of the machine's memory for its own KV cache.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of L1
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        block_size=32,  # CPU attention: a multiple of 32
        max_model_len=1024,
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"storage": storage, "host_gib": 1, **policies},
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for n in range(passes):
        if n:
            llm.reset_prefix_cache()  # vLLM's own cache only: hicache's L2 stays
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], params)
        for o in outs:
            print(
                f"[{label} pass {n}] prompt of {len(o.prompt_token_ids or [])} tokens: "
                f"{o.num_cached_tokens} cached, output {list(o.outputs[0].token_ids)}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a HF model directory (default: build a tiny random Llama)")
    ap.add_argument("--storage", help="an L3 spec shared by both instances (default: file:TMP)")
    ap.add_argument(
        "--prefetch-policy",
        default="wait_complete",
        choices=("wait_complete", "timeout", "best_effort"),
        help="how long a request waits for its pages from L3 (docs/vllm.md)",
    )
    ap.add_argument(
        "--write-policy",
        default="write_through",
        choices=("write_through", "write_back"),
        help="store computed pages every step, or when vLLM frees the request",
    )
    ap.add_argument("--instance", choices=("first", "second"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    policies = {"prefetch_policy": args.prefetch_policy, "write_policy": args.write_policy}
    if args.instance:
        passes = 2 if args.instance == "first" else 1
        run_instance(args.model, args.storage, args.instance, passes, policies)
        return
    with tempfile.TemporaryDirectory(prefix="hicache-vllm-") as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "model")
            build_tiny_llama(model)
        storage = args.storage or f"file:{os.path.join(tmp, 'store')}"
        for instance in ("first", "second"):  # two processes: nothing shared but the store
            cmd = [sys.executable, __file__, "--model", model, "--storage", storage]
            cmd += ["--prefetch-policy", args.prefetch_policy, "--write-policy", args.write_policy]
            subprocess.run([*cmd, "--instance", instance], check=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
