"""`loopserve bench family-renders`: a reasoning agent's 30-turn tool loop rendered for each model
family's built-in tiny model (its real tokenizer and template), as the turn driver renders it (a
delta where proven, else in full) against every turn rendered in full: incremental turns and
render CPU a turn. The same loop is what tests/unit/models/test_tiny_families.py checks, prompt
for prompt, against the family's own render."""

from __future__ import annotations

import argparse
import random
import time
from typing import Iterator, Optional, Sequence

from cluster.models.names import TINY_DEEPSEEK_R1, TINY_LLAMA3, TINY_QWEN3, TINY_QWEN3_CODER

TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a command.", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]
# family -> calls a turn the loop draws from (Llama 3.2's template takes one)
FAMILIES = {TINY_QWEN3: (1, 1, 2), TINY_QWEN3_CODER: (1, 1, 2), TINY_LLAMA3: (1,), TINY_DEEPSEEK_R1: (1, 1, 2)}
HISTORY_ROLES = frozenset({"user", "assistant", "tool"})


def text_item(role: str, text: str) -> dict:
    return {"type": "message", "role": role, "content": [{"type": "input_text" if role == "user" else "output_text",
                                                          "text": text}]}


def loop_turns(n: int, seed: int = 7, user_text=lambda i: f"Now part {i + 1}.",
               per_turn: Sequence[int] = (1, 1, 2)) -> Iterator[tuple[list, list]]:
    """(the model's output, the next input) per turn: reasoning + calls, outputs of 200-5,000
    characters; every 10th turn a final answer and the user's next request."""
    rng = random.Random(seed)
    for i in range(n):
        if i % 10 == 9:
            yield ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": f"All done for part {i}."}]},
                    text_item("assistant", f"Part {i} done.")], [text_item("user", user_text(i))])
            continue
        calls = [{"type": "function_call", "call_id": f"c{i}-{k}", "name": "shell",
                  "arguments": f'{{"cmd": "step {i} {k}"}}'} for k in range(rng.choice(per_turn))]
        output = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": f"Turn {i}: look further."}]},
                  *calls]
        outputs = [{"type": "function_call_output", "call_id": c["call_id"],
                    "output": "".join(rng.choice("abcdefgh \n{}<>") for _ in range(rng.randint(200, 5000)))}
                   for c in calls]
        yield output, outputs


def rendered_loop(renderer, turns, check=None) -> tuple[int, int, float, float]:
    """Every turn through the renderer as the turn driver runs it. `check(items, prompt)` sees each
    prompt. Returns (turns, incremental turns, CPU s rendering, CPU s the same turns in full)."""
    items = [text_item("user", "Fix the build.")]
    first = renderer.full(items, None, TOOLS)
    prefix, anchor, count = first.assemble(None)[0], first.anchor_start, len(items)
    n = deltas = 0
    served = full = 0.0
    for output, new in turns:
        items = items + output + new
        n += 1
        started = time.process_time()
        res = renderer.delta(items[anchor:count], items[count:], anchor, None, TOOLS, history_roles=HISTORY_ROLES)
        if res is None:
            res = renderer.full(items, None, TOOLS)
        else:
            deltas += 1
        prefix, prompt = res.assemble(prefix)
        between = time.process_time()
        if check is None:
            renderer.full(items, None, TOOLS)
            full += time.process_time() - between
        else:
            check(items, prompt)
        served += between - started
        anchor, count = res.anchor_start, len(items)
    return n, deltas, served, full


def main(argv: Optional[list[str]] = None) -> int:
    from transformers import AutoTokenizer

    from cluster.config import ModelConfig
    from cluster.core.render.tokenizer import renderer_for
    from cluster.models.builtin import ensure_builtin

    parser = argparse.ArgumentParser(prog="loopserve bench family-renders", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args(argv)
    for name, per_turn in FAMILIES.items():
        renderer = renderer_for(AutoTokenizer.from_pretrained(ensure_builtin(name, weights=False)),
                                model=ModelConfig(name=name, builtin=name))
        for r in range(ns.rounds):
            n, deltas, served, full = rendered_loop(renderer, loop_turns(30, per_turn=per_turn))
            print(f"{name} round {r}: incremental {deltas}/{n}; render CPU a turn {1000 * served / n:.1f} ms, "
                  f"every turn in full {1000 * full / n:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
