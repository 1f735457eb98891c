"""The first ten minutes: `python -m tecupy` and `python -m tecupy.build` explain themselves
(defaults in --help, one-line errors a user can fix, an estimate and a progress bar for
long work, error figures set against what the tests accept)."""
import io
import os
import subprocess
import sys

import pytest

from tecupy import __main__ as cli
from tecupy import build, loader
from tecupy._progress import Progress


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "--steps STEPS" in out and "(default: 3)" in out
    assert out.count("(default: auto)") == 2  # --size and --device


def test_bad_steps_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--steps", "0"])
    assert exit_.value.code == 2 and "--steps must be >= 1, got 0" in capsys.readouterr().err


def test_device_cuda_without_a_gpu_is_one_line():
    """A real process with no visible device: one line on stderr, no traceback."""
    import tecupy
    here = os.path.dirname(os.path.dirname(os.path.abspath(tecupy.__file__)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=here)  # the tecupy under test
    proc = subprocess.run([sys.executable, "-m", "tecupy", "--device", "cuda"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tecupy: --device cuda, but ")
    assert "--device cpu" in lines[0]


@pytest.mark.parametrize("problem", [
    "no NVIDIA driver is installed (libcuda not found)",
    "the NVIDIA driver cannot run CUDA 13 (it needs driver 580 or newer): "
    "cudaErrorInsufficientDriver",
    "the GPU (Tesla T4) is sm_75; tecupy's kernels need sm_80 or newer"])
def test_gpu_problems_are_one_line(monkeypatch, problem):
    monkeypatch.setattr(cli, "gpu_problem", lambda: problem)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--device", "cuda"])
    message = str(exit_.value.code)
    assert problem in message and "\n" not in message


def test_auto_device_says_why_it_runs_on_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr(cli, "gpu_problem", lambda: "CuPy sees no CUDA device")
    assert cli.pick_device("auto") == "cpu"
    assert "no GPU (CuPy sees no CUDA device)" in capsys.readouterr().out


def test_slow_size_on_the_cpu_warns_with_an_estimate(monkeypatch, capsys):
    class Stop(Exception):
        pass

    def stop(*args):
        raise Stop
    monkeypatch.setattr(cli, "build", stop)  # stop before the minutes of work
    with pytest.raises(Stop):
        cli.main(["--size", "full", "--device", "cpu", "--steps", "1"])
    out = capsys.readouterr().out
    assert "hidden=4096" in out
    assert "this will take about" in out and "--size small runs in seconds" in out


def test_estimate_scales_with_the_layer():
    small = cli.step_flops(*cli.SIZES["small"])
    full = cli.step_flops(*cli.SIZES["full"])
    assert 9e12 < full < 12e12  # ~10.7 TFLOP: 3 x (GEMMs + attention) of the quickstart layer
    assert full / small > 1e4


def test_main_job_sets_errors_against_the_tolerances(capsys):
    cli.main(["--device", "cpu", "--steps", "1"])
    out = capsys.readouterr().out
    assert "accepted by the tests" in out
    rows = [line for line in out.splitlines() if " / 0.125 " in line or " / 0.25 " in line]
    assert len(rows) == 3 and all(row.rstrip().endswith("ok") for row in rows), out
    assert "one E4M3 round trip of the input" in out


def test_progress_on_a_pipe_prints_a_line_per_tenth():
    stream = io.StringIO()
    with Progress(40, "kernels", stream=stream) as bar:
        for _ in range(40):
            bar.advance()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11  # the first item, then each tenth
    assert lines[-1].startswith("[" + "#" * 24 + "] 40/40 kernels")


def test_build_shows_progress(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    one = {"delayed_scaling.cu": loader.declared("sm_90a")["delayed_scaling.cu"][:1]}
    monkeypatch.setattr(loader, "declared", lambda arch=None: one)
    build.main(["--arch", "sm_90a"])
    out, err = capsys.readouterr()
    assert "compiling 1 kernels for sm_90a" in out and "delayed_scaling.cu" in out
    assert "1/1 kernels" in err
