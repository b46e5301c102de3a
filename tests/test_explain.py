"""vitpipe.inference.explain: one list of attention-map methods, both spellings of gradient rollout read as
one canonical name, and ``explain`` drawing exactly the maps of vitpipe.viz.rollout for each of them."""

import pytest
import torch

from vitpipe.errors import ConfigError
from vitpipe.inference.explain import ALIASES, METHODS, check_method, explain, method_name, methods_for
from vitpipe.viz.rollout import gradient_rollout, naflex_rollout_for_model, rollout_for_model


@pytest.fixture(scope="module")
def micro():
    from vitpipe import create_model

    torch.manual_seed(0)
    return create_model("vit_micro", img_size=(16, 24), num_classes=5).eval()


def test_each_spelling_names_one_canonical_method():
    assert METHODS == ("rollout", "gradient")
    assert [method_name(m) for m in ("rollout", "gradient", "gradient_rollout")] == ["rollout", "gradient", "gradient"]
    assert all(v in METHODS for v in ALIASES.values())
    assert method_name("heads") is None and method_name(None) is None
    assert check_method("gradient_rollout") == "gradient"
    with pytest.raises(ConfigError, match=r"method='saliency' is not valid; choose one of \['rollout', 'gradient'\]"):
        check_method("saliency")
    with pytest.raises(ConfigError, match=r"choose one of \['rollout'\]"):
        check_method("gradient_rollout", ("rollout",))


def test_explain_draws_the_rollout_functions_maps_under_either_spelling(micro):
    x = torch.randn(2, 3, 16, 24)
    torch.testing.assert_close(explain(micro, x, "rollout", discard_ratio=0.2, head_fusion="max"),
                               rollout_for_model(micro, x, discard_ratio=0.2, head_fusion="max"))
    want = gradient_rollout(micro, x, 3).detach()
    for spelling in ("gradient", "gradient_rollout"):
        torch.testing.assert_close(explain(micro, x, spelling, target=3), want)
    with torch.inference_mode():  # where serve and the demo compute probabilities: the map still has its gradient
        got = explain(micro, x.clone(), "gradient", target=3)
    assert not got.requires_grad
    torch.testing.assert_close(got, want)
    assert not torch.allclose(explain(micro, x, "gradient", target=0), want)  # the target is the class explained


def test_naflex_batches_get_rollout_per_image_and_gradient_is_refused(micro):
    from vitpipe.nn.naflex import pad_batch, patchify_image

    batch = pad_batch([patchify_image(torch.randn(3, 16, 24), 4, 24), patchify_image(torch.randn(3, 24, 8), 4, 24)])
    got, want = explain(micro, batch, "rollout"), naflex_rollout_for_model(micro, batch)
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ConfigError, match="NaFlex"):
        explain(micro, batch, "gradient_rollout")


def test_methods_offered_follow_the_network(micro):
    assert methods_for(micro) == METHODS and methods_for(micro, naflex=True) == ("rollout",)
    assert methods_for(torch.nn.Linear(2, 2)) == ()  # no ViT attention (e.g. a timm CNN)


def test_visualize_and_demo_take_both_spellings():
    from vitpipe.tasks.visualize import kinds_for

    assert kinds_for("gradient_rollout", captioner=False) == kinds_for("gradient", captioner=False) == ["gradient"]
