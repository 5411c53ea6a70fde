"""Word-free arithmetic tasks for small instruct models, as bare-number answers that megarl.rewards.gsm8k:reward
compares with the completion's final number. Train and test prompts never coincide.

- ``arith`` (recipes/arith): a + b, a - b (two- and three-digit) or a x b (two-digit by one-digit), which a 135M
  model is partly right on in its head.
- ``product`` (recipes/product): three-digit by three-digit products, which it cannot do in its head and can with
  the Python tool (recipes/smollm2_product_tool_grpo.yaml).

  python scripts/make_arith_task.py --out recipes/arith [--task arith --train 4000 --test 500 --seed 0]
  python scripts/make_arith_task.py --out recipes/product --task product
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problem(rng: random.Random) -> tuple[str, int]:
    kind = rng.choice("+-x")
    if kind == "x":
        a, b = rng.randint(11, 99), rng.randint(2, 9)
        return f"What is {a} * {b}?", a * b
    a, b = rng.randint(10, 999), rng.randint(10, 99)
    return (f"What is {a} + {b}?", a + b) if kind == "+" else (f"What is {a} - {b}?", a - b)


def product(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"What is {a} * {b}?", a * b


TASKS = {"arith": problem, "product": product}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=sorted(TASKS), default="arith")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    seen: dict[str, int] = {}
    while len(seen) < args.train + args.test:
        question, answer = TASKS[args.task](rng)
        seen.setdefault(question, answer)
    items = list(seen.items())
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("test", items[:args.test]), ("train", items[args.test:])):
        with open(args.out / f"{name}.jsonl", "w") as f:
            for question, answer in part:
                f.write(json.dumps({"question": question, "answer": str(answer)}) + "\n")
        print(f"{args.out / name}.jsonl: {len(part)} problems")


if __name__ == "__main__":
    main()
