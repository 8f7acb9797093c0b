"""The most a draft model could give here: Qwen2.5-Coder-0.5B drafting greedily for the 1.5B.

    .venv/bin/python tools/draft_bound.py      # needs `make qwen-1.5b`; ~3 minutes on two cores

Teacher-forced on the 1.5B's greedy reply (256 tokens) to the two prompts of
`kvsession bench --concurrency`'s speculative rows, how often the 0.5B's
greedy next token is the 1.5B's; and the step costs: one token of each
model, and a five-token verifying pass of the 1.5B (every position's
logits kept). A k-token draft costs k steps of the 0.5B and one pass of the
1.5B and writes (1 - a^(k+1)) / (1 - a) tokens at per-token agreement a
(taken as independent); printed: the best k's speed against plain decode.
"""
import time

import torch

from kvsession.bench import concurrency as bc
from kvsession.engine import Engine, model_path
from kvsession.generate import generate
from kvsession.sampling import SamplerParams
from kvsession.session import advance

GREEDY = SamplerParams(temperature=0)
REPLY = 256


def step_ms(engine: Engine, tokens: int, runs: int = 20) -> float:
    s = engine.session(sampler=GREEDY)
    s.prefill(engine.tokenizer.encode(bc.PROSE))
    fed = [s.sample()] * tokens
    for i in range(3 + runs):
        if i == 3:
            t0 = time.perf_counter()
        advance([(s, fed)], keep=[tokens > 1])
        s.truncate(len(s) - tokens)
    return (time.perf_counter() - t0) / runs * 1e3


def main() -> None:
    torch.set_num_threads(2)
    big = Engine.load(model_path("qwen2.5-coder-1.5b"), device="cpu")
    small = Engine.load(model_path("qwen2.5-coder-0.5b"), device="cpu")
    big1, big5, small1 = step_ms(big, 1), step_ms(big, 5), step_ms(small, 1)
    print(f"step: 1.5B {big1:.1f} ms, 1.5B five tokens {big5:.1f} ms, 0.5B {small1:.1f} ms")
    for name, text in (("a function rewritten", bc.REPEATING), ("prose", bc.PROSE)):
        prompt = big.tokenizer.encode(text)
        s = big.session(sampler=GREEDY)
        generate(s, prompt, max_tokens=REPLY, ignore_eos=True)
        d = small.session(sampler=GREEDY)
        d.prefill(prompt)
        agree = 0
        for t in s.tokens[len(prompt):]:
            agree += int(torch.argmax(d.logits)) == t
            d.prefill([t])
        a = agree / REPLY
        speed, k = max(((1 - a ** (k + 1)) / (1 - a) / (k * small1 + big5) * big1, k) for k in range(1, 9))
        print(f"{name}: the 0.5B agrees at {a:.1%} of {REPLY} positions; best k = {k}: {speed:.2f}x plain decode")


if __name__ == "__main__":
    main()
