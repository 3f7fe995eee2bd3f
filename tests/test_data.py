"""The synthetic data set's validation split, and the validation ImageFolder of a real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from elastic.config import DataConfig, SyntheticDataConfig
from elastic.data import (
    SPEC_FILE,
    ValImageFolder,
    ensure_synthetic,
    eval_transform,
    val_root,
)

SMALL = SyntheticDataConfig(classes=3, images_per_class=4, image_size=16, val_images_per_class=2)


def synthetic(
    root: Path, val_dir: str = "val", generate: SyntheticDataConfig = SMALL
) -> DataConfig:
    return DataConfig(root=str(root), val_dir=val_dir, generate=generate, crop_size=16)


def test_the_val_split_has_its_own_images_of_the_same_classes(tmp_path: Path) -> None:
    cfg = synthetic(tmp_path / "data")
    assert ensure_synthetic(cfg)
    train = sorted((tmp_path / "data" / "train").rglob("*.jpg"))
    val = sorted((tmp_path / "data" / "val").rglob("*.jpg"))
    assert len(train) == 3 * 4 and len(val) == 3 * 2
    assert {p.parent.name for p in val} == {p.parent.name for p in train}
    assert not {p.read_bytes() for p in val} & {p.read_bytes() for p in train}


def test_changing_the_val_split_regenerates_an_old_cache(tmp_path: Path) -> None:
    root = tmp_path / "data"
    assert ensure_synthetic(synthetic(root))
    assert not ensure_synthetic(synthetic(root))  # the same settings: kept
    spec = json.loads((root / SPEC_FILE).read_text())
    (root / SPEC_FILE).write_text(json.dumps({**spec, "version": 1}))  # made before val splits
    assert ensure_synthetic(synthetic(root))
    more = SyntheticDataConfig(classes=3, images_per_class=4, image_size=16, val_images_per_class=3)
    assert ensure_synthetic(synthetic(root, generate=more))
    assert len(list((root / "val").rglob("*.jpg"))) == 3 * 3


def test_no_val_dir_means_no_validation(tmp_path: Path) -> None:
    cfg = synthetic(tmp_path / "data", val_dir="")
    assert val_root(cfg) is None
    assert ensure_synthetic(cfg)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [SPEC_FILE, "train"]
    with pytest.raises(ValueError, match="data.val_dir"):
        ValImageFolder(cfg)


def test_val_dir_cannot_be_the_train_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.val_dir='train'"):
        ensure_synthetic(synthetic(tmp_path / "data", val_dir="train"))


def test_the_val_folder_is_centre_cropped_deterministically(tmp_path: Path) -> None:
    cfg = synthetic(tmp_path / "data")
    ensure_synthetic(cfg)
    val = ValImageFolder(cfg)
    assert len(val) == 6
    assert [val[i][1] for i in range(6)] == [0, 0, 1, 1, 2, 2]
    image, _ = val[3]
    assert image.shape == (3, 16, 16)
    assert torch.equal(image, val[3][0])


def test_the_eval_transform_is_the_reference_one() -> None:
    resize, crop = eval_transform(224).transforms[:2]
    assert (resize.size, crop.size) == (256, (224, 224))
    image = Image.new("RGB", (60, 40))  # short side 40 -> 18 (16 * 256 / 224), centre 16 x 16
    assert eval_transform(16)(image).shape == (3, 16, 16)


def make_folder(root: Path, classes: list[str]) -> None:
    for c in classes:
        (root / c).mkdir(parents=True)
        Image.new("RGB", (20, 20), "red").save(root / c / "a.jpg")


def real(root: Path) -> DataConfig:
    return DataConfig(root=str(root), synthetic=False, crop_size=16)


def test_labels_follow_the_training_split_when_val_lacks_a_class(tmp_path: Path) -> None:
    make_folder(tmp_path / "train", ["ant", "bee", "cat"])
    make_folder(tmp_path / "val", ["bee", "cat"])
    val = ValImageFolder(real(tmp_path))
    assert [val[i][1] for i in range(len(val))] == [1, 2]


@pytest.mark.parametrize(
    ("val_classes", "says"),
    [(None, "is not a directory"), ([], "no class folders"), (["cat", "dog"], "['dog']")],
)
def test_a_missing_or_wrong_val_split_names_the_key_and_the_fix(
    tmp_path: Path, val_classes: list[str] | None, says: str
) -> None:
    make_folder(tmp_path / "train", ["ant", "cat"])
    if val_classes is not None:
        (tmp_path / "val").mkdir()
        make_folder(tmp_path / "val", val_classes)
    with pytest.raises(FileNotFoundError) as info:
        ValImageFolder(real(tmp_path))
    message = str(info.value)
    assert message.startswith("data.val_dir='val'") and says in message
    assert 'data.val_dir=""' in message
