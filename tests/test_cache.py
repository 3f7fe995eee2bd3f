"""Facts learned once per package version (elastic/cache.py): torchvision's model names for
validation and a model's checkpoint size for the disk check, read back instead of importing
torchvision in every launcher and agent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic import cache
from elastic.config import Config, ModelConfig, torchvision_models
from launcher.health.checks import model_bytes


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ELASTIC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_fact_is_learned_once_and_learned_again_when_its_file_is_bad(folder: Path) -> None:
    learned: list[int] = []

    def learn() -> int:
        learned.append(1)
        return 42

    def positive(found: object) -> bool:
        return isinstance(found, int) and found > 0

    assert cache.cached("fact-1.0", positive, learn) == 42
    assert cache.cached("fact-1.0", positive, learn) == 42 and len(learned) == 1
    assert json.loads((folder / "fact-1.0.json").read_text()) == 42
    (folder / "fact-1.0.json").write_text("-3")  # read, but not a valid fact
    assert cache.cached("fact-1.0", positive, learn) == 42 and len(learned) == 2
    (folder / "fact-1.0.json").write_text("{half")
    assert cache.cached("fact-1.0", positive, learn) == 42 and len(learned) == 3
    assert [p.name for p in folder.iterdir()] == ["fact-1.0.json"]  # no partial file left


def test_a_folder_that_cannot_be_written_only_costs_learning_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ELASTIC_CACHE", str(tmp_path / "file" / "cache"))  # under a file
    assert cache.cached("fact", lambda found: True, lambda: [1, 2]) == [1, 2]


def test_torchvision_models_and_a_model_size_come_from_torchvision_then_from_the_cache(
    folder: Path,
) -> None:
    from torchvision import models

    listed = models.list_models(module=models)
    assert torchvision_models() == listed and "resnet50" in listed
    [names] = folder.glob("torchvision-*-models.json")
    names.write_text('["only_this"]')
    assert torchvision_models() == ["only_this"]  # what validation uses is the cache's

    cfg = Config(model=ModelConfig(name="resnet18"))
    size = model_bytes(cfg)
    # resnet18 with 10 classes: 11.2 M parameters, twice (the momentum), plus BN buffers.
    assert 85e6 < size < 95e6, size
    [sized] = folder.glob("model-bytes-*-torch-*.json")  # keyed by the job, model and data
    assert json.loads(sized.read_text()) == size
    sized.write_text("1234")
    assert model_bytes(cfg) == 1234
