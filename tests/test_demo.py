"""scripts/demo.py: the Gradio page gives predict.py's labels and probabilities, with its attention overlay.

The browser tests share one run of the real command (``python scripts/demo.py ckpt_path=... port=<free>``)
in a subprocess on 127.0.0.1 and one headless Chromium: upload a test image and read the page's answer,
switch the attention-map radio and compare the overlay PNG the page displays with ``show``'s, click
gallery examples and compare with predict.py on those files. They are skipped, with the reason, only
where chromium / chromedriver are not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_checkpoints as tc
import torch
from conftest import make_cfg
from drivers import demo_screenshot as browser_page
from PIL import Image

from vitpipe.errors import ConfigError
from vitpipe.tasks import demo as demo_task
from vitpipe.tasks import demo_model
from vitpipe.tasks.predict import predict

# a model on a non-square input (8 x 12 from the 8 x 8 digits): the overlay must keep the 2:3 aspect
tc.KINDS.setdefault("demo_wide", ["model.pos_embed=learned", "model.img_size=[8,12]"])
# a NaFlex classifier: each file patchified at its own aspect, at most 12 patches of 2 x 2
tc.KINDS.setdefault("demo_naflex", ["model.pos_embed=learned", "data.naflex.enabled=true", "data.naflex.seq_lens=[12]",
                                    "data.naflex.max_seq_len=12"])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("demo_ckpts")
    return lambda kind: tc.checkpoint(kind, base)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Test-split digits as the page's examples are written, plus an RGB photo of another size and mode."""
    folder = tmp_path_factory.mktemp("demo_images")
    from hydra.utils import instantiate

    dm = instantiate(make_cfg(folder / "cfg", ["debug=fast"]).data)  # digits: the tiny checkpoints' data
    written = demo_task.split_examples(dm, 3, folder / "files")
    assert len(written) == 3 and len({p.name.split("_")[1] for p in written}) == 3  # three classes
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (21, 13, 3), dtype=np.uint8)).save(folder / "files" / "photo.png")
    return folder / "files"


def demo_cfg(tmp_path: Path, ckpt, *overrides: str):
    return make_cfg(tmp_path, [f"ckpt_path={ckpt}", "device=cpu", *overrides], config_name="demo")


def predict_json(tmp_path: Path, ckpt, images, *overrides: str) -> dict[str, dict]:
    """scripts/predict.py's rows (JSON: full precision) by file name."""
    cfg = make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"images={images}", f"out={tmp_path / 'preds.json'}",
                              "device=cpu", *overrides], config_name="predict")
    return {Path(r["path"]).name: r for r in json.loads(predict(cfg).read_text())}


def row_topk(row: dict) -> list[tuple[str, float]]:
    out, rank = [(row["label"], row["prob"])], 2
    while f"top{rank}_label" in row:
        out.append((row[f"top{rank}_label"], row[f"top{rank}_prob"]))
        rank += 1
    return out


# --------------------------------------------------------------------------- without the browser


@pytest.mark.parametrize("kind,tta", [("learned", "none"), ("sincos2d_rgb", "hflip")])
def test_page_top_k_equals_predict_py_for_the_same_files(ckpts, images, tmp_path, kind, tta):
    ckpt = ckpts(kind)
    expected = predict_json(tmp_path / "p", ckpt, images, "topk=5", f"tta={tta}")
    model = demo_model.load_model(demo_cfg(tmp_path / "d", ckpt, f"tta={tta}"))
    for path in sorted(images.iterdir()):
        got = demo_model.show(model, path, "rollout", topk=5).probs
        want = row_topk(expected[path.name])
        assert [name for name, _ in want] == list(got), path.name  # the same labels, in the same order
        np.testing.assert_allclose([got[n] for n, _ in want], [p for _, p in want], atol=1e-5, rtol=0)


def test_page_applies_the_calibration_temperature_predict_py_applies(ckpts, images, tmp_path):
    import shutil

    from vitpipe.report.calibration import checkpoint_identity, write_calibration
    from vitpipe.run.stored import load_checkpoint

    ckpt = tmp_path / "run" / "checkpoints" / "epoch_000.ckpt"
    ckpt.parent.mkdir(parents=True)
    shutil.copy(ckpts("learned"), ckpt)
    plain = demo_model.load_model(demo_cfg(tmp_path / "plain", ckpt))
    write_calibration(ckpt.parent, 2.5, identity=checkpoint_identity(ckpt, load_checkpoint(ckpt)), tta="none")
    expected = predict_json(tmp_path / "p", ckpt, images, "topk=3")
    model = demo_model.load_model(demo_cfg(tmp_path / "d", ckpt))
    assert model.loaded.temperature == 2.5 and "calibration temperature 2.5" in model.facts["Checkpoint"]
    for path in sorted(images.iterdir()):
        got = demo_model.show(model, path, "rollout", topk=3).probs
        want = row_topk(expected[path.name])
        np.testing.assert_allclose([got[n] for n, _ in want], [p for _, p in want], atol=1e-5, rtol=0)
        assert max(got.values()) < max(demo_model.show(plain, path, "rollout").probs.values())  # T > 1 flattens


@pytest.mark.parametrize("method", ["rollout", "gradient"])
def test_overlay_keeps_the_model_inputs_shape_and_aspect(ckpts, images, tmp_path, method):
    model = demo_model.load_model(demo_cfg(tmp_path, ckpts("demo_wide")))
    shown = demo_model.show(model, images / "photo.png", method, display_size=100)
    assert tuple(shown.attention.shape) == (4, 6)  # the 8 x 12 input on 2 x 2 patches
    assert shown.display.shape == shown.overlay.shape == (72, 108, 3)  # x9: the longer side >= 100, 2:3 kept
    assert shown.overlay.dtype == np.uint8 and not np.array_equal(shown.overlay, shown.display)
    heat = shown.attention
    assert torch.isfinite(heat).all() and heat.max() > heat.min()  # a map, not a constant


def test_naflex_page_equals_predict_py_and_draws_rollout_at_the_images_own_aspect(ckpts, tmp_path):
    ckpt = ckpts("demo_naflex")
    folder = tmp_path / "wide"
    folder.mkdir()
    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 255, (8, 24), dtype=np.uint8)).save(folder / "wide.png")  # 1:3
    expected = row_topk(predict_json(tmp_path / "p", ckpt, folder, "topk=3")["wide.png"])
    model = demo_model.load_model(demo_cfg(tmp_path / "d", ckpt))
    shown = demo_model.show(model, folder / "wide.png", "rollout", topk=3, display_size=60)
    assert list(shown.probs) == [n for n, _ in expected]
    np.testing.assert_allclose(list(shown.probs.values()), [p for _, p in expected], atol=1e-5, rtol=0)
    assert tuple(shown.attention.shape) == (2, 6)  # 12 patches at 1:3
    assert shown.display.shape == shown.overlay.shape == (20, 60, 3)  # the 4 x 12 pixels the model saw, x5
    with pytest.raises(ConfigError, match="NaFlex .* choose rollout"):
        demo_model.show(model, folder / "wide.png", "gradient")


def test_gradient_and_plain_rollout_differ_and_follow_the_models_rollout(ckpts, images, tmp_path):
    from vitpipe.viz.rollout import gradient_rollout, rollout_for_model

    model = demo_model.load_model(demo_cfg(tmp_path, ckpts("learned")))
    path = sorted(images.glob("*.png"))[0]
    x = demo_model.model_input(model, path)
    _, top, _ = demo_model.top_k(model, x, 1)
    plain = demo_model.show(model, path, "rollout").attention
    grad = demo_model.show(model, path, "gradient").attention
    torch.testing.assert_close(plain, rollout_for_model(model.net, x)[0])
    torch.testing.assert_close(grad, gradient_rollout(model.net, x, top)[0])
    assert not torch.allclose(plain, grad)


def test_facts_name_architecture_data_and_the_runs_test_accuracy(ckpts, tmp_path):
    ckpt = ckpts("learned")
    metrics = ckpt.parent.parent / "metrics.json"
    metrics.write_text(json.dumps({"test/acc": 0.8125, "test/loss": 0.5}))
    try:
        facts = demo_model.load_model(demo_cfg(tmp_path, ckpt)).facts
    finally:
        metrics.unlink()
    assert facts["Test accuracy"].startswith("0.8125")
    assert facts["Data"] == "Digits, 10 classes"
    assert "vit_nano" in facts["Architecture"] and "depth 1" in facts["Architecture"]


def test_captioner_page_gives_predict_pys_caption_and_one_map_per_word(ckpts, tmp_path):
    from vitpipe.viz.rollout import cross_attention_maps

    ckpt = ckpts("captioner")
    folder = tmp_path / "shapes"
    folder.mkdir()
    rng = np.random.default_rng(3)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    expected = predict_json(tmp_path / "p", ckpt, folder)
    model = demo_model.load_model(demo_cfg(tmp_path / "d", ckpt))
    assert model.facts["Architecture"].startswith("captioner: ViT")
    for path in sorted(folder.iterdir()):
        shown = demo_model.caption_image(model, path, display_size=64)
        assert shown.caption == expected[path.name]["caption"] == " ".join(shown.words)
        assert len(shown.overlays) == len(shown.words) == shown.attention.shape[0] > 0
        assert all(o.shape == shown.display.shape for o in shown.overlays)
        x = demo_model.model_input(model, path)  # the maps are the decoder's own cross-attention for those words
        hp = model.loaded.built.module.hparams
        ids, attn = model.net.generate(x, max_len=hp.max_gen_len, beam_size=hp.beam_size,
                                       length_penalty=hp.length_penalty, return_cross_attn=True)
        full = cross_attention_maps(attn, tuple(model.net.grid_size), num_prefix_tokens=model.net.num_prefix_tokens)[0]
        torch.testing.assert_close(shown.attention, full[: len(shown.words)])  # no specials among these words
    page = demo_task.build_page(model, demo_cfg(tmp_path / "page", ckpt), [])
    assert {"caption", "words", "model-input"} <= {b.elem_id for b in page.blocks.values()}


def test_a_timm_cnn_gets_its_labels_without_an_attention_map(images, tmp_path, capfd):
    """model=timm (a CNN, no attention): the page answers predict's top-k, shows the input where the
    overlay would be, hides the method switch, and a note says why; the facts name the timm network."""
    ckpt = tc.timm_checkpoint(tmp_path)
    expected = predict_json(tmp_path / "p", ckpt, images, "topk=5")
    model = demo_model.load_model(demo_cfg(tmp_path / "d", ckpt))
    assert "not a vitpipe ViT" in capfd.readouterr().err and not model.explainable
    assert model.facts["Architecture"].startswith("timm resnet10t (ResNet")
    for path in sorted(images.iterdir()):
        shown = demo_model.show(model, path, "rollout", topk=5)
        want = row_topk(expected[path.name])
        assert list(shown.probs) == [n for n, _ in want]
        assert list(shown.probs.values()) == pytest.approx([q for _, q in want], abs=1e-5)
        assert shown.attention is None and np.array_equal(shown.overlay, shown.display)
    page = demo_task.build_page(model, demo_cfg(tmp_path / "d2", ckpt), [])
    radio = next(b for b in page.blocks.values() if getattr(b, "elem_id", None) == "method")
    assert radio.visible is False


@pytest.mark.parametrize("override,message", [
    ("method=heads", r"method='heads' is not valid; choose one of \['rollout', 'gradient'\]"),
    ("port=0", r"port=0: expected an int in 1\.\.65535"),
    ("topk=0", r"topk=0: expected an int >= 1"),
    ("tta=vflip", r"tta='vflip'; valid choices"),
    ("cmap=nope", r"cmap='nope' is not a matplotlib colormap"),
])
def test_bad_options_fail_in_one_line_before_the_checkpoint_is_read(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        demo_task.demo(demo_cfg(tmp_path, tmp_path / "no-such.ckpt", override))


def test_a_taken_port_is_one_line_naming_it(ckpts, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"server_name=127\.0\.0\.1 port={port}: cannot serve there .*port=null"):
            demo_task.demo(demo_cfg(tmp_path, ckpts("learned"), f"port={port}", "num_examples=0"))


def test_without_gradio_one_line_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio -> ImportError
    with pytest.raises(ConfigError, match=r'needs Gradio, which is not installed here: pip install -e "\.\[serve\]"'):
        demo_task.demo(demo_cfg(tmp_path, tmp_path / "no-such.ckpt"))


# --------------------------------------------------------------------------- a real browser


@pytest.fixture(scope="module")
def served(ckpts, tmp_path_factory):
    """``python scripts/demo.py ckpt_path=<tiny ckpt> port=<free>``, as typed, from a fresh directory;
    stopped by its PID."""
    work = tmp_path_factory.mktemp("demo_server")
    ckpt = ckpts("learned")
    proc, url = browser_page.start_demo([f"ckpt_path={ckpt}", f"port={browser_page.free_port()}", "device=cpu"],
                                        cwd=work, log=work / "demo.log", timeout=120, env={"OMP_NUM_THREADS": "1"})
    yield ckpt, url, work
    browser_page.stop_demo(proc)


@pytest.fixture(scope="module")
def driver():
    """One headless Chromium for the module's browser tests (each opens the page afresh)."""
    driver = browser_page.browser()
    yield driver
    driver.quit()


needs_browser = pytest.mark.skipif(browser_page.chromium() is None, reason="chromium and chromedriver are not "
                                   "installed (Debian: apt-get install chromium chromium-driver)")


@needs_browser
def test_browser_upload_shows_predict_pys_label_and_probability(served, driver, images, tmp_path):
    ckpt, url, work = served
    image = sorted(images.glob("*.png"))[0]
    expected = predict_json(tmp_path, ckpt, image, "topk=5")[image.name]
    answer = browser_page.upload(driver, url, image, timeout=60)
    assert answer.label == expected["label"]
    shown = float(answer.percent.rstrip("%"))
    assert abs(shown - 100 * expected["prob"]) <= 0.5 + 1e-6  # gr.Label rounds to whole percent
    assert [n for n, _ in answer.rows] == [n for n, _ in row_topk(expected)]
    assert answer.overlay_size == answer.input_size == (256, 256)  # 8x8 digits x 32, beside each other
    examples = list((work / "logs" / "demo" / "runs").glob("*/examples/*.png"))
    assert len(examples) == 8  # the test split's examples, written under the run's output folder


def mean_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


@needs_browser
def test_browser_radio_switches_the_overlay_to_gradient_rollout_and_back(served, driver, images, tmp_path):
    ckpt, url, _ = served
    image = sorted(images.glob("*.png"))[0]
    cfg = demo_cfg(tmp_path, ckpt)  # the server's options: the config's defaults
    model = demo_model.load_model(cfg)
    style = {k: cfg[k] for k in ("topk", "head_fusion", "discard_ratio", "alpha", "cmap", "display_size")}
    from vitpipe.inference.explain import METHODS

    want = {m: demo_model.show(model, image, m, **style).overlay for m in METHODS}
    assert mean_abs(want["rollout"], want["gradient"]) > 5  # the two overlays are told apart by far more than 1
    shown = [browser_page.upload(driver, url, image, timeout=60)]  # the config's method=rollout first
    for method in ("gradient", "rollout"):
        shown.append(browser_page.choose_method(driver, method, shown[-1], timeout=60))
    for answer, method in zip(shown, ("rollout", "gradient", "rollout")):
        got = browser_page.shown_image(driver, answer.overlay_src)  # the PNG the page displays, fetched by it
        assert got.shape == want[method].shape == (256, 256, 3)
        diff = {m: mean_abs(got, w) for m, w in want.items()}
        assert diff[method] <= 0.5 and min(diff, key=diff.get) == method, (method, diff)
        assert answer.probs == shown[0].probs  # the labels do not depend on the map


@needs_browser
def test_browser_example_click_shows_predict_pys_labels_and_probabilities(served, driver, tmp_path):
    ckpt, url, work = served
    (folder,) = {p.parent for p in (work / "logs" / "demo" / "runs").glob("*/examples/*.png")}
    expected = {name: row_topk(row) for name, row in predict_json(tmp_path, ckpt, folder, "topk=5").items()}
    names = sorted(expected)
    first = names[1]  # not the first thumbnail: the click must pick the file clicked
    second = next(n for n in names[2:] if [k for k, _ in expected[n]] != [k for k, _ in expected[first]])
    browser_page.open_page(driver, url, timeout=60)
    answer = None
    for name in (first, second):
        answer = browser_page.click_example(driver, name, timeout=60, after=answer)
        want = expected[name]
        assert answer.label == want[0][0], name
        assert [n for n, _ in answer.probs] == [n for n, _ in answer.rows] == [n for n, _ in want], name
        np.testing.assert_allclose([p for _, p in answer.probs], [p for _, p in want], atol=1e-6, rtol=0)
        for (_, percent), (_, p) in zip(answer.rows, want):
            assert abs(float(percent.rstrip("%")) - 100 * p) <= 0.5 + 1e-6  # gr.Label's whole percent


@pytest.mark.slow
@pytest.mark.skipif(browser_page.chromium() is None, reason="chromium and chromedriver are not installed")
def test_screenshot_command_writes_the_page_with_its_answer(ckpts, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = browser_page.main(["--ckpt", str(ckpts("learned")), "--example", "1", "--out", "shot/demo.png"])
    assert out == Path("shot/demo.png")
    with Image.open(out) as png:
        assert png.width >= 1000 and png.height >= 600
    assert "00001_6.png" in capsys.readouterr().out  # the second test-split example was uploaded


# --------------------------------------------------------------------------- the page's API (gradio_client)


@pytest.mark.slow  # Gradio's server and client: ~30 s on a shared 2-core machine
def test_gradio_client_finds_the_documented_classify_endpoint_and_gets_predict_pys_labels(ckpts, images, tmp_path):
    """A client relies on the endpoint's name (docs/demo.md): a classifier's page offers exactly /classify
    (Gradio auto-named the image and method triggers /on_image and /on_image_1), taking (image, method) and
    answering predict.py's top-k for the file."""
    from gradio_client import Client, handle_file

    ckpt = ckpts("learned")
    cfg = demo_cfg(tmp_path, ckpt, f"port={browser_page.free_port()}", "num_examples=0")
    page = demo_task.build_page(demo_model.load_model(cfg), cfg, [])
    page.queue()
    _, url, _ = page.launch(server_name="127.0.0.1", server_port=cfg.port, prevent_thread_lock=True, quiet=True,
                            ssr_mode=False)
    try:
        client = Client(url, verbose=False)
        endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
        assert sorted(endpoints) == ["/classify"], sorted(endpoints)
        assert [p["parameter_name"] for p in endpoints["/classify"]["parameters"]] == ["image", "method"]
        image = sorted(images.glob("*.png"))[0]
        expected = row_topk(predict_json(tmp_path / "p", ckpt, image, "topk=5")[image.name])
        label, *_ = client.predict(image=handle_file(str(image)), method="gradient", api_name="/classify")
        assert label["label"] == expected[0][0]
        got = [(c["label"], c["confidence"]) for c in label["confidences"]]
        assert [n for n, _ in got] == [n for n, _ in expected]
        np.testing.assert_allclose([p for _, p in got], [p for _, p in expected], atol=1e-6, rtol=0)
    finally:
        page.close()
