"""Train the bundled tiny-shakespeare model from the corpus that ships with labkit, on a CPU.

A lab about batching needs outputs that read like language and stop at naturally different
lengths: that is what makes continuous batching visible. So every speech of Tiny Shakespeare is
trained as ``BOS + speech + EOS``, and the model learns to end its own speech with EOS. The script
trains a byte-level BPE tokenizer, then a small Llama (grouped-query attention) on packed windows of
that token stream, printing the loss curve; the last 5% of the corpus is held out for evaluation.

    python -m labkit.models.train                 # full run, about 13 min on one CPU thread, into a temp dir
    python -m labkit.models.train --quick         # smoke test in well under a minute, into a temp dir
    python -m labkit.models.train --out labkit/models/tiny_shakespeare --overwrite   # rebuild the shipped one

Runs are seeded; torch uses ``--threads`` threads (1 by default), so results repeat on one machine.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"
HELDOUT_FRACTION = 0.05
PAD, BOS, EOS = "<pad>", "<s>", "</s>"  # ids 0, 1, 2

# Each message is one speech, spoken by message["name"] when given, else by the role in capitals.
# The generation prompt opens a speech by `speaker` (a template variable, "ASSISTANT" by default).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set who = message['name'] if message['name'] is defined else message['role'] | upper -%}"
    "{{ bos_token }}{{ who }}:\n{{ message['content'] }}{{ eos_token }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ bos_token }}{{ speaker if speaker is defined else 'ASSISTANT' }}:{{ '\\n' }}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the checkpoint: tokenizer and model shape, optimisation, data."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 512
    block_size: int = 512
    batch_size: int = 8
    steps: int = 360
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    eval_every: int = 50
    eval_chars: int = 20_000
    seed: int = 0


QUICK = Recipe(block_size=128, batch_size=4, steps=30, warmup_steps=5, eval_every=10, eval_chars=4_000)


def read_corpus(path: Path = CORPUS_PATH) -> str:
    return path.read_text(encoding="utf-8")


def split_speeches(text: str) -> list[str]:
    """Speeches are blocks "SPEAKER:\\nline\\nline" separated by blank lines; EOS stands for each blank line."""
    return [block.strip("\n") for block in text.split("\n\n") if block.strip()]


def split_corpus(text: str, heldout_fraction: float = HELDOUT_FRACTION) -> tuple[str, str]:
    """Cut the corpus at the first blank line after ``1 - heldout_fraction`` of its characters: (train, held out)."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    cut = text.index("\n\n", int(len(text) * (1 - heldout_fraction)))
    return text[:cut], text[cut + 2 :]


def train_tokenizer(speeches: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text encodes, no unknown tokens) whose encoder prepends BOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(speeches, trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=Recipe.max_positions,
    )


def encode_speeches(tokenizer: PreTrainedTokenizerFast, speeches: list[str]) -> torch.Tensor:
    """One token stream: BOS speech EOS BOS speech EOS ... (the tokenizer adds each BOS)."""
    encoded = tokenizer(speeches, add_special_tokens=True, verbose=False)["input_ids"]  # longer than a window is fine
    stream = [token for ids in encoded for token in [*ids, tokenizer.eos_token_id]]
    return torch.tensor(stream, dtype=torch.long)


def build_model(recipe: Recipe, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=200,
    )
    return model


@torch.no_grad()
def stream_loss(model: LlamaForCausalLM, stream: torch.Tensor, block_size: int) -> float:
    """Total cross-entropy (nats) of predicting every token of ``stream`` after the first, in windows."""
    model.eval()
    total = 0.0
    for start in range(0, len(stream) - 1, block_size):
        window = stream[start : start + block_size + 1].unsqueeze(0)
        logits = model(input_ids=window[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
    model.train()
    return total


def learning_rate(step: int, recipe: Recipe) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(recipe: Recipe, out: Path, threads: int = 1) -> dict[str, float]:
    """Train tokenizer and model, save both (weights in bfloat16) into ``out``; return the final metrics."""
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    started = time.perf_counter()

    train_text, heldout_text = split_corpus(read_corpus())
    train_speeches = split_speeches(train_text)
    tokenizer = train_tokenizer(train_speeches, recipe.vocab_size)
    stream = encode_speeches(tokenizer, train_speeches)
    eval_speeches = _leading_speeches(split_speeches(heldout_text), recipe.eval_chars)
    eval_stream = encode_speeches(tokenizer, eval_speeches)
    eval_chars = sum(len(s) + 2 for s in eval_speeches)  # +2: the blank line each EOS stands for

    model = build_model(recipe, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"corpus: {len(train_speeches)} train speeches, {len(stream):,} tokens "
        f"({len(train_text) / len(stream):.2f} chars/token); held-out eval slice {eval_chars:,} chars"
    )
    print(f"model: {num_params / 1e6:.2f}M parameters; {recipe.steps} steps of {recipe.batch_size}x{recipe.block_size}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    batches = torch.Generator().manual_seed(recipe.seed)
    speech_starts = torch.nonzero(stream == tokenizer.bos_token_id).squeeze(1) + 1
    model.train()
    print(f"{'step':>5} {'train loss':>10} {'held-out nats/char':>18} {'elapsed':>8}")
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, recipe)
        batch = sample_windows(stream, speech_starts, recipe, batches)
        loss = _shifted_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        last = step == recipe.steps - 1
        if step % recipe.eval_every == 0 or last:
            heldout = stream_loss(model, eval_stream, recipe.block_size) / eval_chars
            print(f"{step:>5} {loss.item():>10.3f} {heldout:>18.3f} {time.perf_counter() - started:>7.0f}s", flush=True)

    metrics = {"heldout_nats_per_char": heldout, "train_seconds": time.perf_counter() - started}
    _save(model, tokenizer, out, recipe, metrics)
    return metrics


def sample_windows(
    stream: torch.Tensor, speech_starts: torch.Tensor, recipe: Recipe, generator: torch.Generator
) -> torch.Tensor:
    """A batch of ``block_size + 1``-token windows: half start anywhere, half at a speech's first token.

    The engine encodes prompts without special tokens, so a prompt "ROMEO:" reaches the model with no
    BOS before it; windows that open on a bare speaker name teach the model that this starts a speech.
    """
    last = len(stream) - recipe.block_size - 1
    anywhere = torch.randint(0, last, (recipe.batch_size,), generator=generator)
    candidates = speech_starts[speech_starts < last]
    at_speech = candidates[torch.randint(0, len(candidates), (recipe.batch_size,), generator=generator)]
    starts = torch.where(torch.arange(recipe.batch_size) % 2 == 0, anywhere, at_speech)
    return torch.stack([stream[start : start + recipe.block_size + 1] for start in starts.tolist()])


def _shifted_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _leading_speeches(speeches: list[str], num_chars: int) -> list[str]:
    """The first speeches whose text (with separators) reaches ``num_chars`` characters."""
    taken, total = [], 0
    for speech in speeches:
        if total >= num_chars:
            break
        taken.append(speech)
        total += len(speech) + 2
    return taken


def _save(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, recipe: Recipe, metrics: dict[str, float]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)  # bfloat16 halves the file; loaders upcast on CPU
    tokenizer.save_pretrained(out)
    for path in out.iterdir():  # safetensors writes its file private (0600); a shared install must read it
        path.chmod(0o644)
    record = {"recipe": asdict(recipe), "heldout_fraction": HELDOUT_FRACTION, **metrics}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few tiny steps: a smoke test, not a usable model")
    parser.add_argument("--out", type=Path, help="output directory (default: a new temporary directory)")
    parser.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty --out")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--steps", type=int, help="override the number of optimiser steps")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="tiny-shakespeare-"))
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        parser.error(f"{out} is not empty; pass --overwrite to replace its checkpoint")
    recipe = QUICK if args.quick else Recipe()
    if args.steps is not None:
        recipe = Recipe(**{**asdict(recipe), "steps": args.steps})
    metrics = train(recipe, out, threads=args.threads)
    print(
        f"held-out loss {metrics['heldout_nats_per_char']:.3f} nats/char after {metrics['train_seconds']:.0f}s;"
        f" saved to {out}"
    )


if __name__ == "__main__":
    main()
