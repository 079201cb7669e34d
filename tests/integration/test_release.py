"""The release (.github/workflows/release.yml, docs/howto/install.md "Releases"): what can
be checked without GitHub — the workflow's triggers, jobs, permissions and the commands
it runs — and the container image, built and run where a Docker daemon answers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import uuid

import pytest
import yaml

import lbproxy
from lbproxy.net.compiled import C_API
from tests.integration.harness import ROOT

pytestmark = pytest.mark.integration

WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"


@pytest.fixture(scope="module")
def workflow() -> dict:
    document = yaml.safe_load(WORKFLOW.read_text())
    # YAML 1.1 (PyYAML) reads the key `on` as the boolean true; GitHub reads it as "on"
    document["on"] = document.pop(True)
    return document


def steps_using(job: dict, action: str) -> list[dict]:
    return [step for step in job["steps"] if step.get("uses", "").startswith(action + "@")]


def test_it_runs_on_a_version_tag_only(workflow):
    assert workflow["on"] == {"push": {"tags": ["v*"]}}
    assert workflow["permissions"] == {}  # each job asks for its own
    assert set(workflow["jobs"]) == {"sdist", "wheels", "pypi", "image"}


def test_every_action_is_pinned_to_a_release():
    for job in yaml.safe_load(WORKFLOW.read_text())["jobs"].values():
        for step in job["steps"]:
            if "uses" in step:
                ref = step["uses"].partition("@")[2]
                assert ref.startswith(("v", "release/v")), step["uses"]


def test_the_sdist_job_builds_with_the_tests_build_and_checks_the_tag(workflow, tmp_path):
    job = workflow["jobs"]["sdist"]
    runs = [step["run"] for step in job["steps"] if "run" in step]
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    build = next(r for r in pinned["optional-dependencies"]["test"] if r.startswith("build=="))
    assert f"python -m pip install {build}" in runs
    assert "python -m build --sdist --outdir dist" in runs
    (upload,) = steps_using(job, "actions/upload-artifact")
    assert upload["with"]["path"] == "dist/*.tar.gz"
    # The tag check, run here as the runner would: the right tag passes, another fails.
    (check,) = [r for r in runs if "GITHUB_REF_NAME" in r]
    version = lbproxy.__version__
    for tag, code in ((f"v{version}", 0), (f"v{version}.1", 1), (version, 1)):
        result = subprocess.run(
            ["bash", "-e", "-c", check],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GITHUB_REF_NAME": tag},
        )
        assert result.returncode == code, (tag, result.stdout, result.stderr)


def test_the_wheels_are_manylinux_x86_64_and_aarch64_with_the_compiled_path(workflow):
    job = workflow["jobs"]["wheels"]
    matrix = job["strategy"]["matrix"]["include"]
    assert {entry["arch"] for entry in matrix} == {"x86_64", "aarch64"}
    (build,) = [step for step in job["steps"] if "cibuildwheel --output-dir" in step.get("run", "")]
    env = build["env"]
    assert env["CIBW_ARCHS_LINUX"] == "${{ matrix.arch }}"
    assert env["CIBW_BUILD"] == "cp3*-manylinux_*"
    assert "connection path: compiled (lbproxy.net._cpump)" in env["CIBW_TEST_COMMAND"]
    (upload,) = steps_using(job, "actions/upload-artifact")
    assert upload["with"]["path"] == "wheelhouse/*.whl"


def test_pypi_gets_the_sdist_and_wheels_by_trusted_publishing(workflow):
    job = workflow["jobs"]["pypi"]
    assert set(job["needs"]) == {"sdist", "wheels"}
    assert job["environment"]["name"] == "pypi"
    assert job["permissions"] == {"id-token": "write"}
    (download,) = steps_using(job, "actions/download-artifact")
    assert download["with"] == {"pattern": "dist-*", "path": "dist", "merge-multiple": True}
    uploads = [
        step["with"]["name"]
        for name in ("sdist", "wheels")
        for step in steps_using(workflow["jobs"][name], "actions/upload-artifact")
    ]
    assert all(name.startswith("dist-") for name in uploads)
    (publish,) = steps_using(job, "pypa/gh-action-pypi-publish")
    # trusted publishing: no password nor token given
    assert publish["with"] == {"packages-dir": "dist"}


def test_the_image_is_the_dockerfile_pushed_to_ghcr(workflow):
    job = workflow["jobs"]["image"]
    assert job["permissions"] == {"contents": "read", "packages": "write"}
    (login,) = steps_using(job, "docker/login-action")
    assert login["with"]["registry"] == "ghcr.io"
    assert login["with"]["password"] == "${{ secrets.GITHUB_TOKEN }}"
    (meta,) = steps_using(job, "docker/metadata-action")
    assert meta["with"]["images"] == "ghcr.io/${{ github.repository_owner }}/lbproxy"
    assert "type=semver,pattern={{version}}" in meta["with"]["tags"]
    (push,) = steps_using(job, "docker/build-push-action")
    assert push["with"]["push"] is True
    assert (ROOT / push["with"]["context"] / push["with"]["file"]).is_file()
    assert push["with"]["tags"] == "${{ steps.meta.outputs.tags }}"
    assert set(push["with"]["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}


def _docker_daemon() -> str | None:
    """Why no image can be built here, or None when a Docker daemon answers."""
    if shutil.which("docker") is None:
        return "no docker command"
    info = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if info.returncode != 0 or not info.stdout.strip():
        last = (info.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"no Docker daemon answers ({last})"
    return None


@pytest.mark.timeout(1800)
def test_the_image_builds_and_runs_lbproxy():
    """The image the workflow pushes: built from the Dockerfile, `lbproxy --version` in
    it. Skipped (also in CI) where no Docker daemon runs."""
    reason = _docker_daemon()
    if reason is not None:
        pytest.skip(f"the container image is not built here: {reason}")
    tag = f"lbproxy-test:{uuid.uuid4().hex[:12]}"
    built = subprocess.run(
        ["docker", "build", "-t", tag, str(ROOT)], capture_output=True, text=True, timeout=1700
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    try:
        ran = subprocess.run(
            ["docker", "run", "--rm", tag, "--version"], capture_output=True, text=True, timeout=120
        )
        assert ran.stdout.splitlines() == [
            f"lbproxy, version {lbproxy.__version__}",
            "connection path: compiled (lbproxy.net._cpump)",
        ], ran.stderr
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)


def test_the_sdist_builds_the_compiled_path(tmp_path):
    """The sdist the release publishes holds every file the C extension's build reads
    (_cpump.c and the parts it includes): built from the unpacked sdist alone, the
    extension compiles and is the one this source calls (its C_API)."""
    dist = tmp_path / "dist"
    dist.mkdir()
    sdist = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(dist),
         "sdist", "--dist-dir", str(dist)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert sdist.returncode == 0, sdist.stderr
    (archive,) = dist.glob("lbproxy-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (tree,) = (tmp_path / "unpacked").iterdir()
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "temp")],
        cwd=tree, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # The extension is optional: a failed compile is only a warning, so look for it.
    found = list((tmp_path / "lib" / "lbproxy" / "net").glob("_cpump.*.so"))
    assert len(found) == 1, build.stderr
    (built,) = found
    check = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u, sys; s = u.spec_from_file_location("
         "'lbproxy.net._cpump', sys.argv[1]); m = u.module_from_spec(s); s.loader.exec_module(m);"
         " print(m.C_API)", str(built)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert check.stdout.strip() == str(C_API), check.stderr
