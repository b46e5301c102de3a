"""The demo page in a real browser: start ``scripts/demo.py``, upload an image in headless Chromium (or
click a gallery example, or switch the attention map), read the page's answer and fetch the images it
shows, and (as a command) save a screenshot of it.

    python tests/drivers/demo_screenshot.py --ckpt <ckpt | run dir | last> [--image <file> | --example N] \
        --out docs/img/demo.png

The same functions drive tests/test_demo.py's browser tests, so the picture and the test cannot drift.
Needs Chromium and its driver (Debian: ``apt-get install chromium chromium-driver``) and selenium
(the dev extra). The server is a subprocess of this one on 127.0.0.1 and a free port, stopped by its
PID; every wait is bounded in time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"
URL_LINE = re.compile(r"vitpipe demo: (http://\S+)")


def chromium() -> tuple[str, str] | None:
    """(chromium binary, chromedriver) found on PATH, or None."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_demo(overrides: list[str], *, cwd: Path, log: Path, timeout: float = 180.0,
               env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``python scripts/demo.py <overrides>`` in ``cwd`` (output to ``log``); returns (process, page URL)
    once the page answers, within ``timeout`` seconds (else the process is stopped and RuntimeError
    holds the end of its log)."""
    import urllib.request

    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "NO_PROXY": "127.0.0.1,localhost", **(env or {})}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), *overrides], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline, url = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"scripts/demo.py exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if url is None:
            found = URL_LINE.search(log.read_text(errors="replace"))
            url = found.group(1) if found else None
        if url is not None:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return proc, url
            except OSError:
                pass
        time.sleep(0.25)
    stop_demo(proc)
    raise RuntimeError(f"scripts/demo.py did not serve within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def stop_demo(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """SIGTERM to that PID, then SIGKILL after ``timeout`` seconds; returns its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
    return proc.returncode


def browser(width: int = 1280, height: int = 900):
    """Headless Chromium through chromedriver (selenium); RuntimeError when either is missing."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = chromium()
    if found is None:
        raise RuntimeError("chromium and chromedriver are not on PATH "
                           "(Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    driver.set_page_load_timeout(60)
    return driver


@dataclass
class PageAnswer:
    label: str  # the top label, as the page's gr.Label heading shows it
    percent: str  # its confidence as shown, e.g. "33%"
    rows: list[tuple[str, str]]  # every shown (label, percent), most probable first
    overlay_size: tuple[int, int]  # (width, height) of the overlay image the page received
    input_size: tuple[int, int]  # (width, height) of the model-input image
    probs: list[tuple[str, float]] = field(default_factory=list)  # (label, the value its bar was drawn from)
    overlay_src: str = ""  # the URL (or data URL) of the overlay image shown
    input_src: str = ""  # of the model-input image


def open_page(driver, url: str, *, timeout: float = 60.0):
    """Load the page and wait (bounded) for its image input; returns that file input element."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    return WebDriverWait(driver, timeout, poll_frequency=0.25).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#image input[type=file]"))


def upload(driver, url: str, image: Path, *, timeout: float = 60.0) -> PageAnswer:
    """Open the page, give the file input ``image``, and wait (bounded) until the label and both images show."""
    open_page(driver, url, timeout=timeout).send_keys(str(Path(image).resolve()))
    return wait_answer(driver, timeout=timeout)


def wait_answer(driver, *, timeout: float = 60.0, after: PageAnswer | None = None) -> PageAnswer:
    """The page's answer once the label and both images show; given ``after`` (an earlier answer), once an
    image differs from that answer's too (the page has answered the next event). Bounded by ``timeout``."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def answered(d):
        heads = d.find_elements(By.CSS_SELECTOR, "#topk [data-testid=label-output-value]")
        imgs = [d.find_elements(By.CSS_SELECTOR, f"#{i} img") for i in ("overlay", "model-input")]
        if not heads or not heads[0].text.strip() or not all(imgs):
            return False
        shown = [d.execute_script("const i = arguments[0]; return [i.naturalWidth, i.naturalHeight, i.src]", i[0])
                 for i in imgs]
        if after is not None and [s for _, _, s in shown] == [after.overlay_src, after.input_src]:
            return False
        return (heads[0].text.strip(), shown) if all(w > 0 for w, _, _ in shown) else False

    label, ((ow, oh, overlay_src), (iw, ih, input_src)) = WebDriverWait(driver, timeout, poll_frequency=0.25).until(
        answered, message=f"no {'new ' if after else ''}answer on the page within {timeout:.0f} s")
    rows, probs = [], []
    for r in driver.find_elements(By.CSS_SELECTOR, "#topk .confidence-set"):
        name = r.find_element(By.CSS_SELECTOR, "dt").text.strip()
        rows.append((name, r.find_element(By.CSS_SELECTOR, "dd").text.strip()))
        probs.append((name, float(r.find_element(By.CSS_SELECTOR, "meter").get_attribute("value"))))
    return PageAnswer(label=label, percent=rows[0][1] if rows else "", rows=rows, overlay_size=(ow, oh),
                      input_size=(iw, ih), probs=probs, overlay_src=overlay_src, input_src=input_src)


def choose_method(driver, method: str, shown: PageAnswer, *, timeout: float = 60.0) -> PageAnswer:
    """Click the attention-map radio button ``method`` ("rollout" | "gradient") and wait (bounded) for the
    overlay the page draws for it, replacing the one in ``shown``."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, f'#method input[type=radio][value="{method}"]').click()
    return wait_answer(driver, timeout=timeout, after=shown)


def click_example(driver, name: str, *, timeout: float = 60.0, after: PageAnswer | None = None) -> PageAnswer:
    """Click the thumbnail of the example file ``name`` (e.g. ``00001_6.png``) in the page's examples
    gallery and wait (bounded) for the page's answer (a new one, given the previous answer ``after``)."""
    from selenium.webdriver.common.by import By

    names = {}  # the file name at the end of each thumbnail's URL -> its button
    for item in driver.find_elements(By.CSS_SELECTOR, "#examples .gallery-item"):
        for img in item.find_elements(By.CSS_SELECTOR, "img")[:1]:
            names[img.get_attribute("src").rsplit("/", 1)[-1]] = item
    if name not in names:
        raise RuntimeError(f"no example {name!r} on the page; it shows {sorted(names)}")
    names[name].click()
    return wait_answer(driver, timeout=timeout, after=after)


FETCH = """const [src, done] = arguments;
fetch(src).then(r => r.ok ? r.blob() : Promise.reject(r.status)).then(b => {
  const f = new FileReader(); f.onload = () => done(f.result); f.readAsDataURL(b); }).catch(e => done('error: ' + e));"""


def shown_image(driver, src: str, *, timeout: float = 30.0):
    """The image at ``src`` (an <img>'s URL or data URL on the page) as the browser fetches it: (H, W, 3) uint8."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    driver.set_script_timeout(timeout)
    data = driver.execute_async_script(FETCH, src)
    if not data.startswith("data:"):
        raise RuntimeError(f"cannot fetch {src[:200]} in the page: {data}")
    with Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[1]))) as image:
        return np.asarray(image.convert("RGB"))


PAGE_SIZE = """const app = document.querySelector('gradio-app') || document.body;
const inner = [...app.querySelectorAll('*')].reduce((m, e) => Math.max(m, e.getBoundingClientRect().bottom), 0);
return [document.documentElement.clientWidth,
        Math.max(document.documentElement.scrollHeight, app.scrollHeight, inner + window.scrollY)];"""


def screenshot(driver, out: Path) -> Path:
    """The whole page as a PNG (the viewport grown to the page's content, which Gradio lays out in its own
    scrolling element), written via temp + rename."""
    from vitpipe.run.files import atomic_write

    for _ in range(3):  # a taller viewport can re-flow the page: measure again (bounded)
        width, height = driver.execute_script(PAGE_SIZE)
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": int(width), "height": min(int(height) + 24, 3000), "deviceScaleFactor": 1, "mobile": False})
        time.sleep(0.5)
        if driver.execute_script(PAGE_SIZE)[1] <= height:
            break
    png = driver.get_screenshot_as_png()
    atomic_write(Path(out), lambda f: f.write(png))
    return Path(out)


def example_image(ckpt: str, index: int, folder: Path) -> Path:
    """The ``index``-th test-split example of the checkpoint's data, as the page writes its examples."""
    from vitpipe.inference.load import load_predictor
    from vitpipe.run.paths import default_paths
    from vitpipe.tasks.demo import split_examples

    loaded = load_predictor(ckpt, paths=default_paths(), task_name="demo")
    files = split_examples(loaded.built.datamodule, index + 1, folder)
    if len(files) <= index:
        raise SystemExit(f"demo_screenshot: --example {index}: the checkpoint's test split gives {len(files)} "
                         "example(s) here; pass --image <file>")
    return files[index]


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="ckpt_path of scripts/demo.py: a .ckpt file, a run dir or last")
    p.add_argument("--image", type=Path, help="the image file uploaded to the page (default: a test-split example)")
    p.add_argument("--example", type=int, default=0, help="without --image: the test-split example of this index")
    p.add_argument("--out", default=Path("docs/img/demo.png"), type=Path)
    p.add_argument("--method", default="rollout", choices=("rollout", "gradient"))
    args = p.parse_args(argv)
    if args.image is not None and not args.image.is_file():
        p.error(f"--image {args.image}: no such file")
    if args.example < 0:
        p.error(f"--example {args.example}: expected an index >= 0")
    work = Path.cwd()  # the server's too: ckpt_path=last and data/ mean the same here and there
    image = args.image or example_image(args.ckpt, args.example, work / "demo_screenshot_input")
    log = work / "demo_screenshot.log"
    proc, url = start_demo([f"ckpt_path={args.ckpt}", f"port={free_port()}", f"method={args.method}"],
                           cwd=work, log=log)
    try:
        driver = browser()
        try:
            answer = upload(driver, url, image)
            out = screenshot(driver, args.out)
        finally:
            driver.quit()
    finally:
        stop_demo(proc)
    print(f"demo_screenshot: {out} (page: {answer.label} {answer.percent} for {image.name})")
    return out


if __name__ == "__main__":
    main()
