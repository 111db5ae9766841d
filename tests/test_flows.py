"""Invertible flows: exact inverses and log-dets, identical gradients across memory modes, memory curves,
the drift guard, save/load and the bits/dim convention. Small shapes, float64 references, CPU only."""

import copy
import io
import logging
import math

import pytest
import torch

from sinkflow.errors import SinkflowError
from sinkflow.flows import (ActNorm, AdditiveCoupling, AffineCoupling, FlowSequence, InvConv1x1, Squeeze,
                            bits_per_dim, build_flow, build_glow, build_realnvp, dequantize, flow_loss)
from sinkflow.models.footprint import SavedTensorCounter

MODES = ("standard", "checkpoint", "invertible")


def perturb(module, scale=0.05, seed=0):
    """Move every parameter off its (identity-like) init so the checks below are not trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


LAYERS = {
    "actnorm": lambda: ActNorm(4),
    "invconv": lambda: InvConv1x1(4),
    "affine_sigmoid": lambda: AffineCoupling(4, 8, scale="sigmoid"),
    "affine_tanh_swap": lambda: AffineCoupling(4, 8, scale="tanh", swap=True),
    "additive": lambda: AdditiveCoupling(4, 8),
    "squeeze": lambda: Squeeze(),
}


def make_layer(name, seed=0):
    torch.manual_seed(seed)
    layer = perturb(LAYERS[name](), 0.3, seed).double()
    layer(torch.randn(8, 4, 4, 4, dtype=torch.float64))  # ActNorm data-dependent init
    return layer


def jacobian_logdet(f, x):
    """Brute force: log|det d f(x)/dx| per sample, for f applied to a single sample."""
    out = []
    for i in range(x.shape[0]):
        xi = x[i: i + 1]
        jac = torch.autograd.functional.jacobian(lambda v: torch.cat([t.flatten() for t in f(v)]), xi)
        out.append(torch.linalg.slogdet(jac.reshape(jac.shape[0], -1))[1])
    return torch.stack(out)


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_inverse_and_logdet(name):
    layer = make_layer(name)
    x = torch.randn(2, 4, 4, 4, dtype=torch.float64)
    y, logdet = layer(x)
    assert logdet.shape == (2,)
    torch.testing.assert_close(layer.inverse(y), x, rtol=0, atol=1e-12)
    brute = jacobian_logdet(lambda v: [layer(v)[0]], x)
    torch.testing.assert_close(logdet, brute, rtol=1e-10, atol=1e-10)
    if name != "squeeze":  # the logdet must not be trivially zero for the layers that scale volume
        assert name == "additive" or logdet.abs().max() > 1e-3


@pytest.mark.parametrize("builder", ["glow", "glow_additive", "realnvp_vector"])
def test_model_inverse_and_logdet(builder):
    torch.manual_seed(0)
    if builder == "realnvp_vector":
        model, x = build_realnvp((6,), levels=2, depth_per_level=3, hidden_channels=8), torch.randn(3, 6)
    else:
        coupling = "additive" if builder == "glow_additive" else "affine"
        model = build_glow((2, 4, 4), levels=2, depth_per_level=2, hidden_channels=8, coupling=coupling)
        x = torch.randn(3, 2, 4, 4)
    model(x)  # ActNorm init
    model = perturb(model, 0.1).double()
    x = x.double()
    zs, logdet, _ = model.encode(x)
    assert sum(z[0].numel() for z in zs) == x[0].numel()
    torch.testing.assert_close(model.inverse(zs), x, rtol=0, atol=1e-11)
    brute = jacobian_logdet(lambda v: model.encode(v)[0], x)
    torch.testing.assert_close(logdet, brute, rtol=1e-9, atol=1e-9)


def grads_of(module, x, loss_fn):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    loss_fn(module, x).backward()
    return [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


def assert_grads_close(got, ref, rtol, atol=0.0):
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.to(r.dtype), r, rtol=rtol, atol=atol + rtol * r.abs().max().item())


def seq_loss(weights):
    """Uses both outputs, so the log-det gradient is checked as well as the output gradient."""
    w_y, w_ld = weights
    return lambda m, x: _seq_loss(m, x, w_y, w_ld)


def _seq_loss(m, x, w_y, w_ld):
    y, ld = m(x)
    return (y * w_y.to(y.dtype)).sum() + (ld * w_ld.to(ld.dtype)).sum()


@pytest.mark.parametrize("name", list(LAYERS))
def test_single_layer_gradients_match_across_modes(name):
    x = torch.randn(3, 4, 4, 4, dtype=torch.float64)
    seq64 = FlowSequence([make_layer(name)])
    y, _ = seq64(x)
    weights = (torch.randn(y.shape, dtype=torch.float64), torch.randn(3, dtype=torch.float64))
    loss = seq_loss(weights)
    ref = grads_of(seq64, x, loss)
    for mode in MODES:
        seq64.memory = mode
        assert_grads_close(grads_of(seq64, x, loss), ref, rtol=1e-10)
        seq32 = copy.deepcopy(seq64).float()
        assert_grads_close(grads_of(seq32, x.float(), loss), ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("depth", [1, 8, 32])
def test_model_gradients_match_float64_reference(depth):
    torch.manual_seed(depth)
    model = build_glow((2, 8, 8), levels=2, depth_per_level=depth, hidden_channels=8)
    x = torch.rand(4, 2, 8, 8) - 0.5
    model(x)  # ActNorm init
    model = perturb(model, 0.02, seed=depth).double()
    x = x.double()
    loss = lambda m, v: -m.log_prob(v).mean()  # noqa: E731
    ref = grads_of(model, x, loss)
    for mode in MODES:
        model.set_memory(mode)
        assert_grads_close(grads_of(model, x, loss), ref, rtol=1e-9)
    assert model.fallen_back == []
    if depth == 8:  # float32 run of every mode against the float64 reference
        m32 = copy.deepcopy(model).float()
        for mode in MODES:
            m32.set_memory(mode)
            assert_grads_close(grads_of(m32, x.float(), loss), ref, rtol=2e-4, atol=1e-6)
        assert m32.fallen_back == []


def saved_bytes(depth, mode):
    torch.manual_seed(0)
    model = build_glow((2, 16, 16), levels=1, depth_per_level=depth, hidden_channels=4, memory=mode)
    x = torch.randint(0, 256, (4, 2, 16, 16), dtype=torch.uint8)
    with SavedTensorCounter(model) as counter:
        loss, _ = flow_loss(model, x, torch.Generator().manual_seed(0))
    loss.backward()
    return counter.bytes


def test_saved_activation_memory_curves():
    b = {(d, m): saved_bytes(d, m) for d in (4, 16, 64) for m in MODES}
    ratio = {m: b[64, m] / b[4, m] for m in MODES}
    assert ratio["invertible"] <= 1.2  # flat in depth
    assert ratio["standard"] >= 12  # ~linear: 16x the depth
    assert 1.8 <= ratio["checkpoint"] <= 6  # ~sqrt: 4x for 16x the depth, plus a depth-free part
    assert b[16, "checkpoint"] / b[4, "checkpoint"] < b[64, "checkpoint"] / b[16, "checkpoint"] * 2
    for d in (4, 16, 64):
        assert b[d, "invertible"] < b[d, "checkpoint"] < b[d, "standard"]


def planted_model(kind):
    """float32 Glow in which one layer is planted ill-conditioned after ActNorm init."""
    torch.manual_seed(0)
    model = build_glow((2, 8, 8), levels=1, depth_per_level=4, hidden_channels=8, memory="invertible")
    x = torch.rand(4, 2, 8, 8) - 0.5
    with torch.no_grad():
        model(x)
    perturb(model, 0.05)
    layers = model.levels[0].layers  # 0 squeeze, then (actnorm, invconv, coupling) per step
    with torch.no_grad():
        if kind == "coupling":  # scale = sigmoid(-18) ~ 1e-8 on every transformed channel
            layers[6].net[-1].bias[1::2] = -20.0
            planted = "levels.0.layers.6 (AffineCoupling)"
        else:  # a 1x1 conv with one singular value ~1e-7, followed by well-conditioned mixing
            layers[5].log_s[0] = -16.0
            planted = "levels.0.layers.5 (InvConv1x1)"
    return model, x, planted


@pytest.mark.parametrize("kind", ["coupling", "invconv"])
def test_drift_guard_catches_planted_ill_conditioned_layer(kind, caplog):
    model, x, planted = planted_model(kind)
    loss = lambda m, v: -m.log_prob(v).mean()  # noqa: E731
    ref64 = grads_of(copy.deepcopy(model).double().set_memory("standard"), x.double(), loss)
    ref32 = grads_of(copy.deepcopy(model).set_memory("standard"), x, loss)
    assert_grads_close(ref32, ref64, rtol=1e-4, atol=1e-6)  # plain float32 autograd is fine here

    unguarded = copy.deepcopy(model).set_memory("invertible", drift_tol=math.inf)
    bad = grads_of(unguarded, x, loss)
    with pytest.raises(AssertionError):  # the plant really breaks reconstruction-based gradients
        assert_grads_close(bad, ref64, rtol=1e-2)

    with caplog.at_level(logging.WARNING, logger="sinkflow.flows.memory_modes"):
        got = grads_of(model, x, loss)
    assert planted in model.fallen_back
    assert "drift guard" in caplog.text and model.drift_events[0]["error"] > 1e-4
    assert_grads_close(got, ref64, rtol=1e-4, atol=1e-6)
    n_events = len(model.drift_events)
    got2 = grads_of(model, x, loss)  # second step: the layer now keeps its input, no new fallback needed
    assert_grads_close(got2, ref64, rtol=1e-4, atol=1e-6)
    assert len(model.drift_events) == n_events

    buf = io.BytesIO()  # the fallback decision is part of the state dict
    torch.save(model.state_dict(), buf)
    fresh, _, _ = planted_model(kind)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert planted in fresh.fallen_back


def test_healthy_float32_model_has_no_false_alarms():
    torch.manual_seed(0)
    model = build_glow((2, 8, 8), levels=2, depth_per_level=16, hidden_channels=8, memory="invertible")
    x = torch.randint(0, 256, (4, 2, 8, 8), dtype=torch.uint8)
    flow_loss(model, x)
    perturb(model, 0.02)
    loss, _ = flow_loss(model, x)
    loss.backward()
    assert model.fallen_back == [] and 0 < model.max_drift < 1e-4


def test_save_load_keeps_actnorm_initialised_and_loss_continuous():
    cfg = {"levels": 2, "depth_per_level": 2, "hidden_channels": 8, "memory": "invertible"}
    torch.manual_seed(0)
    model = build_flow(cfg, (1, 8, 8))
    x = torch.randint(0, 256, (8, 1, 8, 8), dtype=torch.uint8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        loss, _ = flow_loss(model, x, torch.Generator().manual_seed(1))
        loss.backward()
        opt.step()
    before = flow_loss(model, x, torch.Generator().manual_seed(2))[1]
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)

    torch.manual_seed(123)
    loaded = build_flow(cfg, (1, 8, 8))
    loaded.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert all(bool(m.initialized) for m in loaded.modules() if isinstance(m, ActNorm))
    other = torch.randint(0, 128, (8, 1, 8, 8), dtype=torch.uint8)  # a different first batch must not re-init
    flow_loss(loaded, other)
    after = flow_loss(loaded, x, torch.Generator().manual_seed(2))[1]
    assert after.item() == pytest.approx(before.item(), abs=1e-5)

    torch.manual_seed(123)  # control: without the load the loss is different (the check can fail)
    fresh = build_flow(cfg, (1, 8, 8))
    flow_loss(fresh, other)
    assert abs(flow_loss(fresh, x, torch.Generator().manual_seed(2))[1].item() - before.item()) > 1e-2


def test_bits_per_dim_and_dequantize_convention():
    dims = 3 * 4 * 4
    # the uniform density on [-0.5, 0.5)^D has log_prob 0: 8 bits/dim for 256 levels, 5 for 32
    assert bits_per_dim(torch.zeros(2), dims).tolist() == pytest.approx([8.0, 8.0])
    assert bits_per_dim(torch.zeros(1), dims, n_bins=32).item() == pytest.approx(5.0)
    x = torch.randint(0, 256, (5, 3, 4, 4), dtype=torch.uint8)
    d = dequantize(x, torch.Generator().manual_seed(0))
    assert d.dtype == torch.float32 and torch.all(d >= x.float()) and torch.all(d < x.float() + 1)
    torch.testing.assert_close(dequantize(x.float() / 255, torch.Generator().manual_seed(0)), d)
    with pytest.raises(SinkflowError):
        dequantize(torch.full((1, 3), 2.0))



@pytest.mark.parametrize("n_bins", [2, 17, 32, 100, 256])
def test_8_bit_pixels_reduce_to_every_level_count(n_bins):
    """Integer pixels are 8-bit: 0..255 map onto all of 0..n_bins-1, monotone, Glow's k // 2**(8-n_bits) for a power
    of two; for 17 (flow-digits) 255 // (256 // 17) = 17 was out of range and the error said to pass uint8 pixels."""
    from sinkflow.flows.losses import to_levels

    x = torch.arange(256, dtype=torch.uint8)
    k = to_levels(x, n_bins)
    assert k.min() == 0 and k.max() == n_bins - 1 and bool((k.diff() >= 0).all())
    assert torch.bincount(k, minlength=n_bins).min() >= 256 // n_bins  # every level used
    if 256 % n_bins == 0:
        assert torch.equal(k, x.long() // (256 // n_bins))
    assert torch.equal(to_levels(k.float() / (n_bins - 1), n_bins), k)  # floats at n_bins levels come back


@pytest.mark.parametrize("n_bins", [2, 4, 16, 32, 64, 128, 256])
def test_to_tensor_floats_reduce_as_their_uint8_pixels(n_bins):
    """ToTensor()'s floats k/255 are the same 8-bit pixels as uint8 k: the same levels and bits/dim at every level
    count that divides 256 (at 32 and 16 levels a fifth of the pixels got another level than their uint8 twin)."""
    from sinkflow.flows.losses import to_levels

    x = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(to_levels(x.float() / 255, n_bins), to_levels(x, n_bins))
    k = torch.arange(n_bins)
    assert torch.equal(to_levels(k.float() / (n_bins - 1), n_bins), k)  # floats at n_bins levels still come back
    torch.manual_seed(0)
    model = build_flow({"levels": 1, "depth_per_level": 1, "hidden_channels": 4}, (1, 4, 4))
    img = torch.randint(0, 256, (4, 1, 4, 4), dtype=torch.uint8)
    a = flow_loss(model, img, torch.Generator().manual_seed(0), n_bins)[1]
    b = flow_loss(model, img.float() / 255, torch.Generator().manual_seed(0), n_bins)[1]
    assert a == b


@pytest.mark.parametrize("bad, needle", [(torch.tensor([0.0, float("nan")]), "nan"),
                                         (torch.tensor([0.0, float("inf")]), "inf"),
                                         (torch.tensor([0, 300]), "0..300"), (torch.tensor([-1, 3]), "-1..3")])
def test_pixels_out_of_range_are_named(bad, needle):
    from sinkflow.flows.losses import to_levels

    with pytest.raises(SinkflowError, match=needle):
        to_levels(bad, 17)


def test_actnorm_initialised_on_one_value_per_channel_keeps_scale_one():
    """A batch of 1 at a 1x1 level gives each channel one value, std 0: the scale stays 1 (it was 1e6: -2 bits/dim
    on the first step of `flow-digits --batch-size 1 model.flow.levels=3`, then 'diverged, lower the lr')."""
    layer = ActNorm(3)
    x = torch.randn(1, 3, 1, 1)
    y, logdet = layer(x)
    assert torch.equal(layer.log_scale, torch.zeros_like(layer.log_scale)) and float(logdet.abs().max()) == 0
    torch.testing.assert_close(y, torch.zeros_like(y))  # centred by the bias
    wide = ActNorm(3)
    wide(torch.randn(16, 3, 4, 4) * 3)  # a spread is still normalised to unit variance
    assert torch.allclose(wide.log_scale.exp().flatten(), torch.full((3,), 1 / 3), rtol=0.2)

def test_training_lowers_bits_per_dim_and_samples_have_the_data_shape():
    torch.manual_seed(0)
    model = build_flow({"levels": 2, "depth_per_level": 2, "hidden_channels": 8, "memory": "invertible"},
                       (1, 8, 8))
    base = torch.zeros(1, 1, 8, 8, dtype=torch.uint8)
    base[..., 2:6, 3:5] = 200  # a fixed "digit": a learnable, low-entropy distribution
    x = base + torch.randint(0, 8, (32, 1, 8, 8), dtype=torch.uint8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        opt.zero_grad()
        loss, bpd = flow_loss(model, x)
        loss.backward()
        opt.step()
        first = bpd.item() if first is None else first
    assert math.isfinite(bpd.item()) and bpd.item() < first - 1.0
    s = model.sample(5, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert s.shape == (5, 1, 8, 8) and torch.isfinite(s).all()
    mean = model.sample(2, temperature=0.0)  # temperature 0: every draw is the prior mean
    torch.testing.assert_close(mean[0], mean[1])


def test_config_errors_are_sinkflow_errors():
    with pytest.raises(SinkflowError, match="unknown flow config key"):
        build_flow({"depht": 3}, (1, 8, 8))
    with pytest.raises(SinkflowError, match="model.flow.memory. must be one of standard, checkpoint, invertible"):
        build_flow({"memory": "tiny"}, (1, 8, 8))
    with pytest.raises(SinkflowError, match="squeeze"):
        build_flow({"levels": 3}, (1, 4, 4))
    with pytest.raises(SinkflowError, match="model expects"):
        build_flow({"levels": 1, "depth_per_level": 1}, (1, 8, 8)).log_prob(torch.zeros(2, 1, 4, 4))


def test_invconv_factor_cache_follows_parameter_updates():
    """The no-grad cache of W (and its inverse) is dropped when a parameter changes in place (an optimizer
    step, a load): the inverse always matches the current weights."""
    torch.manual_seed(0)
    layer = InvConv1x1(4).double()
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))  # like an optimizer step
        y, _ = layer(x)
        assert torch.allclose(layer.inverse(y), x, atol=1e-12)
        layer.load_state_dict({k: v + 0.01 if k in ("lower", "upper", "log_s") else v
                               for k, v in layer.state_dict().items()})
        y, _ = layer(x)
        assert torch.allclose(layer.inverse(y), x, atol=1e-12)
    y2, _ = layer(x)  # with grad: never cached, same values
    assert torch.allclose(y2, y)


@pytest.mark.parametrize("memory", ["standard", "checkpoint", "invertible"])
def test_a_fused_adam_step_reaches_the_next_pass_in_every_memory_mode(memory):
    """Fused Adam (the Trainer's kernel) writes parameters without moving their version counter. The
    invertible chain's forward runs without grad, where the 1x1 conv caches W: keyed on that counter alone, every
    later step ran on the first step's W (flow-cifar10's straight and resumed losses parted at step 5). Each pass
    now sees the weights the optimizer wrote: the same log-likelihood as a fresh copy of the model."""
    torch.manual_seed(0)
    cfg = {"levels": 1, "depth_per_level": 2, "hidden_channels": 8, "memory": memory}
    model = build_flow(cfg, (1, 8, 8))
    x = torch.rand(4, 1, 8, 8)
    opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    for _ in range(2):  # the first pass fills the caches; the second must not reuse them
        opt.zero_grad()
        (-model.log_prob(x).mean()).backward()
        opt.step()
    fresh = build_flow(cfg, (1, 8, 8))
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():  # the next training pass, an evaluation, a sample: all on the updated weights
        assert torch.allclose(model.log_prob(x), fresh.log_prob(x), rtol=1e-6, atol=1e-5)
        a, b = (m.sample(3, generator=torch.Generator().manual_seed(1)) for m in (model, fresh))
        assert torch.allclose(a, b, atol=1e-5)
    assert (-model.log_prob(x).mean()).item() == pytest.approx((-fresh.log_prob(x).mean()).item(), rel=1e-6)


def test_logit_preprocessing_exact_and_invertible():
    """Logit (RealNVP's preprocessing) round-trips and its log-det is slogdet of its Jacobian; a Glow built
    with logit_alpha includes it in log_prob, and sampling maps back into the pixel cube."""
    from sinkflow.flows.layers import Logit

    layer = Logit(1e-3)
    x = torch.rand(1, 1, 2, 2, dtype=torch.float64) - 0.5
    y, ld = layer(x)
    jac = torch.autograd.functional.jacobian(lambda v: layer(v.view_as(x))[0].flatten(), x.flatten())
    assert float(ld) == pytest.approx(float(torch.linalg.slogdet(jac)[1]), rel=1e-12)
    assert torch.allclose(layer.inverse(y), x, atol=1e-12)
    torch.manual_seed(0)
    model = build_flow({"levels": 2, "depth_per_level": 1, "hidden_channels": 4, "logit_alpha": 1e-3},
                       (1, 4, 4)).double()
    x = torch.rand(3, 1, 4, 4, dtype=torch.float64) - 0.5
    model.log_prob(x)  # ActNorm init
    zs, logdet, _ = model.encode(x)
    jac = torch.autograd.functional.jacobian(
        lambda v: torch.cat([z.flatten() for z in model.encode(v.view(1, 1, 4, 4))[0]]), x[0].flatten())
    assert float(logdet[0]) == pytest.approx(float(torch.linalg.slogdet(jac)[1]), rel=1e-10)
    assert torch.allclose(model.inverse(zs), x, atol=1e-10)
    s = model.sample(8, temperature=0.5)
    assert s.shape == (8, 1, 4, 4) and float(s.min()) >= -0.5 and float(s.max()) <= 0.5
    with pytest.raises(SinkflowError, match="logit_alpha"):
        build_flow({"levels": 1, "logit_alpha": 0.7}, (1, 4, 4))


def test_conditioner_fast_path_is_the_module_and_follows_copies():
    """The constant-memory backward re-runs conditioners through ``functional``: it must be the same function
    as the module, over exactly the module's parameters, also in a deep copy (EMA) and after a load."""
    from sinkflow.flows.coupling import ConditionerNet

    torch.manual_seed(0)
    net = ConditionerNet(3, 6, hidden=8)
    for p in net.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(net.functional(x), net(x))
    assert [id(p) for p in net.param_list] == [id(p) for p in net.parameters()]
    twin = copy.deepcopy(net)
    assert [id(p) for p in twin.param_list] == [id(p) for p in twin.parameters()]
    twin.load_state_dict({k: v + 1 for k, v in net.state_dict().items()})
    torch.testing.assert_close(twin.functional(x), twin(x))
    assert not torch.allclose(twin.functional(x), net.functional(x))


@pytest.mark.parametrize("cfg, needle", [({"levels": "2"}, "'model.flow.levels' expects int"),
                                         ({"depth_per_level": 2.5}, "'model.flow.depth_per_level' expects int"),
                                         ({"hidden_channels": -4}, "'model.flow.hidden_channels' must be >= 1"),
                                         ({"drift_tol": -1, "memory": "invertible"}, "'model.flow.drift_tol' must be > 0")])
def test_build_flow_checks_values_as_the_config_does(cfg, needle):
    """The API's builder took what `sinkflow train` refuses: a TypeError for "2", a RuntimeError for a negative width,
    and a negative drift_tol that made every invertible layer fall back to storing its input, with warnings only."""
    from sinkflow.errors import SinkflowError
    from sinkflow.flows.model import build_flow

    with pytest.raises(SinkflowError, match=needle):
        build_flow(cfg, (1, 8, 8))


@pytest.mark.parametrize("n_bins", [0, 1, 300, 2.5, True])
def test_flow_loss_refuses_a_level_count_outside_2_to_256(n_bins):
    from sinkflow.errors import SinkflowError
    from sinkflow.flows.losses import flow_loss
    from sinkflow.flows.model import build_flow

    with pytest.raises(SinkflowError, match=r"n_bins=.* must be an integer in \[2, 256\]"):  # 0: math domain error
        flow_loss(build_flow({"levels": 1, "depth_per_level": 1, "hidden_channels": 4}, (1, 4, 4)),
                  torch.rand(2, 1, 4, 4), n_bins=n_bins)


def test_a_flow_built_under_a_float64_default_dtype_runs_in_float64():
    """The 1x1 conv's LU factors were float32 whatever the default dtype, its mask the default: a flow built under
    ``torch.set_default_dtype(torch.float64)`` failed its first forward with ``float != double``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = build_flow({"levels": 2, "depth_per_level": 1, "hidden_channels": 4}, (1, 8, 8))
        x = torch.rand(3, 1, 8, 8) - 0.5
        zs, log_prob = model(x)
        back = model.inverse(zs)
    finally:
        torch.set_default_dtype(old)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert log_prob.dtype == torch.float64 and torch.isfinite(log_prob).all()
    assert (back - x).abs().max() < 1e-12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA model with a CPU generator needs CUDA")
def test_a_cuda_flow_samples_with_a_seeded_cpu_generator_as_the_cpu_flow_does():
    """``FlowModel.sample(n, generator=)`` drew its noise on the model's device with the caller's generator: torch
    refuses a CPU generator for CUDA tensors. The noise is drawn on the generator's device and moved."""
    model = build_flow({}, (1, 8, 8)).double()
    model.log_prob(torch.rand(4, 1, 8, 8, dtype=torch.float64) - 0.5)  # ActNorm's data-dependent init
    cpu = model.sample(3, generator=torch.Generator().manual_seed(0))
    cuda = model.cuda().sample(3, generator=torch.Generator().manual_seed(0))
    assert cuda.device.type == "cuda" and torch.allclose(cuda.cpu(), cpu, atol=1e-9)
