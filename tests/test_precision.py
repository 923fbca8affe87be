"""Mixed precision: the choice rule on measured numbers, the model call under autocast, and a
Neural Clamping fit whose model passes run in the scope's precision."""
import math

import pytest
import torch
import torch.nn as nn

from nctv import precision as P
from nctv.calibration.clamping import NeuralClamping

pytestmark = pytest.mark.usefixtures("one_thread")


def _agree(top1=1.0, confidence=0.0):
    return {"top1": top1, "confidence": confidence}


CANDIDATES = {"fp32": P.FP32, "bf16": P.Precision("bf16"), "bf16+channels_last": P.Precision("bf16", True)}


def test_pick_keeps_the_fastest_setting_that_agrees():
    seconds = {"fp32": 1.0, "bf16": 0.5, "bf16+channels_last": 0.4}
    agree = {"fp32": _agree(), "bf16": _agree(), "bf16+channels_last": _agree(confidence=1e-4)}
    choice = P.pick(seconds, agree, CANDIDATES)
    assert choice.precision == P.Precision("bf16", True) and "2.50× faster" in choice.reason


def test_pick_refuses_a_faster_setting_that_changes_the_confidences():
    seconds = {"fp32": 1.0, "bf16": 0.5, "bf16+channels_last": 0.4}
    # Half a point of confidence on average: ECE could move by that much, ten times the tolerance.
    agree = {"fp32": _agree(), "bf16": _agree(confidence=5e-3), "bf16+channels_last": _agree(top1=0.99)}
    choice = P.pick(seconds, agree, CANDIDATES)
    assert choice.precision == P.FP32 and "agreed" in choice.reason


def test_pick_needs_a_real_speed_up():
    seconds = {"fp32": 1.0, "bf16": 0.95, "bf16+channels_last": 1.2}
    agree = {k: _agree() for k in seconds}
    choice = P.pick(seconds, agree, CANDIDATES)
    assert choice.precision == P.FP32 and "faster" in choice.reason


def test_agreement_counts_top1_and_confidence_changes():
    ref = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 0.0]])
    other = torch.tensor([[2.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, 0.0]])
    a = P.agreement(ref, other)
    assert a["top1"] == 0.75  # the second row's class flips; the tie in the fourth stays class 0
    assert a["confidence"] == pytest.approx(0.0)  # softmax([1, 0]) and softmax([0, 1]) share their top value


def test_choose_settings():
    model = nn.Linear(3, 2)

    def sample():
        raise AssertionError("nothing is measured on the CPU")

    assert P.choose("fp32", model, "cpu", sample).precision == P.FP32
    assert P.choose("bf16", model, "cpu", sample).precision == P.Precision("bf16")
    cpu = P.choose("auto", model, "cpu", sample)
    assert cpu.precision == P.FP32 and "CUDA" in cpu.reason and not cpu.seconds
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16, fp16"):
        P.choose("half", model, "cpu", sample)


def _net(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(4 * 36, 5))
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()


def test_run_model_autocasts_the_forward_call_only():
    net = _net()
    x = torch.randn(8, 1, 6, 6, requires_grad=True)
    z32 = P.run_model(net, x)
    with P.use(P.Precision("bf16", channels_last=True)):
        z16 = P.run_model(net, x)
        assert P.current().label == "bf16+channels_last"
    assert P.current() == P.FP32
    assert z16.dtype == torch.float32  # the callers' sums never see bfloat16
    assert not torch.equal(z16, z32) and torch.allclose(z16, z32, rtol=0.05, atol=0.05)
    (g,) = torch.autograd.grad(z16.sum(), x)  # the backward pass works through autocast
    (g32,) = torch.autograd.grad(z32.sum(), x)
    assert g.dtype == torch.float32 and torch.allclose(g, g32, rtol=0.05, atol=0.05)


def test_measure_times_every_candidate_and_leaves_the_weights_alone():
    net = _net().train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    choice = P.measure(net, torch.randn(16, 1, 6, 6))
    assert net.training  # its mode comes back
    assert set(choice.seconds) == {"fp32", "bf16", "fp32+channels_last", "bf16+channels_last"}
    assert all(s > 0 and math.isfinite(s) for s in choice.seconds.values())
    assert choice.agreement["fp32"] == {"top1": 1.0, "confidence": 0.0}
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    conv = net[2].weight  # 4 input channels: the two layouts differ
    assert conv.is_contiguous() and not conv.is_contiguous(memory_format=torch.channels_last)
    with P.running(net, P.Precision("bf16", True)):
        assert P.current().label == "bf16+channels_last"
        assert net[2].weight.is_contiguous(memory_format=torch.channels_last)
    assert P.current() == P.FP32 and net[2].weight.is_contiguous()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


class _Autocast(nn.Module):
    """The same model wrapped by hand: what the precision scope must amount to."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.net(x).float()


def test_neural_clamping_runs_its_model_passes_in_the_scope_precision():
    torch.manual_seed(1)
    net = _net(1)
    x = torch.randn(300, 1, 6, 6)
    with torch.no_grad():
        y = (net(x) * 3 + 0.8 * torch.randn(300, 5)).argmax(1)
    settings = {"seed": 0, "max_passes": 6}
    ref32 = NeuralClamping(net, **settings).fit(x, y)
    with P.use(P.Precision("bf16")):
        scoped = NeuralClamping(net, **settings).fit(x, y)
        z = scoped.predict_logits(x[:50])
        # The hand-wrapped model under the same scope (its autocast nests into the scope's, a no-op). Under
        # fp32 the fast fitter would run a float64 copy of it, which autocast leaves in float64.
        by_hand = NeuralClamping(_Autocast(net), **settings).fit(x, y)
    assert torch.equal(scoped.delta_, by_hand.delta_) and scoped.temperature_ == by_hand.temperature_
    assert not torch.equal(scoped.delta_, ref32.delta_)  # bfloat16 really ran
    assert torch.equal(z, by_hand.predict_logits(x[:50]))


def test_a_run_records_its_precision_and_keeps_its_logits_apart(tmp_path):
    from nctv.experiment import run_experiment

    torch.manual_seed(2)
    net = _net(2)
    x = torch.randn(200, 1, 6, 6)
    with torch.no_grad():
        y = (net(x) + 0.5 * torch.randn(200, 5)).argmax(1)
    common = {"methods": ["Uncalibrated", "Temperature Scaling"], "seeds": 1, "bins": [10], "progress": False,
              "cache_dir": tmp_path}
    r32 = run_experiment(net, (x[:100], y[:100]), (x[100:], y[100:]), precision="fp32", **common)
    r16 = run_experiment(net, (x[:100], y[:100]), (x[100:], y[100:]), precision="bf16", **common)
    assert r32.settings["precision"]["precision"] == "fp32" and r16.settings["precision"]["precision"] == "bf16"
    assert not r16.cache_hits["calibration"]  # bf16 logits are never read back as fp32's, nor the reverse
    assert len(list((tmp_path / "logits").glob("*.safetensors"))) == 4
    z32, z16 = r32.methods["Uncalibrated"].test_logits, r16.methods["Uncalibrated"].test_logits
    with P.use(P.Precision("bf16")):
        by_hand = P.run_model(net, x[100:])
    assert not torch.equal(z32, z16) and torch.equal(z16, by_hand)
    auto = run_experiment(net, (x[:100], y[:100]), (x[100:], y[100:]), **common)
    assert auto.settings["precision"]["precision"] == "fp32" and auto.cache_hits["calibration"]


def test_a_wrapper_in_training_mode_leaves_the_wrapped_model_as_it_was():
    """A new nn.Module is in training mode. Around a model in eval mode (a batch-norm network), the passes
    of a run put both in eval mode and then give every module its own flag back: before, restoring the
    wrapper's flag with .train(True) set the wrapped model training too, and its next pass rewrote its
    batch-norm statistics (the shared default model of a test session, which then no longer matched the
    shipped study)."""
    from nctv import experiment
    from nctv.calibration.clamping import NeuralClamping
    from nctv.inference import model_logits

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)).eval()
    stats = {k: v.clone() for k, v in inner.state_dict().items()}

    class Wrapper(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

    wrapper = Wrapper(inner)
    assert wrapper.training and not inner.training
    x, y = torch.randn(60, 1, 8, 8), torch.arange(60) % 3
    model_logits(wrapper, x)
    NeuralClamping(wrapper, max_passes=2).fit(x, y)
    experiment.run_experiment(wrapper, (x[:30], y[:30]), (x[30:], y[30:]), ["Uncalibrated", "Temperature Scaling"],
                              seeds=1, bins=(5,), cache_dir=False, progress=False, conformal=None)
    assert wrapper.training and not any(m.training for m in inner.modules())
    for k, v in inner.state_dict().items():
        assert torch.equal(v, stats[k]), k
    # The wrapped model's next pass is an eval pass: one picture alone goes through its batch norm.
    inner(x[:1])
