"""ADM UNet (Dhariwal & Nichol 2021), the velocity network of NSGF++ / FM / OT-CFM on images.

Same structure and parameter names as guided-diffusion's ``UNetModel`` as wrapped by torchcfm's
``UNetModelWrapper`` (so a torchcfm state_dict loads into it and gives the same outputs), with three
changes that do not alter the maths:

* any image size: the input is padded up to a multiple of ``2**(len(channel_mult)-1)`` and the output
  cropped back, so 8x8, 17x17 or 20x20 images work (torchcfm only accepts 28/32/64/...);
* attention uses ``F.scaled_dot_product_attention`` on (N, HW, C) tokens (the legacy head order of
  ``QKVAttentionLegacy``), which is faster and keeps channels_last tensors channels_last;
* a first conv stored channels_last makes the whole forward run channels_last (issue 6 speed path),
  and GroupNorm runs in bf16 under autocast (float32 statistics inside the kernel).
"""

from __future__ import annotations

import math
from math import gcd

import torch
import torch.nn as nn
import torch.nn.functional as F

from sinkflow.errors import SinkflowError


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of (possibly fractional) times, exactly as guided-diffusion/torchcfm."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def as_batch_times(t, n: int, device: torch.device) -> torch.Tensor:
    """Accept a float, a 0-d tensor, (N,) or (N, 1) times and return (N,) float32 on ``device``."""
    t = torch.as_tensor(t, device=device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(n)
    if t.numel() != n:
        raise ValueError(f"t has {t.numel()} entries for a batch of {n}; pass one time per sample or a scalar")
    return t.float()


class GroupNorm32(nn.GroupNorm):
    """ADM's GroupNorm32, run in the input's dtype: the CPU/CUDA kernels accumulate the statistics in
    float32 anyway, and skipping the fp32 round trip (and autocast's fp32 output) made a bf16 CIFAR
    UNet training step ~10% faster on an H100 (docs/models.md). float32 inputs are unchanged."""

    def forward(self, x):
        if x.dtype == torch.float32:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.group_norm(x, self.num_groups, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def norm_groups(channels: int, min_channels: int = 1) -> int:
    """ADM's 32 groups, fewer where a group would hold fewer than ``min_channels`` channels (and a divisor of
    ``channels``). A group of one channel is an instance norm: it subtracts each channel's own mean, so a per-channel
    constant added just before it (the additive time embedding, a conv bias) is cancelled exactly. ADM's rule at
    32 channels or fewer: at 8-32 channels a UNet with additive conditioning did not depend on t at all."""
    groups = gcd(32, channels)
    while groups > 1 and channels // groups < min_channels:
        groups //= 2
    return groups


def normalization(channels: int, min_channels: int = 1) -> GroupNorm32:
    return GroupNorm32(norm_groups(channels, min_channels), channels)


def scale_shift_at(channels: int, use_scale_shift_norm: bool | str, min_channels: int = 1) -> bool:
    """Does a residual block of ``channels`` output channels take t by FiLM (scale and shift after its norm)?
    ``"auto"``: where that norm has one channel per group, which would cancel an added embedding; additive where it
    survives (ADM's and torchcfm's blocks at 64+ channels, unchanged). Measured on the CPU MNIST benchmark's
    8-16-channel UNet: one-channel groups with FiLM beat groups of two with an added embedding for NSGF++, OT-CFM
    and FM (benchmarks/RESULTS.md, 2026-11-28)."""
    if use_scale_shift_norm == "auto":
        return channels // norm_groups(channels, min_channels) == 1
    return bool(use_scale_shift_norm)


def zero_module(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.detach().zero_()
    return module


class TimestepBlock(nn.Module):
    """A module whose forward also takes the time embedding."""


class TimestepEmbedSequential(nn.Sequential, TimestepBlock):
    def forward(self, x, emb):
        for layer in self:
            x = layer(x, emb) if isinstance(layer, TimestepBlock) else layer(x)
        return x


class Upsample(nn.Module):
    def __init__(self, channels: int, out_channels: int | None = None):
        super().__init__()
        self.conv = nn.Conv2d(channels, out_channels or channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, channels: int, out_channels: int | None = None):
        super().__init__()
        self.op = nn.Conv2d(channels, out_channels or channels, 3, stride=2, padding=1)

    def forward(self, x):
        return self.op(x)


class ResBlock(TimestepBlock):
    """GroupNorm-SiLU-conv, time conditioning (additive, or FiLM scale-shift), GroupNorm-SiLU-dropout-zero conv."""

    def __init__(self, channels, emb_channels, dropout, out_channels=None, use_scale_shift_norm=False, norm=normalization):
        super().__init__()
        self.out_channels = out_channels or channels
        self.use_scale_shift_norm = use_scale_shift_norm
        self.in_layers = nn.Sequential(
            norm(channels), nn.SiLU(), nn.Conv2d(channels, self.out_channels, 3, padding=1)
        )
        self.emb_layers = nn.Sequential(
            nn.SiLU(), nn.Linear(emb_channels, 2 * self.out_channels if use_scale_shift_norm else self.out_channels)
        )
        self.out_layers = nn.Sequential(
            norm(self.out_channels),
            nn.SiLU(),
            nn.Dropout(p=dropout),
            zero_module(nn.Conv2d(self.out_channels, self.out_channels, 3, padding=1)),
        )
        if self.out_channels == channels:
            self.skip_connection = nn.Identity()
        else:
            self.skip_connection = nn.Conv2d(channels, self.out_channels, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        emb_out = self.emb_layers(emb).type(h.dtype)[:, :, None, None]
        if self.use_scale_shift_norm:
            scale, shift = emb_out.chunk(2, dim=1)
            h = self.out_layers[0](h) * (1 + scale) + shift
            h = self.out_layers[1:](h)
        else:
            h = self.out_layers(h + emb_out)
        return self.skip_connection(x) + h


class AttentionBlock(nn.Module):
    """Self-attention over spatial positions (guided-diffusion's AttentionBlock, legacy head order).

    ``qkv`` and ``proj_out`` keep guided-diffusion's Conv1d(k=1) parameters so checkpoints are
    interchangeable; they are applied as linear maps on (N, HW, C) tokens.
    """

    def __init__(self, channels: int, num_heads: int = 1, num_head_channels: int = -1, norm=normalization):
        super().__init__()
        if num_head_channels == -1:
            self.num_heads = num_heads
        else:
            self.num_heads = channels // num_head_channels
        self.norm = norm(channels)
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.proj_out = zero_module(nn.Conv1d(channels, channels, 1))

    def forward(self, x):
        b, c, hgt, wid = x.shape
        heads, ch = self.num_heads, c // self.num_heads
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # (N, T, C); contiguous when x is channels_last
        qkv = F.linear(tokens, self.qkv.weight[:, :, 0], self.qkv.bias)  # (N, T, 3C), channel = (head, qkv, ch)
        q, k, v = qkv.view(b, -1, heads, 3, ch).permute(3, 0, 2, 1, 4).unbind(0)  # each (N, heads, T, ch)
        a = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(ch)) v, as the legacy einsum
        a = a.transpose(1, 2).reshape(b, -1, c)  # (N, T, heads*ch)
        h = F.linear(a, self.proj_out.weight[:, :, 0], self.proj_out.bias)
        h = h.transpose(1, 2).reshape(b, c, hgt, wid)
        return x + h


class UNet(nn.Module):
    """ADM UNet velocity field v(x, t) for images (N, C, H, W) of any H, W.

    ``attention_ds`` lists the downsample factors (1 = full resolution, 2 = half, ...) at which the
    encoder/decoder levels get an attention block; the middle block always has one.
    """

    def __init__(
        self,
        in_channels: int,
        model_channels: int,
        num_res_blocks: int,
        attention_ds: tuple[int, ...],
        dropout: float = 0.0,
        channel_mult: tuple[float, ...] = (1, 2, 2, 2),
        num_heads: int = 1,
        num_head_channels: int = -1,
        use_scale_shift_norm: bool | str = False,
        pad_mode: str = "reflect",
        norm_min_channels: int = 1,
    ):
        super().__init__()
        self.in_channels = in_channels
        self.model_channels = model_channels
        self.attention_ds = tuple(attention_ds)
        self.pad_multiple = 2 ** (len(channel_mult) - 1)
        self.pad_mode = pad_mode
        time_embed_dim = model_channels * 4
        self.time_embed = nn.Sequential(
            nn.Linear(model_channels, time_embed_dim), nn.SiLU(), nn.Linear(time_embed_dim, time_embed_dim)
        )

        def norm(c):
            return normalization(c, norm_min_channels)

        def res(cin, cout):
            return ResBlock(cin, time_embed_dim, dropout, cout, scale_shift_at(cout, use_scale_shift_norm,
                                                                                norm_min_channels), norm)

        def attn(c):
            return AttentionBlock(c, num_heads, num_head_channels, norm)

        ch = input_ch = int(channel_mult[0] * model_channels)
        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(nn.Conv2d(in_channels, ch, 3, padding=1))])
        chans, ds = [ch], 1
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers = [res(ch, int(mult * model_channels))]
                ch = int(mult * model_channels)
                if ds in self.attention_ds:
                    layers.append(attn(ch))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                chans.append(ch)
            if level != len(channel_mult) - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch)))
                chans.append(ch)
                ds *= 2
        self.middle_block = TimestepEmbedSequential(res(ch, ch), attn(ch), res(ch, ch))
        self.output_blocks = nn.ModuleList()
        for level, mult in list(enumerate(channel_mult))[::-1]:
            for i in range(num_res_blocks + 1):
                layers = [res(ch + chans.pop(), int(model_channels * mult))]
                ch = int(model_channels * mult)
                if ds in self.attention_ds:
                    layers.append(attn(ch))
                if level and i == num_res_blocks:
                    layers.append(Upsample(ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))
        self.out = nn.Sequential(norm(ch), nn.SiLU(), zero_module(nn.Conv2d(input_ch, in_channels, 3, padding=1)))

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        n, _, hgt, wid = x.shape
        emb = self.time_embed(timestep_embedding(as_batch_times(t, n, x.device), self.model_channels))
        m = self.pad_multiple
        ph, pw = (-hgt) % m, (-wid) % m
        h = x
        if ph or pw:
            # Split the padding so the image stays centred; reflect needs pad < size, else zeros.
            pad = (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)
            mode = self.pad_mode if self.pad_mode == "zeros" or max(ph, pw) < min(hgt, wid) else "zeros"
            h = F.pad(h, pad, mode="constant" if mode == "zeros" else mode)
        if self.input_blocks[0][0].weight.is_contiguous(memory_format=torch.channels_last):
            h = h.contiguous(memory_format=torch.channels_last)
        hs = []
        for module in self.input_blocks:
            h = module(h, emb)
            hs.append(h)
        h = self.middle_block(h, emb)
        for module in self.output_blocks:
            h = module(torch.cat([h, hs.pop()], dim=1), emb)
        h = self.out(h)
        if ph or pw:
            h = h[:, :, ph // 2 : ph // 2 + hgt, pw // 2 : pw // 2 + wid]
        return h


def attention_downsample(attention_resolutions, image_size: int) -> tuple[int, ...]:
    """torchcfm's UNetModelWrapper rule: resolution r means downsample factor ``image_size // r``.

    So "16" puts attention at the full-resolution level of a 28x28 image (28 // 16 = 1), at the 16x16
    level of a 32x32 image (ds 2), and nowhere but the middle block of an 8x8 image (8 // 16 = 0).
    """
    if isinstance(attention_resolutions, str):
        attention_resolutions = [r for r in attention_resolutions.split(",") if r.strip()]
    if isinstance(attention_resolutions, int):
        attention_resolutions = [attention_resolutions]
    ds = []
    for r in attention_resolutions:
        if int(r) <= 0:
            raise SinkflowError(f"attention resolution {r} must be a positive int", "e.g. model.attention_resolutions=[16]")
        if image_size // int(r) > 0:
            ds.append(image_size // int(r))
    return tuple(sorted(set(ds)))


def build(c: dict, sample_shape: tuple[int, ...]) -> UNet:
    """The UNet for ``model.<phase>`` keys ``c`` (defaults filled in) and images shaped ``sample_shape``."""
    if len(sample_shape) != 3:
        raise SinkflowError(f"the unet needs image samples (C, H, W), got shape {tuple(sample_shape)}",
                            "set model.kind=mlp for flat data")  # run_folder.build_phase_model names the phase
    mult = [float(m) if float(m) != int(m) else int(m) for m in c["channel_mult"]]
    if not mult:
        raise SinkflowError("model.channel_mult is empty", "give one multiplier per level, e.g. [1, 2, 2]")
    widths = sorted({int(m * c["channels"]) for m in mult})
    if c["num_head_channels"] != -1:
        bad = [w for w in widths if w % c["num_head_channels"]]
        if bad:
            raise SinkflowError(f"UNet widths {bad} are not divisible by num_head_channels={c['num_head_channels']}",
                                "change model.num_head_channels or model.channels")
    elif any(w % c["num_heads"] for w in widths):
        raise SinkflowError(f"UNet widths {widths} are not divisible by num_heads={c['num_heads']}",
                            "change model.num_heads or model.channels")
    if c["pad_mode"] not in ("reflect", "replicate", "zeros"):
        raise SinkflowError(f"unknown model.pad_mode '{c['pad_mode']}'", "use reflect, replicate or zeros")
    _, hgt, wid = sample_shape
    return UNet(
        in_channels=sample_shape[0], model_channels=int(c["channels"]), num_res_blocks=int(c["res_blocks"]),
        attention_ds=attention_downsample(c["attention_resolutions"], max(hgt, wid)), dropout=float(c["dropout"]),
        channel_mult=tuple(mult), num_heads=int(c["num_heads"]), num_head_channels=int(c["num_head_channels"]),
        use_scale_shift_norm=c["use_scale_shift_norm"], pad_mode=c["pad_mode"],
        norm_min_channels=int(c["norm_min_channels"]),
    )
