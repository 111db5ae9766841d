"""Networks: shapes at every data shape, time broadcasting, gradients to every parameter, the paper's
parameter counts (and equality with torchcfm's UNet), odd image sizes, channels_last and bf16 autocast."""

import pytest
import torch
import torch.nn.functional as F

from sinkflow.errors import SinkflowError
from sinkflow.models import (
    UNET_PRESETS,
    attention_downsample,
    build_model,
    count_parameters,
    model_memory_bytes,
    saved_activation_bytes,
)

SHAPES = [(2,), (1, 8, 8), (1, 28, 28), (3, 32, 32), (3, 20, 20)]
IMAGE_SHAPES = [s for s in SHAPES if len(s) == 3]
SMALL_UNET = {"channels": 32, "res_blocks": 1, "channel_mult": [1, 2, 2], "num_heads": 2, "attention_resolutions": [16]}


def perturb(model, scale=0.05, seed=0):
    """Give the zero-initialised convs (ADM's output/resblock/attention projections) non-zero weights,
    so outputs depend on every parameter and gradients reach all of them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def velocity_cases():
    for s in SHAPES:
        yield "mlp", {}, s
        if len(s) == 3:
            yield "unet", UNET_PRESETS["mnist"], s


@pytest.mark.parametrize("kind,cfg,shape", list(velocity_cases()))
def test_velocity_shape_dtype_and_time_broadcast(kind, cfg, shape):
    torch.manual_seed(0)
    model = perturb(build_model(kind, cfg, shape)).eval()
    x = torch.randn(3, *shape)
    with torch.no_grad():
        out = model(x, torch.full((3,), 0.3))
        assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
        for t in (0.3, torch.tensor(0.3), torch.full((3, 1), 0.3)):
            torch.testing.assert_close(model(x, t), out)
        # the time input matters, per sample
        mixed = model(x, torch.tensor([0.3, 0.9, 0.3]))
        torch.testing.assert_close(mixed[[0, 2]], out[[0, 2]])
        assert not torch.allclose(mixed[1], out[1])
    with pytest.raises(ValueError, match="one time per sample"):
        model(x, torch.rand(2))


@pytest.mark.parametrize("shape", SHAPES)
def test_time_predictor_in_unit_interval(shape):
    torch.manual_seed(0)
    model = build_model("time_predictor", {}, shape)
    for scale in (1.0, 1e3):
        out = model(scale * torch.randn(5, *shape))
        assert out.shape == (5,) and torch.isfinite(out).all()
        assert (out >= 0).all() and (out <= 1).all()


def test_time_predictor_architecture():
    m = build_model("time_predictor", {}, (3, 32, 32))
    convs = [l for l in m.features if isinstance(l, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [32, 64, 128, 256]
    assert all(c.kernel_size == (3, 3) and c.stride == (1, 1) and c.padding == (1, 1) for c in convs)
    assert m.head.in_features == 256 * 2 * 2 and count_parameters(m) == 389_441  # nsgf_paper.md: ~0.39M
    # ceil-mode pooling: 8x8 pools to 1x1 instead of 0x0, odd sizes keep their border
    assert build_model("time_predictor", {}, (1, 8, 8)).head.in_features == 256
    assert build_model("time_predictor", {}, (1, 17, 17)).head.in_features == 256 * 2 * 2
    with pytest.raises(ValueError, match="built for"):
        m(torch.randn(2, 3, 28, 28))


def grad_cases():
    yield "mlp", {"activation": "silu", "time_freqs": 4}, (2,)
    yield "mlp", {"time_bins": 5}, (2,)
    yield "mlp", {}, (1, 8, 8)
    yield "unet", SMALL_UNET, (1, 8, 8)
    yield "unet", {**SMALL_UNET, "use_scale_shift_norm": True, "num_head_channels": 32}, (3, 20, 20)
    yield "unet", UNET_PRESETS["mnist"], (1, 28, 28)
    yield "time_predictor", {}, (2,)
    yield "time_predictor", {}, (1, 17, 17)


@pytest.mark.parametrize("kind,cfg,shape", list(grad_cases()))
def test_every_parameter_gets_a_gradient(kind, cfg, shape):
    """No unused parameters (DDP would need find_unused_parameters) and none cut off from the loss."""
    torch.manual_seed(0)
    model = perturb(build_model(kind, cfg, shape))
    x = torch.randn(4, *shape)
    out = model(x) if kind == "time_predictor" else model(x, torch.rand(4))
    out.square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.abs().sum() > 0, f"{name} got an all-zero gradient"


def test_unet_is_zero_at_init_like_adm():
    model = build_model("unet", SMALL_UNET, (1, 8, 8))
    assert model(torch.randn(2, 1, 8, 8), 0.5).abs().max() == 0


@pytest.mark.parametrize("size", [(5, 5), (17, 17), (30, 30), (13, 21), (64, 64)])
def test_unet_any_image_size(size):
    cfg = {**SMALL_UNET, "channel_mult": [1, 2, 2, 2]}  # pads to a multiple of 8
    model = perturb(build_model("unet", cfg, (1, *size))).eval()
    x = torch.randn(2, 1, *size)
    with torch.no_grad():
        out = model(x, torch.rand(2))
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_unet_pad_and_crop_are_centred():
    """A 17x17 input equals the same net on the reflect-padded 24x24 image, cropped back."""
    model = perturb(build_model("unet", {**SMALL_UNET, "channel_mult": [1, 2, 2, 2]}, (1, 17, 17))).eval()
    x, t = torch.randn(2, 1, 17, 17), torch.rand(2)
    with torch.no_grad():
        out = model(x, t)
        padded = model(F.pad(x, (3, 4, 3, 4), mode="reflect"), t)
    torch.testing.assert_close(out, padded[:, :, 3:20, 3:20])
    zeros = perturb(build_model("unet", {**SMALL_UNET, "pad_mode": "zeros"}, (1, 6, 6))).eval()
    with torch.no_grad():
        x6 = torch.randn(2, 1, 6, 6)
        torch.testing.assert_close(zeros(x6, t), zeros(F.pad(x6, (1, 1, 1, 1)), t)[:, :, 1:7, 1:7])


def test_attention_resolution_follows_torchcfm_wrapper():
    assert attention_downsample([16], 28) == (1,)  # attention at the full 28x28 level
    assert attention_downsample([16], 32) == (2,)  # ... at the 16x16 level
    assert attention_downsample([16], 8) == ()  # only the middle block
    assert attention_downsample("16,8", 32) == (2, 4)
    model = build_model("unet", UNET_PRESETS["mnist"], (1, 28, 28))
    assert model.attention_ds == (1,)
    n_attn = sum(type(m).__name__ == "AttentionBlock" for m in model.modules())
    assert n_attn == 1 + 1 + 2  # middle + 1 encoder + 2 decoder blocks at ds 1


def test_paper_unet_parameter_counts():
    """Measured with torchcfm 1.0.7's UNetModelWrapper: 1,075,361 (MNIST 28x28), 35,746,307 (CIFAR 32x32). The default
    (use_scale_shift_norm auto) is that network where its GroupNorm keeps the added time embedding: CIFAR's exactly;
    MNIST's three 32-channel blocks (one channel per group, which cancelled t) take it by FiLM, whose embedding
    projection is twice as wide: + 3 x (128 x 32 + 32) parameters."""
    mnist = build_model("unet", UNET_PRESETS["mnist"], (1, 28, 28))
    assert count_parameters(build_model("unet", {**UNET_PRESETS["mnist"], "use_scale_shift_norm": False},
                                        (1, 28, 28))) == 1_075_361
    assert sum(b.use_scale_shift_norm for b in mnist.modules() if hasattr(b, "emb_layers")) == 3
    assert count_parameters(mnist) == 1_075_361 + 3 * (128 * 32 + 32)
    assert count_parameters(build_model("unet", UNET_PRESETS["cifar10"], (3, 32, 32))) == 35_746_307
    # the paper's MLP: 3 hidden layers of 256 on (x, t)
    assert count_parameters(build_model("mlp", {}, (2,))) == 3 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 2 + 2


@pytest.mark.parametrize("preset,shape", [("mnist", (1, 28, 28)), ("cifar10", (3, 32, 32))])
def test_unet_matches_torchcfm(preset, shape):
    """Same parameter names and count as torchcfm's UNetModelWrapper; its weights give the same outputs."""
    unet_mod = pytest.importorskip("torchcfm.models.unet.unet")
    cfg = UNET_PRESETS[preset]
    torch.manual_seed(0)
    ref = unet_mod.UNetModelWrapper(
        dim=shape, num_channels=cfg["channels"], num_res_blocks=cfg["res_blocks"], channel_mult=cfg["channel_mult"],
        num_heads=cfg["num_heads"], num_head_channels=cfg["num_head_channels"],
        attention_resolutions=",".join(map(str, cfg["attention_resolutions"])), dropout=cfg["dropout"],
    )
    perturb(ref, scale=0.02)
    ours = build_model("unet", {**cfg, "use_scale_shift_norm": False}, shape)  # t added at every width, as ADM
    assert count_parameters(ours) == count_parameters(ref)
    ours.load_state_dict(ref.state_dict())  # strict: identical names and shapes
    x, t = torch.randn(2, *shape), torch.rand(2)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, t), ref(t, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 20, 20)])
def test_unet_channels_last_and_bf16_autocast(shape):
    torch.manual_seed(0)
    model = perturb(build_model("unet", UNET_PRESETS["mnist"], shape), scale=0.02).eval()
    x, t = torch.randn(2, *shape), torch.rand(2)
    with torch.no_grad():
        ref = model(x, t)
        model.to(memory_format=torch.channels_last)
        cl = model(x, t)
        if shape[-1] % 4 == 0:  # uncropped output comes straight from a channels_last conv
            assert cl.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(cl, ref, atol=1e-4, rtol=1e-4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf = model(x, t)
    assert bf.shape == x.shape and torch.isfinite(bf).all()
    rel = (bf.float() - ref).norm() / ref.norm()
    assert rel < 0.05, f"bf16 autocast is {rel:.3f} away from fp32"


def test_time_predictor_channels_last_and_bf16():
    model = build_model("time_predictor", {}, (3, 32, 32)).to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 32, 32)
    ref = build_model("time_predictor", {}, (3, 32, 32))
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert ((out >= 0) & (out <= 1)).all() and (out.float() - ref(x)).abs().max() < 0.02


def test_build_model_config_errors():
    with pytest.raises(SinkflowError, match="unknown model kind 'unte'.*'unet'"):
        build_model("unte", {}, (1, 8, 8))
    with pytest.raises(SinkflowError, match="unknown model key 'chanels'.*'channels'"):
        build_model("unet", {"chanels": 32}, (1, 8, 8))
    with pytest.raises(SinkflowError, match="needs image samples"):
        build_model("unet", {}, (2,))
    with pytest.raises(SinkflowError, match="num_head_channels"):
        build_model("unet", {"channels": 32, "num_head_channels": 24}, (1, 8, 8))
    with pytest.raises(SinkflowError, match="activation"):
        build_model("mlp", {"activation": "tanhh"}, (2,))
    # the config's velocity subsection carries keys of every kind: the ones of other kinds are ignored
    m = build_model("unet", {"kind": "unet", "hidden": 256, "depth": 3, **SMALL_UNET}, (1, 8, 8))
    assert m.model_channels == 32


def test_memory_accounting():
    model = build_model("mlp", {}, (2,))
    n = count_parameters(model)
    assert model_memory_bytes(model) == 16 * n  # fp32 params + grads + two Adam moments
    assert model_memory_bytes(model, ema=True) == 20 * n
    model.net[0].requires_grad_(False)
    frozen = sum(p.numel() for p in model.net[0].parameters())
    assert count_parameters(model, trainable_only=True) == n - frozen
    assert model_memory_bytes(model) == 16 * (n - frozen) + 4 * frozen


def test_saved_activation_bytes_is_affine_and_counts_real_tensors():
    model = build_model("mlp", {"hidden": 64, "depth": 2, "activation": "relu"}, (2,))
    # per sample autograd keeps the (x, t) input (3 floats) and the two ReLU outputs (64 each): relu
    # saves its result and the next linear saves that same tensor as its input (counted once)
    per = saved_activation_bytes(model, (2,), 1001) - saved_activation_bytes(model, (2,), 1000)
    assert per == 4 * (3 + 64 + 64)
    unet = build_model("unet", SMALL_UNET, (1, 8, 8))
    small, big = (saved_activation_bytes(unet, (1, 8, 8), b) for b in (4, 8))
    assert big > small > 0 and (big - small) * 2 == saved_activation_bytes(unet, (1, 8, 8), 12) - small


def test_a_new_kind_is_its_file_plus_its_schema_keys(monkeypatch):
    """build_model finds a kind's ``build`` in ``sinkflow/models/<kind>.py`` and hands it the section with the
    kind's schema defaults filled in: nothing else names the kinds."""
    import sys
    import types

    from sinkflow.config import schema
    from sinkflow.models import build_model

    seen = {}
    module = types.ModuleType("sinkflow.models.toykind")
    module.build = lambda c, shape: seen.update(c=c, shape=shape) or torch.nn.Linear(shape[0], 1)
    monkeypatch.setitem(sys.modules, "sinkflow.models.toykind", module)
    monkeypatch.setitem(schema.MODEL_KINDS, "toykind", {"hidden": schema.Key(7, schema.POS_INT, "units")})
    net = build_model("toykind", {}, (3,))
    assert isinstance(net, torch.nn.Linear) and seen == {"c": {"hidden": 7}, "shape": (3,)}
    with pytest.raises(SinkflowError, match="unknown model kind 'toykinds'"):
        build_model("toykinds", {}, (3,))


@pytest.mark.parametrize("channels, mult, adm_groups", [(16, [1, 2], {16, 32}), (8, [1, 2, 2], {8, 16, 32}),
                                                        (32, [1, 2, 2], {32})])
def test_a_narrow_unet_depends_on_time(channels, mult, adm_groups):
    """ADM's GroupNorm(32) normalises each channel alone at widths <= 32: it subtracts each channel's own mean,
    so the additive time embedding added just before it is cancelled exactly. The `digits` UNet (16-32 channels)
    and the CPU MNIST benchmark's (8-16) did not depend on t at all (|v(t=.1) - v(t=.9)| ~ 1e-7 of 0.4); the
    mnist preset's lost t at its 32-channel level. The default (use_scale_shift_norm auto) keeps ADM's groups and
    takes t by FiLM, after the norm, in exactly those blocks; groups of >= 2 channels (norm_min_channels: 2, the
    2026-11-27 default, which its run folders keep) keep an added t too."""
    cfg = {"channels": channels, "res_blocks": 1, "channel_mult": mult, "attention_resolutions": []}
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))

    def t_effect(model):
        perturb(model, scale=0.1)
        with torch.no_grad():
            return (model(x, torch.full((4,), 0.1)) - model(x, torch.full((4,), 0.9))).abs().max().item()

    adm = build_model("unet", {**cfg, "use_scale_shift_norm": False}, (1, 8, 8))
    assert {m.num_groups for m in adm.modules() if isinstance(m, torch.nn.GroupNorm)} == adm_groups
    new = build_model("unet", cfg, (1, 8, 8))
    assert {m.num_groups for m in new.modules() if isinstance(m, torch.nn.GroupNorm)} == adm_groups
    film = {b.out_channels for b in new.modules() if hasattr(b, "emb_layers") and b.use_scale_shift_norm}
    assert film == {c for c in (channels * m for m in mult) if c <= 32}  # where a group holds one channel
    pairs = build_model("unet", {**cfg, "use_scale_shift_norm": False, "norm_min_channels": 2}, (1, 8, 8))
    norms = [m for m in pairs.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert all(m.num_channels // m.num_groups >= 2 and m.num_groups <= 32 for m in norms)
    assert count_parameters(pairs) == count_parameters(adm)  # a GroupNorm's parameters are per channel
    if channels < 32:  # every level normalised channel by channel: no trace of t
        assert t_effect(adm) < 1e-5
    assert t_effect(new) > 1e-3 and t_effect(pairs) > 1e-3


def test_wide_unets_keep_adm_groups():
    """From 64 channels a group of ADM's 32 holds >= 2 channels: nothing changes (the cifar10 UNet)."""
    model = build_model("unet", UNET_PRESETS["cifar10"], (3, 32, 32))
    assert {m.num_groups for m in model.modules() if isinstance(m, torch.nn.GroupNorm)} == {32}


@pytest.mark.parametrize("args, needle", [
    (("mlp", {"hidden": 0}, (2,)), r"'model.hidden' must be >= 1 \(got 0\)"),  # a network that always output 0
    (("unet", {"channels": 0}, (1, 8, 8)), r"'model.channels' must be >= 1"),  # a conv error at the first forward
    (("mlp", {"hidden": 2.5}, (2,)), r"'model.hidden' expects int"),
    (("mlp", {}, 2), r"sample_shape=2 is not a shape")])  # 'int' object is not iterable
def test_build_model_checks_each_value_against_its_key(args, needle):
    from sinkflow.errors import SinkflowError
    from sinkflow.models import build_model

    with pytest.raises(SinkflowError, match=needle):
        build_model(*args)
