"""The fast fitter's float64 twin: batch normalisations folded into the convolutions before them,
convolutions on small pictures run as their dense linear maps.

The folded twin must compute the model's function (checked against the unfolded float64 copy and
against a hand-built conv → BN whose folded weights are known in closed form); models it cannot fold
(untraceable, a BN on batch statistics) keep their own layers; the caller's model is never changed.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nctv.calibration.clamping_fit import EXACT_DTYPE, DenseConv, densify_small_convs, exact_twin, fold_batch_norms


def _conv_bn(track: bool = True) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(1, 3, 3, padding=1, bias=False)
    bn = nn.BatchNorm2d(3, track_running_stats=track)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
        bn.weight.copy_(torch.tensor([2.0, 0.5, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        if track:
            bn.running_mean.copy_(torch.tensor([1.0, -1.0, 0.0]))
            bn.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    return nn.Sequential(conv, bn, nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)).eval()


def _convs(model: nn.Module) -> list[nn.Conv2d]:
    return [m for m in model.modules() if isinstance(m, nn.Conv2d)]


def test_a_conv_and_its_batch_norm_fold_into_the_weights_the_closed_form_gives():
    model = _conv_bn().double()
    conv, bn = model[0], model[1]
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # BN(u) = scale·(u − mean) + β
    folded = fold_batch_norms(model, (1, 5, 5))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    (fconv,) = _convs(folded)
    torch.testing.assert_close(fconv.weight, conv.weight * scale.view(-1, 1, 1, 1), rtol=1e-14, atol=0)
    torch.testing.assert_close(fconv.bias, bn.bias - scale * bn.running_mean, rtol=1e-14, atol=1e-15)
    x = torch.randn(7, 1, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-12, atol=1e-12)


def test_a_batch_norm_on_batch_statistics_is_not_folded():
    """Without running statistics an eval-mode BN normalises by the batch: no fixed weights express it."""
    model = _conv_bn(track=False).double()
    assert fold_batch_norms(model, (1, 5, 5)) is model


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Linear(2 * 3 * 3, 3)

    def forward(self, x):
        h = self.bn(self.conv(x))
        if h.sum() > 0:  # a branch on the data: torch.fx cannot trace it
            h = h * 2
        return self.fc(h.flatten(1))


def test_a_model_fx_cannot_trace_keeps_its_own_layers():
    model = _Untraceable().double().eval()
    assert fold_batch_norms(model, (1, 5, 5)) is model


def test_the_embedded_models_twins_compute_their_float64_function_and_leave_the_model_alone():
    from nctv.zoo import load_model

    for name in ("fmnist-resnet", "fmnist-vit"):
        model = load_model(name).model.eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        twin = exact_twin(model, torch.device("cpu"), (1, 28, 28))
        plain = copy.deepcopy(model).to(EXACT_DTYPE).eval()
        assert all(p.dtype == EXACT_DTYPE and not p.requires_grad for p in twin.parameters())
        if name == "fmnist-resnet":  # conv → BN throughout: every BN folded away; the last stages' pictures are small
            assert any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
            assert not any(isinstance(m, nn.BatchNorm2d) for m in twin.modules())
            assert any(isinstance(m, DenseConv) for m in twin.modules())
        x = torch.rand(16, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(twin(x), plain(x), rtol=1e-12, atol=1e-12)
        for k, v in model.state_dict().items():
            assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
        assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("size", [1, 3])
def test_a_split_can_cap_its_pieces(size):
    from nctv.calibration.clamping_fit import InputStream

    x = torch.arange(10 * 4, dtype=torch.float32).view(10, 1, 2, 2)
    split = InputStream(x, torch.zeros(10, dtype=torch.long), torch.device("cpu"), batch_size=4)
    split.limit_pieces(size)
    sizes = [len(xb) for xb in split.map(lambda xb, _: xb)]
    assert sizes == [size] * (10 // size) + ([10 % size] if 10 % size else [])
    torch.testing.assert_close(torch.cat(list(split.map(lambda xb, _: xb))), x)


def test_theorem1s_start_leaves_nothing_to_the_arithmetics_rounding(monkeypatch):
    """Theorem 1's δ̃ is flat wherever the data's range is, so on the embedded default's 5,000 calibration
    images x + δ̃ leaves max-pooling windows whose largest values tie exactly or to 4e-16, and which of them
    gets the gradient was left to rounding: the folded and the unfolded twin (the same function, rounded
    differently, as another CPU's or a GPU's products are) gave three images gradients 2–14 % apart and
    parted the fits from their second step. With the tie-breaking pattern added to δ̃ they agree to rounding."""
    import nctv.calibration.clamping as clamping
    from nctv.calibration.clamping import NeuralClamping
    from nctv.data import get_splits
    from nctv.zoo import DEFAULT_MODEL, load_model

    loaded = load_model(DEFAULT_MODEL)
    cal, _ = get_splits(loaded, test_size=10)
    x, y = cal.tensors()

    def fit():
        return NeuralClamping(loaded.model, gamma=1.0, init="data", input_range=loaded.input_range, max_passes=3.5,
                              progress=False).fit(x, y)

    folded = fit()
    unfolded_twin = clamping.exact_twin
    monkeypatch.setattr(clamping, "exact_twin", lambda model, device, shape=None: unfolded_twin(model, device))
    plain = fit()
    assert len(folded.history_) == len(plain.history_) >= 2
    for a, b in zip(folded.history_, plain.history_):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12, abs=0)
    assert float(folded.delta_.norm()) > 0.1
    torch.testing.assert_close(folded.delta_, plain.delta_, rtol=0, atol=1e-9 * float(plain.delta_.abs().max()))


def _conv_net(conv: nn.Module, reuse: bool = False) -> nn.Module:
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):
            h = self.conv(x)
            return (self.conv(h) if reuse else h).flatten(1)

    return Net().double().eval()


@pytest.mark.parametrize("kwargs", [
    dict(in_channels=4, out_channels=6, kernel_size=3, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, bias=False),
    dict(in_channels=4, out_channels=8, kernel_size=(3, 2), padding=(1, 0), dilation=(1, 2)),
    dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, groups=2),
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=3),
])
def test_a_small_pictures_convolution_is_its_dense_map_to_rounding(kwargs):
    """On 3×3 pictures a convolution's dense map has fewer multiply-adds than the convolution
    counts (most taps fall on padding): it is replaced and computes what F.conv2d does, forward and
    backward to the input, and an input of another shape still goes through the convolution."""
    g = torch.Generator().manual_seed(3)
    conv = nn.Conv2d(**kwargs).double()
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    reference = copy.deepcopy(conv)
    model = densify_small_convs(_conv_net(conv), (4, 3, 3))
    assert isinstance(model.conv, DenseConv)
    for shape in [(5, 4, 3, 3), (2, 4, 6, 5)]:
        x = torch.randn(shape, dtype=torch.float64, generator=g).contiguous(memory_format=torch.channels_last)
        x.requires_grad_(True)
        want = reference(x)
        (grad_want,) = torch.autograd.grad(want.square().sum(), x)
        got = model.conv(x)
        (grad_got,) = torch.autograd.grad(got.square().sum(), x)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(grad_got, grad_want, rtol=1e-13, atol=1e-13)


def test_only_convolutions_a_dense_map_serves_are_replaced():
    """A large picture's map would cost many times the convolution; a convolution called twice (two
    shapes), or with padding other than zeros, keeps its layer."""
    large = _conv_net(nn.Conv2d(2, 2, 3, padding=1))
    assert isinstance(densify_small_convs(large, (2, 16, 16)).conv, nn.Conv2d)
    shared = _conv_net(nn.Conv2d(2, 2, 3, padding=1), reuse=True)
    assert isinstance(densify_small_convs(shared, (2, 3, 3)).conv, nn.Conv2d)
    circular = _conv_net(nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"))
    assert isinstance(densify_small_convs(circular, (2, 3, 3)).conv, nn.Conv2d)
