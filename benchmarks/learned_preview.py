"""Preview: does learned / dual matching lower the zoo GPT-2 pair's α=0.5 loss below weight matching?

Trains each matcher 200 steps (16 x 64 characters, Adam lr 3e-3) from the weight-matching
solution and reports the held-out loss of the α=0.5 merge before and after.

    python benchmarks/learned_preview.py
"""

import time

import torch

from hf_lmc import DualMatcher, LearnedMatcher, zoo
from hf_lmc.evaluation import EvalOptions, evaluate, load_batches
from hf_lmc.loading import load_model
from hf_lmc.zoo import train_tokens


def main() -> None:
    name = "gpt2"
    a, b = zoo.pair(name, progress=False)
    A, B = load_model(a), load_model(b)
    evalb = load_batches(zoo.held_out(name, size=8192), A.model.config, A.folder, EvalOptions(batch_size=16))
    tokens = train_tokens()
    g = torch.Generator().manual_seed(0)

    def batches():
        while True:
            s = torch.randint(0, tokens.numel() - 65, (16,), generator=g)
            yield {"input_ids": torch.stack([tokens[i : i + 64] for i in s.tolist()])}

    it = batches()
    train = [next(it) for _ in range(200)]
    for cls in (LearnedMatcher, DualMatcher):
        torch.manual_seed(0)
        m = cls(A.model, B.model)
        t = time.time()
        before = evaluate(m.merge(0.5), evalb).loss
        losses = m.fit(train, steps=200, lr=3e-3, progress=False)
        after = evaluate(m.merge(0.5), evalb).loss
        print(
            cls.__name__,
            f"loss@0.5 held-out: weight-matching init {before:.3f} -> after 200 steps {after:.3f}; train loss {losses[0]:.3f} -> {sum(losses[-20:]) / 20:.3f}; {time.time() - t:.0f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
