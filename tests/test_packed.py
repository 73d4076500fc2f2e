"""Prepacked CPU linear layers: same results as nn.Linear, active only during a step, optional."""

from __future__ import annotations

import pytest
import torch

from labkit import Engine, EngineConfig, SamplingParams
from labkit.models.random import random_model
from labkit.runtime.packed import PACKED_MAX_ROWS, PackedLinears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def small_model(arch: str = "llama", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return random_model(arch, hidden_size=64, intermediate_size=96, num_hidden_layers=2, dtype=dtype)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's q/k/v projections have a bias
def test_packed_layers_compute_what_nn_linear_computes(arch, dtype, tolerance):
    model = small_model(arch, dtype)
    assert PackedLinears.supported(model)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert any(m.bias is not None for m in linears) == (arch == "qwen2")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # biases start at zero; make them count
        for layer in linears:
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator))
    packed = PackedLinears.of(model)
    if packed is None:  # e.g. bf16 packing needs avx512bw/vl/dq or avx_ne_convert, which some CPUs lack
        assert dtype != torch.float32, "oneDNN refused float32 packing"
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype} weights")
    assert [layer.module for layer in packed.layers] == linears
    with torch.inference_mode():
        for layer in linears:
            # Up to PACKED_MAX_ROWS rows run on the packed weights, more on nn.Linear: both must agree.
            for rows in [(1,), (1, 37), (3, 5), (1, PACKED_MAX_ROWS), (2, 40)]:
                shape = (*rows, layer.in_features)
                x = torch.randn(shape, generator=generator).to(dtype)
                strided = torch.randn(*shape[:-1], 2 * layer.in_features, generator=generator).to(dtype)[..., ::2]
                expected = [layer(x), layer(strided)]
                with packed.active():
                    got = [layer(x), layer(strided)]
                for want, out in zip(expected, got, strict=True):
                    assert out.shape == want.shape and out.dtype == want.dtype
                    torch.testing.assert_close(out, want, rtol=tolerance, atol=tolerance)


def test_steps_of_up_to_packed_max_rows_run_on_the_packed_weights(monkeypatch):
    """PACKED_MAX_ROWS is the row count the layout is packed for: that many rows still use it, one more does not."""
    rows_packed = []
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        rows_packed.append(x.shape[0])
        return linear_pointwise(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    (layer,) = PackedLinears(torch.nn.Linear(8, 4)).layers
    for rows in (1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):
        layer(torch.ones(rows, 8))
    assert rows_packed == [1, PACKED_MAX_ROWS]


def test_packed_weights_are_switched_on_only_inside_a_step():
    model = small_model()
    packed = PackedLinears(model)
    first = packed.layers[0]
    with packed.active():
        assert first.module.forward is first
    assert "forward" not in first.module.__dict__ and first.module.forward.__func__ is torch.nn.Linear.forward
    with pytest.raises(RuntimeError, match="boom"), packed.active():
        raise RuntimeError("boom")
    assert all("forward" not in layer.module.__dict__ for layer in packed.layers)


def test_changed_weights_are_packed_again_before_the_next_step():
    """Training, loading or replacing weights after the engine was built must show in its outputs."""
    model = small_model("qwen2")
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, device="cpu", pack_weights=True))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompt = list(range(3, 20))

    def engine_tokens():
        return engine.generate([prompt], params)[0].output_token_ids

    def generate_tokens():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        return out[0, len(prompt) :].tolist()

    before = engine_tokens()
    assert before == generate_tokens()
    layers = engine.runner.packed_linears.layers
    attention = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # written in place
        attention.q_proj.bias.add_(torch.randn(attention.q_proj.bias.shape, generator=generator))
    attention.o_proj.weight = torch.nn.Parameter(torch.randn(attention.o_proj.weight.shape, generator=generator))
    mlp = model.model.layers[1].mlp
    mlp.down_proj.weight.data = torch.randn(mlp.down_proj.weight.shape, generator=generator)  # same Parameter, new data
    assert sum(layer.stale() for layer in layers) == 4
    after = engine_tokens()
    assert after != before and after == generate_tokens()
    assert not any(layer.stale() for layer in layers)


def test_a_repack_cut_short_leaves_no_layer_switched_and_packs_again_next_step(monkeypatch):
    """A Ctrl-C (or MemoryError) while changed weights are packed again: the layer stays stale, so the next step
    packs it whole, and the layers switched before it go back to nn.Linear's forward. A layer noted fresh before
    its copy was made would serve its old weights for good, and a switched one would serve model.generate too."""
    model = small_model()
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, device="cpu", pack_weights=True))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = list(range(3, 20))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.0)
    reorder, calls = torch.ops.mkldnn._reorder_linear_weight, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:  # the second layer's repack
            raise KeyboardInterrupt
        return reorder(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([prompt], params)
    monkeypatch.undo()
    assert not [name for name, module in model.named_modules() if "forward" in module.__dict__]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    assert engine.generate([prompt], params)[0].output_token_ids == expected


@pytest.mark.parametrize("faster", [True, False])
def test_by_default_packing_is_kept_where_it_was_measured_faster(monkeypatch, faster):
    """oneDNN's packed kernels beat MKL's on some CPUs and lose on others: the default measures, once per model."""
    timed = []

    def measured(self):
        timed.append(self)
        return faster

    packings = []
    pack = PackedLinears.__init__

    def counted(self, model):
        packings.append(model)
        pack(self, model)

    monkeypatch.setattr(PackedLinears, "faster_than_linear", measured)
    monkeypatch.setattr(PackedLinears, "__init__", counted)
    model = small_model()
    engines = [Engine(model, EngineConfig(block_size=4, num_blocks=16, device="cpu")) for _ in range(2)]
    assert [e.runner.packed_linears is not None for e in engines] == [faster, faster]
    assert len(timed) == 1  # the second engine on the model gets the first one's answer
    assert len(packings) == (2 if faster else 1)  # where packing lost, the second engine packs nothing
    forced = Engine(model, EngineConfig(block_size=4, num_blocks=16, device="cpu", pack_weights=True))
    assert forced.runner.packed_linears is not None and len(timed) == 1


@pytest.mark.parametrize("slow", ["packed", "linear"])
def test_the_measurement_keeps_the_kernel_that_runs_faster(monkeypatch, slow):
    import time

    import labkit.runtime.packed as packed_module

    def slowed(function):
        def run(*args, **kwargs):
            time.sleep(2e-4)  # far more than either kernel takes on these small layers
            return function(*args, **kwargs)

        return run

    packed = PackedLinears(small_model())
    if slow == "packed":
        monkeypatch.setattr(packed_module.PackedLayer, "__call__", slowed(packed_module.PackedLayer.__call__))
    else:
        monkeypatch.setattr(packed_module.F, "linear", slowed(torch.nn.functional.linear))
    assert packed.faster_than_linear() == (slow == "linear")


def test_a_layer_with_a_forward_of_its_own_keeps_it():
    """A hook installed on the instance (as accelerate does) runs in engine steps and stays on the model.

    Packing is forced: measured, it may lose on this CPU, and then there would be no packed layer to displace the hook.
    """
    model = small_model()
    layer = model.model.layers[0].mlp.down_proj
    calls = []

    def hooked(x, forward=layer.forward):
        calls.append(x.shape[0])
        return forward(x)

    layer.forward = hooked
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=16, device="cpu", pack_weights=True))
    engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(calls) == 3 and layer.__dict__["forward"] is hooked  # one call per step, still installed


def test_bfloat16_weights_are_packed_wherever_onednn_computes_them_to_bfloat16_precision():
    """Packing bfloat16 depends on the CPU; where the kernel matches nn.Linear to bfloat16's precision, it is used
    (the parity test above skips where it is not, so it cannot tell a refusal that should not happen)."""
    model = small_model(dtype=torch.bfloat16)
    try:
        layer = PackedLinears(model).layers[0]
    except RuntimeError:
        pytest.skip("this CPU's oneDNN cannot pack bfloat16 weights")
    x = torch.linspace(-1, 1, 3 * layer.module.in_features, dtype=torch.bfloat16).view(3, -1)
    with torch.no_grad():
        if not torch.allclose(layer(x), layer.module(x), rtol=1e-2, atol=1e-2):
            pytest.skip("this CPU's oneDNN computes bfloat16 too far from nn.Linear")
    assert PackedLinears.of(model) is not None


def test_packing_is_for_cpu_models_in_float32_or_bfloat16():
    assert not PackedLinears.supported(small_model(dtype=torch.float16))
    assert not PackedLinears.supported(torch.nn.Module())  # no parameters


def test_weights_off_the_cpu_are_not_packed():
    """oneDNN packs host memory: a model elsewhere (here the meta device, standing in for a GPU) keeps nn.Linear."""
    assert PackedLinears.supported(torch.nn.Linear(8, 4))
    assert not PackedLinears.supported(torch.nn.Linear(8, 4, device="meta"))


@pytest.mark.parametrize("lacks", ["onednn", "packed kernels"])
def test_a_torch_without_onednn_or_its_packed_kernels_packs_nothing(monkeypatch, lacks):
    if lacks == "onednn":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    else:
        monkeypatch.setattr(torch.ops, "mkldnn", object())  # an older torch: no _reorder_linear_weight
    assert not PackedLinears.supported(torch.nn.Linear(8, 4))


def test_engine_outputs_and_model_are_the_same_with_and_without_packing():
    model = small_model()
    prompts = [list(range(3, 3 + n)) for n in (1, 17, 40, 9)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    before = model.generate(torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False)
    outputs = {}
    for pack in (True, False):
        engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, device="cpu", pack_weights=pack))
        assert (engine.runner.packed_linears is not None) == pack
        outputs[pack] = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert outputs[True] == outputs[False]
    # The engine's steps leave the model as it was: generate() sees stock layers.
    after = model.generate(torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False)
    assert torch.equal(before, after)
    assert after[0, len(prompts[1]) :].tolist() == outputs[True][1]


def test_pack_weights_must_be_none_or_a_bool():
    with pytest.raises(TypeError, match="pack_weights must be None or a bool, got str"):
        EngineConfig(pack_weights="yes")


def test_a_platform_whose_onednn_refuses_runs_unpacked(monkeypatch):
    def refuse(weight, rows):
        raise RuntimeError("no packed kernels on this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    model = small_model()
    assert PackedLinears.supported(model) and PackedLinears.of(model) is None
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=16, device="cpu"))
    assert engine.runner.packed_linears is None
    (output,) = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(output.output_token_ids) == 3


def test_a_platform_whose_onednn_computes_wrong_results_runs_unpacked(monkeypatch):
    """The first layer is checked against nn.Linear before anything is packed for good: a wrong kernel is not used."""
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: 2 * linear_pointwise(*args))
    model = small_model()
    assert PackedLinears.supported(model) and PackedLinears.of(model) is None
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=16, device="cpu", pack_weights=True))
    assert engine.runner.packed_linears is None


@pytest.mark.parametrize(
    "make", [lambda: torch.nn.Linear(8, 4), lambda: torch.nn.Embedding(4, 8)], ids=["one linear", "no linear"]
)
def test_a_model_with_a_single_linear_layer_or_none_is_packed_whole(make):
    model = make()
    packed = PackedLinears.of(model)
    assert packed is not None
    assert [layer.module for layer in packed.layers] == [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_packing_leaves_the_global_random_state_alone():
    model = small_model()
    state = torch.get_rng_state()
    assert PackedLinears.of(model) is not None
    assert torch.equal(torch.get_rng_state(), state)
