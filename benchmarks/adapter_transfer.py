"""A LoRA adapter trained on B, carried into the merge of A and B (``hf-lmc apply``).

The zoo's GPT-2 pair (the pair the package ships) is merged with weight matching through the
command line. A LoRA adapter is trained on B for a second task: one play neither member saw
(``winters_tale`` by default; its first 80 % to train on, the rest held out). The held-out loss
on that play's last 20 % (the adapter's task) and on the other held-out play (``as_you_like_it``,
the models' own task) is measured for B, B with its adapter, the merge, the merge with the adapter
applied as it is, and the merge with the adapter moved by ``hf-lmc apply``; and for moved B with
the moved adapter, which must equal B with its adapter (the move is exact). Seeds are fixed;
the record goes under ``benchmarks/results/`` (``adapter_transfer-<date>.json``).

    python -m benchmarks.adapter_transfer [--steps 300] [--rank 8] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import tempfile
import time
from pathlib import Path

from .record import new_record, write

#: The adapter's task and the models' own held-out task (plays of the shipped corpus).
ADAPTER_PLAY, OWN_PLAY = "winters_tale", "as_you_like_it"
TARGETS = ["c_attn", "c_proj", "c_fc"]


def _tokens(text: str, folder: Path):
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def _windows(tokens, length: int):
    """The token stream cut into consecutive windows of ``length`` (the tail dropped)."""
    count = tokens.numel() // length
    return tokens[: count * length].reshape(count, length)


def _loss(model, windows, batch: int = 32) -> float:
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            ids = windows[i : i + batch]
            logits = model(input_ids=ids).logits[:, :-1]
            total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
            count += ids[:, 1:].numel()
    return total / count


def _train_adapter(folder: Path, tokens, out: Path, *, steps: int, rank: int, seed: int, length: int) -> float:
    """A LoRA on ``folder``'s model trained on random windows of ``tokens``; seconds taken."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(folder)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    adapted = get_peft_model(model, config)
    optimiser = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=2e-3)
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    adapted.train()
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - length, (16,), generator=generator)
        ids = torch.stack([tokens[s : s + length] for s in starts.tolist()])
        loss = adapted(input_ids=ids, labels=ids).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    seconds = time.perf_counter() - start
    adapted.save_pretrained(out)
    return seconds


def measure(steps: int, rank: int, seeds: list[int]) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_lmc.cli import main
    from hf_lmc.io import zoo

    a, b = zoo.pair("gpt2")
    plays = zoo._corpus()["plays"]
    length = AutoModelForCausalLM.from_pretrained(b).config.n_positions
    task = _tokens(plays[ADAPTER_PLAY], b)
    cut = int(0.8 * task.numel())
    train, task_test = task[:cut], _windows(task[cut:], length)
    own_test = _windows(_tokens(plays[OWN_PLAY], b), length)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        merged = scratch / "merged"
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["merge", str(a), str(b), "-o", str(merged), "-q"]) == 0
            assert main(["apply", str(merged), str(b), "-o", str(scratch / "b-moved"), "-q"]) == 0
        for seed in seeds:
            lora = scratch / f"lora-{seed}"
            seconds = _train_adapter(b, train, lora, steps=steps, rank=rank, seed=seed, length=length)
            moved_lora = scratch / f"lora-{seed}-moved"
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                code = main(["apply", str(merged), str(lora), "--base-model", str(b), "-o", str(moved_lora), "-q"])
            assert code == 0
            move_seconds = time.perf_counter() - start

            def model(folder, adapter=None):
                loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
                return PeftModel.from_pretrained(loaded, str(adapter)).eval() if adapter else loaded.eval()

            models = {
                "B": model(b),
                "B + adapter": model(b, lora),
                "merge": model(merged),
                "merge + adapter, not moved": model(merged, lora),
                "merge + adapter, moved": model(merged, moved_lora),
                "moved B + moved adapter": model(scratch / "b-moved", moved_lora),
            }
            losses = {
                name: {"adapter task": _loss(m, task_test), "own task": _loss(m, own_test)}
                for name, m in models.items()
            }
            rows.append({"seed": seed, "train_seconds": seconds, "move_seconds": move_seconds, "losses": losses})
    exact = max(
        abs(row["losses"]["moved B + moved adapter"][t] - row["losses"]["B + adapter"][t])
        for row in rows
        for t in ("adapter task", "own task")
    )
    return {"rows": rows, "largest_moved_vs_original_difference": exact, "nats": "mean next-token cross-entropy"}


def summary(rows: list[dict]) -> dict:
    """Per model and task: mean, standard deviation and worst (largest) loss over the seeds."""
    names = rows[0]["losses"].keys()
    out = {}
    for name in names:
        out[name] = {}
        for task in ("adapter task", "own task"):
            values = [row["losses"][name][task] for row in rows]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1))
            out[name][task] = {"mean": mean, "std": std, "worst": max(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="adapter training steps (batches of 16 windows)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="adapter seeds (one adapter each)")
    args = parser.parse_args(argv)
    settings = {
        "pair": "zoo gpt2, seeds 0 and 1 (shipped)",
        "merge": "hf-lmc merge (weight matching, alpha 0.5)",
        "adapter": {"targets": TARGETS, "rank": args.rank, "alpha": 2 * args.rank, "steps": args.steps, "lr": 2e-3},
        "adapter_task": f"{ADAPTER_PLAY}: first 80 % trains, last 20 % evaluates",
        "own_task": f"{OWN_PLAY} (held out from the pair's training)",
        "seeds": args.seeds,
    }
    record = new_record("adapter_transfer", settings)
    figures = measure(args.steps, args.rank, args.seeds)
    record |= figures | {"summary": summary(figures["rows"])}
    path = write(record)
    for name, tasks in record["summary"].items():
        shown = "  ".join(
            f"{task} {v['mean']:.3f} ± {v['std']:.3f} (worst {v['worst']:.3f})" for task, v in tasks.items()
        )
        print(f"{name:<28} {shown}")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
