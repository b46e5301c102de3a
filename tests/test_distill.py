"""Knowledge distillation (module.distill, DeiT): the loss, the frozen teacher, the distillation
token (model.dist_token) and any timm model as a network (model=timm)."""

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tiny_checkpoints import checkpoint

from vitpipe.errors import ConfigError
from vitpipe.lit import ImageClassifier
from vitpipe.lit.distill import check_distill, combine, distill_term, load_teacher
from vitpipe.models import ViT

ROOT = Path(__file__).resolve().parents[1]


def tiny(**kw) -> ViT:
    return ViT(img_size=8, patch_size=2, in_chans=1, num_classes=10, dim=32, depth=1, num_heads=2, **kw)


def module(net, teacher, **distill) -> ImageClassifier:
    m = ImageClassifier(net, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                        distill={"teacher": "set-below", **distill})  # fmt: skip
    object.__setattr__(m, "teacher", teacher.eval().requires_grad_(False))  # what setup("fit") does
    m.log = lambda *args, **kwargs: None  # training_step without a Trainer: nothing to log to
    m.loss_is_finite = lambda loss, batch_idx: True
    return m


@pytest.fixture
def batch():
    torch.manual_seed(0)
    return torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))


def test_alpha_zero_is_plain_cross_entropy(batch):
    x, y = batch
    torch.manual_seed(1)
    net = tiny()
    m = module(net, tiny(), alpha=0.0, type="soft")
    expected = F.cross_entropy(net(x), y, label_smoothing=m.hparams.label_smoothing)
    assert torch.allclose(m.training_step((x, y), 0), expected)
    m1 = module(net, tiny(), alpha=1.0, type="hard")  # the other end differs: the teacher counts
    assert not torch.allclose(m1.training_step((x, y), 0), expected)


def test_teacher_equal_to_the_student_gives_a_zero_soft_term(batch):
    x, y = batch
    net = tiny()
    m = module(net, copy.deepcopy(net), alpha=1.0, type="soft", tau=3.0)
    assert m.training_step((x, y), 0).abs().item() < 1e-6
    s = torch.randn(16, 10)
    assert distill_term(s, s.clone(), type="soft", tau=2.0).abs().item() < 1e-6
    t = torch.randn(16, 10)  # and positive for another teacher, scaled by tau^2 (Hinton et al.)
    kl = (F.softmax(t / 2, 1) * (F.log_softmax(t / 2, 1) - F.log_softmax(s / 2, 1))).sum(1).mean() * 4
    assert torch.allclose(distill_term(s, t, type="soft", tau=2.0), kl, atol=1e-5) and kl > 0.01


def test_soft_term_is_kl_of_the_student_from_the_teacher_not_the_reverse():
    """KL(p_t || p_s), the teacher's distribution as the target (Hinton et al.; DeiT's F.kl_div(student, teacher)).
    Teacher (0.9, 0.1) at tau=2, student uniform: KL(p_t || p_s) = 0.9 ln 1.8 + 0.1 ln 0.2 = 0.36806, the
    reverse KL(p_s || p_t) = 0.5 ln(5/9) + 0.5 ln 5 = 0.51083; times tau^2 = 4."""
    import math

    teacher = torch.tensor([[2 * math.log(9.0), 0.0]])  # softmax(teacher / 2) = (0.9, 0.1)
    student = torch.zeros(1, 2)
    forward = 0.9 * math.log(1.8) + 0.1 * math.log(0.2)
    reverse = 0.5 * math.log(5 / 9) + 0.5 * math.log(5.0)
    assert abs(forward - reverse) > 0.1  # the example tells the two directions apart
    got = distill_term(student, teacher, type="soft", tau=2.0).item()
    assert abs(got - 4 * forward) < 1e-5, (got, 4 * forward, 4 * reverse)


def test_hard_distillation_uses_the_teachers_argmax(batch):
    s, t = torch.randn(16, 10), torch.randn(16, 10)
    assert torch.allclose(distill_term(s, t, type="hard"), F.cross_entropy(s, t.argmax(1)))
    assert torch.allclose(distill_term(s, t * 5, type="hard"), distill_term(s, t, type="hard"))  # argmax only
    base = torch.tensor(2.0)
    assert torch.allclose(combine(base, s, t, type="hard", alpha=0.25, tau=1.0),
                          0.75 * base + 0.25 * F.cross_entropy(s, t.argmax(1)))


def test_dist_token_model_evaluates_the_mean_of_its_two_heads(batch):
    x, _ = batch
    net = tiny(dist_token=True).eval()
    assert net.num_prefix_tokens == 2 and "dist_token" in net.no_weight_decay()
    cls_logits, dist_logits = net.forward_heads(x)
    assert not torch.allclose(cls_logits, dist_logits)  # two heads, two tokens
    assert torch.allclose(net(x), (cls_logits + dist_logits) / 2)
    heads = {id(p) for p in net.get_classifier().parameters()}  # a linear probe trains both heads
    assert heads == {id(p) for m in (net.head, net.head_dist) for p in m.parameters()}
    with pytest.raises(ValueError, match="dist_token=True"):
        tiny(dist_token=True, class_token=False, pool="mean")


def test_options_are_checked_in_one_line():
    assert check_distill({"teacher": None, "type": "bogus"}) is None  # no teacher: off, nothing to check
    for bad, words in [({"type": "medium"}, "module.distill.type='medium'"), ({"alpha": 2}, "alpha=2"),
                       ({"tau": 0}, "tau=0")]:
        with pytest.raises(ConfigError, match=words):
            check_distill({"teacher": "x", **bad})
    with pytest.raises(ConfigError, match="no checkpoint, run dir, weights file or timm model name"):
        load_teacher("not_a_model_anywhere", num_classes=10, in_chans=1)


def test_the_recipe_started_outside_a_checkout_names_its_teacher_and_the_way_without(tmp_path, cfg_factory):
    # experiment=fmnist_vit distils from the checkout's assets/ (not in the wheel): from any other directory the
    # run stops in one line before data loads (preflight), naming the path it looked at and what to type instead;
    # training's builder runs the same check, and load_teacher raises the same line (one owner: check_teacher_file)
    from vitpipe.config.preflight import check_config
    from vitpipe.run.build import build_from_config

    elsewhere = tmp_path / "elsewhere"
    cfg = cfg_factory("experiment=fmnist_vit", f"paths.root_dir={elsewhere}")
    line = rf"^module.distill.teacher={elsewhere}/assets/teachers/fmnist_resnet10t.safetensors: no such file; .*" \
           r"module.distill=null to train without one$"
    for stage in (check_config, build_from_config):
        with pytest.raises(ConfigError, match=line):
            stage(cfg)
    without = cfg_factory("experiment=fmnist_vit", f"paths.root_dir={elsewhere}", "module.distill=null", sub="without")
    check_config(without)
    assert build_from_config(without)[2].teacher is None


def test_teacher_is_frozen_and_unsaved_through_a_real_fit(tmp_path, cfg_factory):
    from vitpipe.run.build import build_from_config

    ckpt = checkpoint("sincos2d", tmp_path)  # a vitpipe checkpoint as the teacher
    cfg = cfg_factory("debug=fast", "logger=none", "model.dist_token=true", f"module.distill.teacher={ckpt}",
                      "module.distill.type=hard", sub="student")  # fmt: skip
    dm, net, m = build_from_config(cfg)
    reference = load_teacher(str(ckpt), num_classes=10, in_chans=1)
    before = copy.deepcopy(net.state_dict())
    trainer = L.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(m, dm)
    teacher = m.teacher
    assert teacher is not None and not teacher.training
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(a, b) for a, b in zip(teacher.state_dict().values(), reference.state_dict().values()))
    trained = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert not trained & {id(p) for p in teacher.parameters()}
    assert not any(k.startswith("teacher") for k in m.state_dict())  # checkpoints hold net.* only
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items())  # the student did learn
    assert net.head_dist.weight.grad is not None  # the distillation head trained on the teacher


def test_a_teacher_at_another_size_sees_the_batch_the_data_module_would_give_it():
    """fmnist_vit's teacher was trained on 56-px resizes of the 28-px images: upsampling the
    student's normalised batch must give what the data module gives at 56 px, and the training step
    must hand the teacher that batch."""
    from vitpipe.data.fast import to_model_input
    from vitpipe.lit.distill import teacher_input

    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8, generator=g)
    norm = {"mean": [0.286], "std": [0.353], "out_chans": 1}
    student = to_model_input(raw, img_size=(28, 28), **norm)
    expected = to_model_input(raw, img_size=(56, 56), **norm)
    assert torch.allclose(teacher_input(student, (56, 56)), expected, atol=1e-5)
    assert teacher_input(student, None) is student and teacher_input(student, (28, 28)) is student

    seen = []

    class Recorder(torch.nn.Module):  # a teacher that records its input
        img_size = (12, 12)

        def forward(self, x):
            seen.append(x)
            return torch.zeros(x.shape[0], 10)

    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    module(tiny(), Recorder(), alpha=0.5, type="hard").training_step((x, y), 0)
    assert torch.equal(seen[0], F.interpolate(x, size=(12, 12), mode="bilinear", align_corners=False))


class _OpensAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this calls open(path, "w"): the file appearing means code ran
        return (open, (str(self.path), "w"))


def test_the_shipped_teacher_file_names_its_architecture():
    """assets/teachers/fmnist_resnet10t.safetensors carries arch, kwargs and img_size (as scripts/make_teacher.py
    writes them), so fmnist_vit's distillation settings, which name the file, restate none of them."""
    from vitpipe.lit.distill import file_metadata

    root = Path(__file__).resolve().parents[1]
    meta = file_metadata(root / "assets" / "teachers" / "fmnist_resnet10t.safetensors")
    assert meta == {"arch": "resnet10t", "kwargs": {"channels": (32, 64, 128, 224)}, "img_size": (56, 56)}
    distill = OmegaConf.load(root / "conf" / "experiment" / "fmnist_vit.yaml").module.distill
    assert not {"arch", "kwargs", "img_size"} & set(distill)
    teacher = load_teacher(str(root / "assets" / "teachers" / "fmnist_resnet10t.safetensors"), num_classes=10, in_chans=1)
    assert teacher.img_size == (56, 56) and teacher.num_features == 224


def test_a_pickled_teacher_weights_file_never_runs_code(tmp_path):
    """A .pth teacher is read with torch.load(weights_only=True), whatever timm's load_state_dict defaults to
    (False up to timm 1.0.24), and a file that needs code to load stops in one line naming it."""
    marker, path = tmp_path / "pwned", tmp_path / "evil.pth"
    torch.save({"fc.weight": _OpensAFile(marker)}, path)  # torch.load(weights_only=False) would call open()
    with pytest.raises(ConfigError, match=r"module.distill.teacher=.*evil.pth.*cannot be read"):
        load_teacher(str(path), num_classes=10, in_chans=1, arch="resnet10t")
    assert not marker.exists()


def test_timm_kwargs_reach_timm_and_must_be_plain_data():
    from vitpipe.models.timm_model import create_timm_model

    narrow = create_timm_model("resnet10t", num_classes=10, in_chans=1, kwargs={"channels": [16, 32, 32, 64]})
    assert narrow.num_features == 64 and create_timm_model("resnet10t", num_classes=10, in_chans=1).num_features == 512
    for bad, match in [({"num_classes": 3}, r"model.kwargs sets \['num_classes'\]"),
                       ({"block": {"_target_": "os.system"}}, "model.kwargs.block=.*only numbers, strings"),
                       ({"act_layer": print}, "model.kwargs.act_layer=.*only numbers")]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            create_timm_model("resnet10t", num_classes=10, in_chans=1, kwargs=bad)
    with pytest.raises(ConfigError, match=r"module.distill.kwargs sets \['in_chans'\]"):
        check_distill({"teacher": "x.safetensors", "kwargs": {"in_chans": 3}})


def test_timm_models_build_from_the_config_and_refuse_what_they_cannot_do(cfg_factory):
    from hydra.utils import instantiate

    from vitpipe.config.build import instantiate_checked
    from vitpipe.models.timm_compat import timm_kwargs
    from vitpipe.run.stored import ALLOWED_TARGETS

    cfg = cfg_factory("model=timm", "model.name=resnet10t")  # not debug=fast: it sets ViT dims
    assert cfg.model._target_ in ALLOWED_TARGETS["model"]
    net = instantiate(OmegaConf.to_container(cfg.model, resolve=True))
    assert net(torch.randn(2, 1, *net.img_size)).shape == (2, 10) and net.num_classes == 10
    with pytest.raises(ConfigError, match="ResNet") as err:
        timm_kwargs(net)  # export format=timm: one line
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="distillation token"):
        timm_kwargs(tiny(dist_token=True))
    with pytest.raises(ConfigError, match="model: model.name='nope' is not a timm model"):
        instantiate_checked(cfg_factory("model=timm", "model.name=nope", sub="bad").model, "model")


def test_a_timm_cnn_teacher_trained_by_vitpipe_distils_into_a_dist_token_vit(tmp_path):
    """The issue's workflow end to end: `model=timm` trains the teacher, its run dir is the
    student's teacher, and the student's checkpoint rebuilds (no teacher inside) for eval."""
    from conftest import make_cfg

    from vitpipe.run.checkpoint import rebuild
    from vitpipe.run.paths import resolve_ckpt_path
    from vitpipe.run.stored import load_checkpoint
    from vitpipe.tasks.train import train

    limits = ["logger=none", "trainer=cpu", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
              "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "data.batch_size=16"]
    # a narrower resnet10t (model.kwargs) at a larger input than the student's 8 px, as fmnist_vit's teacher
    narrow = ["model.kwargs={channels:[16,32,32,64]}"]
    cfg = make_cfg(tmp_path / "teacher", ["model=timm", "model.name=resnet10t", "model.img_size=12", *narrow, *limits])
    train(cfg)
    teacher_run = cfg.paths.output_dir
    # shipped as a weights file (scripts/make_teacher.py, as experiment=fmnist_vit ships its teacher):
    # loaded the way training loads it, the file gives the run's logits
    from vitpipe.tasks import make_teacher

    weights = make_teacher.make_teacher(teacher_run, str(tmp_path / "teacher.safetensors"))
    from_run = load_teacher(teacher_run, num_classes=10, in_chans=1)
    kwargs = {"channels": [16, 32, 32, 64]}
    from_file = load_teacher(str(weights), num_classes=10, in_chans=1, arch="resnet10t", kwargs=kwargs, img_size=12)
    assert from_run.img_size == from_file.img_size == (12, 12) and from_file.num_features == 64
    x = torch.randn(4, 1, 12, 12)
    assert torch.equal(from_run(x), from_file(x)) and weights.stat().st_size < 25 * 2**20
    # the file's metadata says arch, kwargs and img_size: nothing else needs naming, same logits
    from_meta = load_teacher(str(weights), num_classes=10, in_chans=1)
    assert from_meta.img_size == (12, 12) and torch.equal(from_meta(x), from_file(x))
    with pytest.raises(ConfigError, match=r"^module.distill.kwargs={'channels': \[16, 32, 64, 64\]} but the teacher "
                                          r"file .*teacher.safetensors was written for kwargs={'channels': "
                                          r"\[16, 32, 32, 64\]} \(its metadata\)"):
        load_teacher(str(weights), num_classes=10, in_chans=1, kwargs={"channels": [16, 32, 64, 64]})
    with pytest.raises(ConfigError, match=r"^module.distill.img_size=\[16, 16\] but .* img_size=\[12, 12\]"):
        load_teacher(str(weights), num_classes=10, in_chans=1, img_size=16)
    with pytest.raises(ConfigError, match=r"^module.distill.arch=resnet18 but .* arch=resnet10t"):
        load_teacher(str(weights), num_classes=10, in_chans=1, arch="resnet18")
    # a weights file without metadata needs them named; the widths are part of the architecture
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare.safetensors"
    save_file(load_file(str(weights)), str(bare))
    with pytest.raises(ConfigError, match="does not fit resnet10t .* kwargs {}"):
        load_teacher(str(bare), num_classes=10, in_chans=1, arch="resnet10t")
    with pytest.raises(ConfigError, match=r"img_size=\[16, 16\]: the teacher .* was trained at \[12, 12\]"):
        load_teacher(teacher_run, num_classes=10, in_chans=1, img_size=16)
    cfg = make_cfg(tmp_path / "student", ["debug=fast", *limits, "model.dist_token=true",
                                          f"module.distill.teacher={weights}", "module.distill.alpha=0.5"])
    metrics = train(cfg)
    assert 0.0 <= metrics["test/acc"] <= 1.0
    path = resolve_ckpt_path(cfg.paths.output_dir, which="best")
    ckpt = load_checkpoint(path)
    assert all(k.startswith(("net.", "ema.")) for k in ckpt["state_dict"])  # no teacher.* keys
    assert "net.head_dist.weight" in ckpt["state_dict"]
    net = rebuild(ckpt, path).net
    x = torch.randn(4, 1, 8, 8)
    a, b = net.forward_heads(x)
    assert torch.allclose(net(x), (a + b) / 2)
    assert type(rebuild(load_checkpoint(resolve_ckpt_path(teacher_run)), teacher_run).net).__name__ == "ResNet"
    from vitpipe.tasks.visualize import visualize

    viz = make_cfg(tmp_path / "viz", [f"ckpt_path={teacher_run}", "images=test"], config_name="visualize")
    with pytest.raises(ConfigError, match="attention maps need a vitpipe ViT; .* holds a ResNet$"):
        visualize(viz)  # a CNN has no attention to show: one line


def _fit_student(cfg_factory, teacher: Path, *, precompute: bool, steps: int = 6):
    from vitpipe.run.build import build_from_config

    cfg = cfg_factory("debug=fast", "logger=none", "data.crop_padding=0", "data.hflip=true",
                      f"module.distill.teacher={teacher}", "module.distill.type=soft",
                      f"module.distill.precompute={str(precompute).lower()}", sub=f"student-{precompute}")  # fmt: skip
    torch.manual_seed(0)
    dm, net, m = build_from_config(cfg)
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, max_epochs=-1, limit_train_batches=None, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(m, dm)
    return net, dm, m


def test_precomputed_targets_train_the_student_as_the_teacher_run_each_step(tmp_path, cfg_factory):
    """``module.distill.precompute=true``: the teacher's logits of every training image and its mirror, computed
    before the first step, are what the teacher gives on each view, and a fit that reads them ends with the
    weights of the fit that runs the teacher on every batch (same seed, same flips: only the batch the teacher
    saw differs, so float rounding)."""
    ckpt = checkpoint("sincos2d", tmp_path)
    online, _, _ = _fit_student(cfg_factory, ckpt, precompute=False)
    stored, dm, m = _fit_student(cfg_factory, ckpt, precompute=True)
    targets = dm.data_train.targets
    images = dm.data_train.images
    assert targets.shape == (len(images), 2, 10) and targets.dtype == torch.float32
    with torch.no_grad():
        plain = m.teacher(dm.augment_batch(images[:8], train=False))
        mirrored = m.teacher(dm.augment_batch(images[:8].flip(-1), train=False))
    assert torch.allclose(targets[:8, 0], plain, atol=1e-5) and torch.allclose(targets[:8, 1], mirrored, atol=1e-5)
    assert not torch.allclose(plain, mirrored, atol=1e-3)  # the two views differ: the flip picks one
    for (name, a), b in zip(online.state_dict().items(), stored.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_precomputed_targets_are_read_back_only_under_their_own_key(tmp_path):
    from vitpipe.lit.distill import cached_targets

    calls = []

    def compute(value: float, n: int = 4):
        calls.append(value)
        return torch.full((n, 2, 3), value)

    assert torch.equal(cached_targets(tmp_path, "k", lambda: compute(1.0), (4, 2, 3)), torch.ones(4, 2, 3))
    assert torch.equal(cached_targets(tmp_path, "k", lambda: compute(2.0), (4, 2, 3)), torch.ones(4, 2, 3))
    assert calls == [1.0]  # the second read the file
    assert [p.name for p in tmp_path.iterdir()] == ["k.safetensors"]  # no temporary file left
    assert torch.equal(cached_targets(tmp_path, "other", lambda: compute(2.0), (4, 2, 3)), torch.full((4, 2, 3), 2.0))
    assert cached_targets(tmp_path, "k", lambda: compute(4.0, n=5), (5, 2, 3)).shape == (5, 2, 3)  # another shape
    (tmp_path / "k.safetensors").write_bytes(b"not a safetensors file")  # broken: computed afresh, rewritten
    assert torch.equal(cached_targets(tmp_path, "k", lambda: compute(3.0), (4, 2, 3)), torch.full((4, 2, 3), 3.0))
    assert torch.equal(cached_targets(tmp_path, "k", lambda: compute(5.0), (4, 2, 3)), torch.full((4, 2, 3), 3.0))
    assert calls == [1.0, 2.0, 4.0, 3.0]


@pytest.mark.parametrize(("override", "match"), [
    ("data.crop_padding=2", r"data.crop_padding=2 makes other views; set data.crop_padding=0"),
    ("data.random_erasing=0.25", r"data.random_erasing=0.25 makes other views"),
    ("module.mixup={mixup_alpha:0.8}", r"module.mixup=null or module.distill.precompute=false"),
    ("data.fast_path=false", r"needs a data set held in memory \(data.fast_path=true"),
])
def test_precompute_refuses_views_it_has_no_logits_for_before_data_loads(cfg_factory, override, match):
    from vitpipe.config.preflight import check_config

    base = ["debug=fast", "logger=none", "data=fashion_mnist", "data.crop_padding=0",
            "module.distill.teacher=${paths.root_dir}/assets/teachers/fmnist_resnet10t.safetensors",
            "module.distill.precompute=true"]
    check_config(cfg_factory(*base))
    with pytest.raises(ConfigError, match=match) as err:
        check_config(cfg_factory(*base, override, sub="bad"))
    assert "\n" not in str(err.value)


def test_the_targets_key_reads_every_weight_and_buffer_of_a_batchnorm_teacher():
    """The shipped teacher is a ResNet: its BatchNorm counters are 0-dim buffers, and any weight, the images or
    the input transform changing gives another key (so a cached file of another teacher is never read)."""
    from vitpipe.lit.distill import targets_key
    from vitpipe.models.timm_model import create_timm_model

    teacher = create_timm_model("resnet10t", num_classes=10, in_chans=1, kwargs={"channels": [8, 8, 8, 8]}).eval()
    images = torch.randint(0, 255, (6, 1, 8, 8), dtype=torch.uint8)
    key = targets_key(teacher, images, {"img_size": [8, 8]}, 2)
    assert key == targets_key(teacher, images.clone(), {"img_size": [8, 8]}, 2) and len(key) == 64
    other = copy.deepcopy(teacher)
    with torch.no_grad():
        other.fc.bias[0] += 1e-3
    changed = images.clone()
    changed[0, 0, 0, 0] ^= 1
    size = {"img_size": [8, 8]}
    keys = {key, targets_key(other, images, size, 2), targets_key(teacher, changed, size, 2),
            targets_key(teacher, images, {"img_size": [12, 12]}, 2), targets_key(teacher, images, size, 1)}
    assert len(keys) == 5
