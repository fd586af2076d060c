"""Licence files and the images' licence labels; hadolint's exceptions are exactly the documented ones."""

from __future__ import annotations

import hashlib
import io

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.conftest import ROOT

PINS = yaml.safe_load((ROOT / "containers" / "pins.yaml").read_text())
IMAGE_STACKS = sorted(name for name, s in PINS["stacks"].items() if s["kind"] == "image")
DOCKERFILES = sorted({PINS["stacks"][name]["dockerfile"] for name in IMAGE_STACKS})
# sha256 of the Apache License 2.0 text as the ASF publishes it (LICENSE-2.0.txt, 11357 bytes)
APACHE_2_0 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"


def test_license_is_the_apache_2_0_text_pyproject_declares() -> None:
    assert hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_0
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text().splitlines()


def test_notice_states_fsdpturbo_clause_and_the_label_expression() -> None:
    notice = (ROOT / "NOTICE").read_text()
    assert "FSDPTurbo -- NON-COMMERCIAL USE ONLY" in notice
    assert "仅供您用于非商业目的" in notice
    assert f"`{PINS['image']['licenses']}`" in notice
    assert "LicenseRef-FSDPTurbo-NonCommercial" in PINS["image"]["licenses"]


@pytest.mark.parametrize("stack", IMAGE_STACKS)
def test_images_carry_notice_and_point_to_it(stack: str) -> None:
    from containers import build

    dockerfile = PINS["stacks"][stack]["dockerfile"]
    parser = DockerfileParser(fileobj=io.BytesIO((ROOT / dockerfile).read_bytes()))
    copies = [i["value"].split() for i in parser.structure if i["instruction"] == "COPY"]
    assert any({"LICENSE", "NOTICE"} <= set(c[:-1]) and c[-1] == "/opt/engine/" for c in copies), copies
    assert ["--from=builder", "/opt/engine", "/opt/engine"] in copies
    assert parser.labels["io.qwen35-grpo.notice"].startswith("/opt/engine/NOTICE: ")
    assert 'org.opencontainers.image.licenses="${IMAGE_LICENSES}"' in (ROOT / dockerfile).read_text()
    assert build.build_args(stack, PINS, revision="0" * 40)["IMAGE_LICENSES"] == PINS["image"]["licenses"]


def test_hadolint_exceptions_are_the_documented_ones() -> None:
    for dockerfile in DOCKERFILES:
        assert "hadolint ignore" not in (ROOT / dockerfile).read_text(), dockerfile
    ignored = yaml.safe_load((ROOT / "containers" / ".hadolint.yaml").read_text())["ignored"]
    assert ignored == ["DL3008"]
    assert "only DL3008 is ignored" in (ROOT / "docs" / "reference" / "containers.md").read_text()
