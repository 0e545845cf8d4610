"""Runs vLLM (CPU build) with or without hicache's connector and writes what it generated.

Run as a script by tests/vllm (vLLM spawns its engine core, hence the __main__ guard, and each
scenario gets a fresh process): `python vllm_driver.py SPEC.json OUT.json`. SPEC keys:
model (a directory), prompts (lists of token ids), passes (how many times the prompts run),
reset_between (call reset_prefix_cache() between passes), salts (a cache_salt or null per pass), connector (null: vLLM alone, else
kv_connector_extra_config), max_tokens, block_size, kv_cache_gib.
OUT: one entry per pass, each a list per prompt of {token_ids, logprobs, num_cached_tokens}.
"""

from __future__ import annotations

import json
import os
import sys


def make_model(path: str, *, layers: int = 2, seed: int = 0) -> None:
    """A random-weight tiny Llama (head size 64) saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)


def run(spec: dict) -> list:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=spec.get("block_size", 32),
        max_model_len=1024,
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
    for n in range(spec.get("passes", 1)):
        if n and spec.get("reset_between", True):
            assert llm.reset_prefix_cache()
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        salts = spec.get("salts")  # one salt (or null) per pass
        if salts and salts[n]:
            for p in prompts:
                p["cache_salt"] = salts[n]
        outs = llm.generate(prompts, params, use_tqdm=False)
        passes.append(
            [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "logprobs": [
                        [t, d[t].logprob]
                        for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)
                    ],
                    "num_cached_tokens": o.num_cached_tokens,
                }
                for o in outs
            ]
        )
    return passes


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2])
        sys.exit(0)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    result = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
