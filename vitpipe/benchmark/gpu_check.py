"""The GPU check, unattended, in at most 8 minutes on one GPU: the gpu-marked tests, the ViT-B/16
benchmark (throughput and MFU in bf16-mixed, then TF32), the Fashion-MNIST recipe with its test
accuracy (and mirror TTA), then plain fp32 and the speed switches if time is left.

  bash scripts/gpu_check.sh [--cpu-dry-run] [--print-steps] [OUT_DIR]

OUT_DIR (default: $OUT, else ./gpu_check_out) receives gpu_check.json (every figure and each step's
status, rc, seconds), gpu_check.md (the same as tables) and gpu_check.log (the end of each step's
output). Each step runs under a timeout within what is left of GPU_CHECK_BUDGET_S (default 480 s);
a failed or timed-out step is recorded and the next one runs. The three files are rewritten after
every step, so a run stopped from outside leaves what it had measured. Run files (checkpoints, data)
go to GPU_CHECK_WORK (default: a new folder under /tmp), not OUT_DIR.

On the GPU machine (torch, lightning, timm, pytest there; hydra-core and omegaconf not): when
`import hydra, omegaconf` fails, scripts/gpu_check.sh installs the wheels in .whl/ into /tmp/site
before this module starts (importing vitpipe needs them). Fashion-MNIST is read from Debian's
/usr/share/datasets/fashion-mnist or from .gpu_data/fashion-mnist; without either, the recipe step
is skipped with a line saying so. scripts/gpu_wheels.sh fills both folders on a machine with a
package index; carry them with the working tree.

GPU_CHECK_ONLY=tests,recipe (names as in gpu_check.json) runs only those steps, e.g. to redo one.
--print-steps prints each step's name and command (tab-separated, shell-quoted) and runs nothing
(tests/test_gpu_check.py checks them against the test file, benchmark.py's flags and the configs).

--cpu-dry-run (or GPU_CHECK_DRY_RUN=1): the same steps, tiny, on the CPU (--device cpu, trainer=cpu,
vit_micro, a few batches), to prove the check on a machine without a GPU. Its figures are CPU
figures. The gpu tests skip there, unless GPU_CHECK_TESTS_ON_CPU=1 (VITPIPE_GPU_TEST_DEVICE=cpu:
the tests' own logic on the CPU, several minutes on 2 cores).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from vitpipe.benchmark.gpu_report import write_report

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the steps run scripts/ and tests/ from it
FMNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                "t10k-labels-idx1-ubyte.gz")
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
CARRIED_FMNIST = ROOT / ".gpu_data" / "fashion-mnist"
MIN_STEP_S = 15  # a step given less than this is skipped: it could not even start up
KILL_AFTER_S = 10  # as `timeout -k 10`: SIGTERM first, SIGKILL to what is left this much later


@dataclass
class Check:
    """One run of the check: its settings, the clock, and the steps recorded so far."""

    out: Path
    work: Path
    dry: bool
    printing: bool
    budget: int
    only: set[str] | None
    start: float = field(default_factory=time.monotonic)
    steps: list[dict] = field(default_factory=list)

    def remaining(self) -> int:
        return int(self.budget - (time.monotonic() - self.start))

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only

    def record(self, name: str, status: str, rc: int | None, seconds: int, note: str = "") -> None:
        if not self.printing:
            self.steps.append({"step": name, "status": status, "rc": rc, "seconds": seconds,
                               "note": note.replace("\t", " ")})

    def report(self) -> None:
        if self.printing:
            return
        try:
            write_report(self.work, self.out, dry=self.dry, budget=self.budget, steps=self.steps)
        except Exception as e:  # the check goes on: the raw files stay in work/
            print(f"gpu_check: the report failed ({type(e).__name__}: {e}); raw files are in {self.work}", file=sys.stderr)

    def step(self, name: str, max_s: int, reserve_s: int, argv: list[str]) -> None:
        """Run ``argv`` for at most ``max_s`` seconds and never into the last ``reserve_s`` of the budget
        (kept for later steps); its output goes to logs/NAME.log."""
        if not self.wanted(name):
            return
        if self.printing:
            print(f"{name}\t{shlex.join(argv)}")
            return
        limit = min(max_s, self.remaining() - reserve_s)
        if limit < MIN_STEP_S:
            self.record(name, "skipped", None, 0, f"budget spent: {self.remaining()} s of {self.budget} s left")
            print(f"== {name}: skipped (budget spent)")
            self.report()
            return
        print(f"== {name} (at most {limit} s): {shlex.join(argv)}", flush=True)
        t0 = time.monotonic()
        rc = run_bounded(argv, limit, self.work / "logs" / f"{name}.log")
        seconds = int(time.monotonic() - t0)
        status, note = {0: ("ok", ""), 124: ("timeout", f"stopped by timeout after {limit} s"),
                        137: ("timeout", f"stopped by timeout after {limit} s")}.get(rc, ("failed", None))
        if note is None:
            note = last_error_line(self.work / "logs" / f"{name}.log")
        self.record(name, status, rc, seconds, note)
        print(f"   {status} (rc {rc}, {seconds} s)", flush=True)
        self.report()


def run_bounded(argv: list[str], limit: float, log: Path) -> int:
    """Exit status of ``argv`` run from the checkout, output to ``log``; after ``limit`` seconds its whole
    process group (DataLoader workers, servers) gets SIGTERM, then SIGKILL: 124 or 137, as `timeout`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:  # `python scripts/x.py` puts scripts/, not the checkout, on sys.path
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, paths)])
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_AFTER_S)
                return 124
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                return 137


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group is the step's own
    except ProcessLookupError:
        pass


def last_error_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if re.search(r"error|Error|FAILED", line)]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def has_fmnist(folder: Path) -> bool:
    return all((folder / name).is_file() for name in FMNIST_FILES)


def plan(check: Check) -> None:
    """The steps in order; each runs (or, with --print-steps, is printed) when its turn comes, since a
    step's limit depends on the time the ones before it took."""
    py, work, dry = sys.executable, check.work, check.dry
    device, trainer, variant = ("cpu", "cpu", "vit_micro") if dry else ("cuda", "gpu", "vit_b16")
    bench_size = (["--batch-size", "4", "--steps", "2", "--warmup", "1", "--repeats", "1", "--workers", "0"] if dry
                  else ["--batch-size", "256", "--steps", "20", "--warmup", "5", "--repeats", "3"])
    recipe_short = [] if not dry else ["trainer.max_epochs=1", "++trainer.limit_train_batches=3",
                                       "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2"]
    eval_short = ["++trainer.limit_test_batches=2"] if dry else []
    tests_on_cpu = dry and os.environ.get("GPU_CHECK_TESTS_ON_CPU", "0") == "1"
    tests_max, test_timeout = (700, 400) if tests_on_cpu else (200, 170)

    # 1. the machine
    check.step("env", 60, 0, [py, "-m", "vitpipe.benchmark.gpu_env", str(work / "env.json"),
                              *(["--cpu-dry-run"] if dry else [])])

    # 2. the gpu-marked tests (each writes its figures to $VITPIPE_GPU_FIGURES); -v: one line per test as
    # it ends, which the report reads when a timeout leaves no junit.xml
    pytest_args = ["-v", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={work / 'junit.xml'}"]
    if _importable("pytest_timeout"):
        pytest_args.append(f"--timeout={test_timeout}")
    test_env = ["env", f"VITPIPE_GPU_FIGURES={work / 'figures'}"]
    if tests_on_cpu:
        test_env += ["VITPIPE_GPU_TEST_DEVICE=cpu", "OMP_NUM_THREADS=1"]
    check.step("tests", tests_max, 180, [*test_env, py, "-m", "pytest", *pytest_args])

    # 3. throughput and MFU: ViT-B/16 (dry run: vit_micro), vitpipe vs timm and Lightning vs a plain loop
    bench = [py, "scripts/benchmark.py", "--device", device]
    check.step("bench_bf16", 90, 100, [*bench, "--precision", "bf16-mixed", "--variant", variant, *bench_size,
                                       "--only", "vit,lightning", "--out", str(work / "bench_bf16.json")])
    if device == "cuda":  # fp32 matmuls on TF32 tensor cores (--tf32: float32_matmul_precision high), vit only
        check.step("bench_tf32", 45, 120, [*bench, "--precision", "32-true", "--tf32", "--variant", variant,
                                           "--batch-size", "256", "--steps", "10", "--warmup", "3", "--repeats", "2",
                                           "--only", "vit", "--out", str(work / "bench_tf32.json")])

    # 4. the Fashion-MNIST recipe fitted to the time left (trainer.time_budget), then mirror TTA
    if not check.printing and has_fmnist(DEBIAN_FMNIST):
        recipe_data = []
    elif check.printing or has_fmnist(CARRIED_FMNIST):  # printing: the carried case
        recipe_data = [f"+data.system_dir={CARRIED_FMNIST}"]
    else:
        recipe_data = None
    if not check.wanted("recipe"):
        pass
    elif recipe_data is not None:
        left = check.remaining() - 40  # the TTA evaluation after it
        # the recipe's time budget fits its schedule (and its test) to what is left; the timeout is the backstop
        seconds = left - 40  # start-up (data, teacher) and the test phase after training
        if seconds >= 30:
            runs = [f"paths.data_dir={work / 'data'}", f"paths.log_dir={work / 'logs_runs'}"]
            check.step("recipe", left, 40, [py, "scripts/train.py", "experiment=fmnist_vit", f"trainer={trainer}",
                                            "data.download=false", *recipe_data, *recipe_short,
                                            f"trainer.time_budget={int(seconds)}s", *runs,
                                            f"hydra.run.dir={work / 'fmnist'}"])
            if check.printing or (work / "fmnist" / "metrics.json").is_file():
                check.step("recipe_tta", 40, 0, [py, "scripts/eval.py", f"ckpt_path={work / 'fmnist'}", "tta=hflip",
                                                 f"trainer={trainer}", *eval_short, *runs,
                                                 f"hydra.run.dir={work / 'fmnist_tta'}"])
            else:
                check.record("recipe_tta", "skipped", None, 0, "the recipe wrote no metrics.json")
        else:
            check.record("recipe", "skipped", None, 0, f"budget spent: {check.remaining()} s left")
    else:
        check.record("recipe", "skipped", None, 0, "no Fashion-MNIST: neither /usr/share/datasets/fashion-mnist nor "
                     ".gpu_data/fashion-mnist (run scripts/gpu_wheels.sh, carry .gpu_data)")
    check.report()

    # 5. if time is left: plain fp32 (no TF32), then the speed switches (fused AdamW, compile, SDPA backends)
    if device == "cuda":
        short = ["--batch-size", "256", "--steps", "10", "--warmup", "3", "--repeats", "2"]
        check.step("bench_fp32", 60, 0, [*bench, "--precision", "32-true", "--variant", variant, *short,
                                         "--only", "vit", "--out", str(work / "bench_fp32.json")])
        check.step("bench_switches", 120, 0, [*bench, "--precision", "bf16-mixed", "--variant", variant, *short,
                                              "--only", "switches", "--out", str(work / "bench_switches.json")])
    else:
        check.step("bench_switches", 60, 0, [*bench, "--precision", "32-true", "--variant", variant, *bench_size,
                                             "--only", "switches", "--switches", "adamw_fused,sdpa_math",
                                             "--out", str(work / "bench_switches.json")])


def _importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def wheels_step(check: Check) -> None:
    """Record what scripts/gpu_check.sh did about hydra and omegaconf before Python could import vitpipe
    (GPU_CHECK_WHEELS: status, seconds, note, tab-separated; its pip log in GPU_CHECK_WHEELS_LOG)."""
    status, seconds, note = (os.environ.get("GPU_CHECK_WHEELS", "") + "\t\t").split("\t")[:3]
    if not status:
        status, seconds, note = "ok", "0", "hydra and omegaconf importable (not started by scripts/gpu_check.sh)"
    check.record("wheels", status, 0 if status == "ok" else 1, int(seconds or 0), note)
    log = os.environ.get("GPU_CHECK_WHEELS_LOG")
    if log and Path(log).is_file():
        os.replace(log, check.work / "logs" / "wheels.log")


def parse(argv: list[str]) -> tuple[bool, bool, str | None] | int:
    """(dry run, print steps, OUT_DIR or None), or the exit status when there is nothing to run."""
    dry, printing, out = os.environ.get("GPU_CHECK_DRY_RUN", "0") == "1", False, None
    for arg in argv:
        if arg == "--cpu-dry-run":
            dry = True
        elif arg == "--print-steps":
            printing = True
        elif arg in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        elif arg.startswith("-"):
            print(f"gpu_check: error: unknown option {arg} (valid: --cpu-dry-run, an output directory)", file=sys.stderr)
            return 2
        else:
            out = arg
    return dry, printing, out


def main(argv: list[str] | None = None) -> int:
    parsed = parse(sys.argv[1:] if argv is None else argv)
    if isinstance(parsed, int):
        return parsed
    dry, printing, out = parsed
    out = Path(out or os.environ.get("OUT") or "./gpu_check_out")
    tests_on_cpu = dry and os.environ.get("GPU_CHECK_TESTS_ON_CPU", "0") == "1"
    budget = int(os.environ.get("GPU_CHECK_BUDGET_S") or (1000 if tests_on_cpu else 480))
    only = os.environ.get("GPU_CHECK_ONLY") or None
    if printing:
        work = Path(os.environ.get("GPU_CHECK_WORK") or "/tmp/gpu_check.print")  # named in the commands, never made
    else:
        out.mkdir(parents=True, exist_ok=True)
        out = out.resolve()
        work = Path(os.environ.get("GPU_CHECK_WORK") or tempfile.mkdtemp(prefix="gpu_check.", dir="/tmp"))
        for sub in ("logs", "figures"):
            (work / sub).mkdir(parents=True, exist_ok=True)
    check = Check(out=out, work=work, dry=dry, printing=printing, budget=budget,
                  only=None if only is None else set(only.split(",")))
    if not printing:
        print(f"gpu_check: mode {'cpu-dry-run' if dry else 'gpu'}, budget {budget} s, out {out}, work {work}", flush=True)
        wheels_step(check)
    plan(check)
    if printing:
        return 0
    check.report()
    bad = sum(s["status"] in ("failed", "timeout") for s in check.steps)
    print(f"gpu_check: done in {int(time.monotonic() - check.start)} s, {bad} step(s) failed; "
          f"{out}/gpu_check.{{json,md,log}}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
