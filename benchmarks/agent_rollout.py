"""One multi-turn rollout of a recipe's prompts, without training: does the model call its tools, and how long does it
take? Prompts are built as training builds them; the engine is the recipe's (vLLM on a CPU).

  python benchmarks/agent_rollout.py --config recipes/smollm2_gsm8k_tool_grpo.yaml [--set key=value ...]
      [--prompts 8] [--show 2] [--json OUT]

Prints the agent's per-sample statistics (means), the reward, the seconds taken and ``--show`` whole trajectories.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--show", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()

    from megarl.config import load_config
    from megarl.data.batching import tokenize_prompts
    from megarl.data.prompts import load_prompts
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rewards.registry import load_reward
    from megarl.rollout.agent import make_rollout
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.factory import make_engine

    cfg = load_config(args.config, args.set)
    d, r = cfg.data, cfg.rollout
    tokenizer = load_tokenizer(cfg.model.hf_path, "model.hf_path")
    records = load_prompts(d.train_path, d.prompt_key, d.answer_key, d.prompt_template)[:args.prompts]
    prompts, _ = tokenize_prompts(records, tokenizer, d.apply_chat_template, r.max_prompt_tokens,
                                  source=repr(d.train_path), system_prompt=d.system_prompt,
                                  response_prefix=d.response_prefix)
    reward_fn = load_reward(cfg.trainer.reward)
    rollout = make_rollout(cfg, tokenizer)
    engine = make_engine(cfg, 0, None)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    params = SamplingParams(n=r.num_samples_per_prompt, temperature=r.temperature, max_new_tokens=r.max_new_tokens,
                            stop_token_ids=stop, seed=r.seed)
    try:
        start = time.perf_counter()
        out = rollout.generate(engine, [p.tokens for p in prompts], params)
        seconds = time.perf_counter() - start
    finally:
        rollout.close()
        engine.shutdown()
    texts = [tokenizer.decode(c.token_ids) for c in out]
    rewards = reward_fn(texts, [prompts[c.prompt_index].record.answer for c in out])
    stats: dict[str, float] = {}
    for c in out:
        for key, value in (c.stats or {}).items():
            stats[key] = stats.get(key, 0.0) + float(value) / len(out)
    policy = sum(sum(c.policy_mask) if c.policy_mask else len(c.token_ids) for c in out)
    result: dict[str, Any] = {"config": args.config, "overrides": args.set, "samples": len(out),
                              "seconds": round(seconds, 2), "reward_mean": sum(rewards) / len(out),
                              "policy_tokens": policy, "all_tokens": sum(len(c.token_ids) for c in out),
                              "agent": {k: round(v, 3) for k, v in stats.items()}}
    for c, text in list(zip(out, texts, strict=True))[:args.show]:
        print(f"--- prompt {c.prompt_index}:\n{tokenizer.decode(prompts[c.prompt_index].tokens)}{text}\n", flush=True)
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    from megarl.run.command import run_main

    run_main(main)
