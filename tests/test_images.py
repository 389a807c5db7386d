"""The images and the pods that run them agree, checked without building anything.

`make images` and `make e2e-local` build and run the images (minutes, buildah); this is the fast
half that `make test` keeps: every path a Dockerfile copies exists, every image runs as the uid
the rendered pod runs as, the commands the pod runs are the console scripts the image installs,
and every path an image writes at run time (its `dev.kvasir.writable-paths` label, which
e2e-local checks against what the containers really write) is a writable volume of the
container that runs it, so `readOnlyRootFilesystem: true` holds.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvasir_operator.pod import CACHE_OWNER_CONTAINER, POD_UID
from kvasir_operator.render import Owner, render_deployment
from kvasir_operator.spec import spec_hash
from kvasir_operator.spec_parse import parse_spec

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))
# Which Dockerfile builds the image each rendered container runs (the fetch: the operator's).
CONTAINER_TO_DOCKERFILES = {"engine": ("engine-cpu.Dockerfile", "engine.Dockerfile"),
                            "kvasir-fetch": ("operator.Dockerfile",),
                            CACHE_OWNER_CONTAINER: ("operator.Dockerfile",)}
# The console scripts of each Dockerfile's package.
DOCKERFILE_TO_PACKAGE = {"engine.Dockerfile": "engine", "engine-cpu.Dockerfile": "engine",
                         "operator.Dockerfile": "operator", "gateway.Dockerfile": "gateway"}


def final_stage(path: Path) -> list[str]:
    """The instructions of the last stage, continuation lines joined, comments dropped."""
    lines = re.sub(r"\\\n", " ", path.read_text()).splitlines()
    instructions = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    last_from = max(i for i, line in enumerate(instructions) if line.startswith("FROM "))
    return instructions[last_from:]


def writable_paths(path: Path) -> list[str]:
    for line in final_stage(path):
        if match := re.fullmatch(r'LABEL dev\.kvasir\.writable-paths="([^"]*)"', line):
            return match.group(1).split()
    raise AssertionError(f"{path.name}: no dev.kvasir.writable-paths label in its final stage")


def scripts(package: str) -> set[str]:
    project = tomllib.loads((REPO / package / "pyproject.toml").read_text())["project"]
    return set(project.get("scripts", {}))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_paths_that_exist(dockerfile: Path) -> None:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    copies = re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.M)
    assert copies, f"{dockerfile.name} copies nothing"
    for copy in copies:
        *sources, _ = shlex.split(copy)
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_as_the_pod_uid_and_its_entrypoint_is_installed(dockerfile: Path) -> None:
    stage = final_stage(dockerfile)
    assert f"USER {POD_UID}:{POD_UID}" in stage
    commands = [line for line in stage if line.startswith(("ENTRYPOINT [", "CMD ["))]
    program = next(yaml.safe_load(line.split(" ", 1)[1]) for line in commands
                   if yaml.safe_load(line.split(" ", 1)[1]))[0]
    assert program in scripts(DOCKERFILE_TO_PACKAGE[dockerfile.name])
    env = " ".join(line for line in stage if line.startswith("ENV "))
    writable = writable_paths(dockerfile)
    # Every cache or home directory the image points its programs at lies in a writable path.
    for name, value in re.findall(r"(\w*(?:HOME|CACHE\w*|_DIR))=(/\S*)", env):
        assert any(value == w or value.startswith(w + "/") for w in writable), (
            f"{dockerfile.name}: {name}={value} is outside {writable}")


def rendered_pod(raw: dict[str, Any]) -> dict[str, Any]:
    spec = parse_spec("m", raw)
    deployment = render_deployment(spec, Owner("m", "ns", "uid"), spec_hash(spec), 10**8)
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


@pytest.mark.parametrize("cache", [{"type": "hostPath", "path": "/mnt/nvme/kvasir"},
                                   {"type": "emptyDir"}, {"type": "pvc", "claimName": "c"}])
def test_rendered_pod_gives_each_image_its_writable_paths(cache: dict[str, Any]) -> None:
    pod = rendered_pod({"model": {"uri": "s3://models/smollm2"}, "cache": cache,
                        "resources": {"gpus": 0}})
    assert pod["securityContext"]["runAsUser"] == POD_UID
    assert pod["securityContext"]["runAsGroup"] == POD_UID
    for container in [*pod["initContainers"], *pod["containers"]]:
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        if container["name"] == CACHE_OWNER_CONTAINER:
            # The one root step: chown of the hostPath's root, nothing else written.
            assert sc["capabilities"]["add"] == ["CHOWN"] and sc["runAsUser"] == 0
            assert container["command"][0] == "chown"
            continue
        assert "runAsUser" not in sc  # the pod's uid, the image's USER
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        for name in CONTAINER_TO_DOCKERFILES[container["name"]]:
            dockerfile = REPO / "docker" / name
            assert container["command"][0] in scripts(DOCKERFILE_TO_PACKAGE[name])
            for path in writable_paths(dockerfile):
                assert path in mounts and not mounts[path].get("readOnly"), (
                    f"{container['name']} writes {path} ({name}) but the pod mounts no "
                    f"writable volume there")
    names = [c["name"] for c in pod["initContainers"]]
    assert names == ([CACHE_OWNER_CONTAINER] if cache["type"] == "hostPath" else []) + [
        "kvasir-fetch"]


def test_the_cpu_e2e_model_is_where_the_cpu_image_puts_it() -> None:
    from kvasir_engine.args import DEFAULT_MODEL_FILE

    manifest = yaml.safe_load((REPO / "e2e" / "smollm2.yaml").read_text())
    uri = manifest["spec"]["model"]["uri"]
    assert uri == f"/opt/models/{DEFAULT_MODEL_FILE}"
    assert "/opt/models/" in (REPO / "docker" / "engine-cpu.Dockerfile").read_text()
    assert manifest["spec"]["engine"]["image"] == "kvasir-engine:dev"
    # The e2e pod runs the image make images builds, the engine under the same name.
    assert "kvasir-engine:$tag" in (REPO / "docker" / "build.sh").read_text()


def test_make_images_builds_with_the_script() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^images:.*\n\tdocker/build\.sh", makefile, flags=re.M)
    assert re.search(r"^e2e-local:.*\n(\t.*\n)*\t.*e2e/local_pod\.py", makefile, flags=re.M)
