"""The generated data sets (the stripes' validation split, scikit-learn's digits written as an
ImageFolder), and the validation ImageFolder of a real one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from elastic.config import ConfigError, DataConfig, DataSource, SyntheticDataConfig
from elastic.data import SeededImageFolder, ValImageFolder, eval_transform, val_root
from elastic.synthetic import SPEC_FILE, ensure_synthetic
from launcher.compose import validate_launch

from .test_config import composed

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


DIGITS = SyntheticDataConfig(
    source=DataSource.digits, classes=3, images_per_class=5, val_images_per_class=4, image_size=16
)


def source_scan(path: Path, scans: np.ndarray) -> int:
    """The index in ``load_digits`` of the 8x8 scan a JPEG was made from, found by its pixels
    alone: the JPEG shrunk back to 8x8 is nearest to it (the scans are all different)."""
    shrunk = Image.open(path).convert("L").resize((8, 8), Image.Resampling.BOX)
    grey = np.asarray(shrunk, dtype=np.float64) * 16 / 255
    return int(np.argmin(((scans - grey) ** 2).sum(axis=(1, 2))))


def test_the_digits_are_a_balanced_seeded_split_with_no_scan_in_both(tmp_path: Path) -> None:
    cfg = synthetic(tmp_path / "data", generate=DIGITS)
    assert ensure_synthetic(cfg)
    digits = load_digits()
    sources: dict[str, list[int]] = {}
    for split, per_class in (("train", 5), ("val", 4)):
        folders = sorted((tmp_path / "data" / split).iterdir())
        assert [f.name for f in folders] == ["digit_0", "digit_1", "digit_2"]
        for digit, folder in enumerate(folders):
            images = sorted(folder.glob("*.jpg"))
            assert len(images) == per_class
            scans = [source_scan(p, digits.images) for p in images]
            assert [int(digits.target[i]) for i in scans] == [digit] * per_class  # labels right
            # The names say the same: each JPEG is named by its scan's index.
            assert [p.name for p in images] == [f"img_{i:05d}.jpg" for i in sorted(scans)]
            sources.setdefault(split, []).extend(scans)
    assert len(set(sources["train"])) == 15 and len(set(sources["val"])) == 12
    assert not set(sources["train"]) & set(sources["val"])
    # The trainer's readers label them by folder, as the digits are.
    assert [SeededImageFolder(cfg, seed=0)[(0, i)][1] for i in (0, 5, 14)] == [0, 1, 2]
    val = ValImageFolder(cfg)
    assert [val[i][1] for i in range(len(val))] == [0] * 4 + [1] * 4 + [2] * 4
    assert val[0][0].shape == (3, 16, 16)

    # The same seed gives the same split anywhere; another seed another split.
    again = synthetic(tmp_path / "again", generate=DIGITS)
    ensure_synthetic(again)
    assert sorted(p.name for p in (tmp_path / "again").rglob("*.jpg")) == sorted(
        p.name for p in (tmp_path / "data").rglob("*.jpg")
    )
    other = SyntheticDataConfig(**{**vars(DIGITS), "seed": 1})
    ensure_synthetic(synthetic(tmp_path / "other", generate=other))
    assert sorted(p.name for p in (tmp_path / "other" / "val").rglob("*.jpg")) != sorted(
        p.name for p in (tmp_path / "data" / "val").rglob("*.jpg")
    )


def test_switching_the_source_regenerates_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "data"
    stripes = SyntheticDataConfig(**{**vars(DIGITS), "source": DataSource.stripes})
    assert ensure_synthetic(synthetic(root, generate=stripes))
    assert (root / "train" / "class_000").is_dir()
    assert ensure_synthetic(synthetic(root, generate=DIGITS))
    assert sorted(p.name for p in (root / "train").iterdir()) == [f"digit_{d}" for d in range(3)]


def test_the_digits_preset_is_valid_and_crops_at_least_half_a_digit() -> None:
    cfg = composed("data=digits")
    validate_launch(cfg)
    assert cfg.data.generate.source == DataSource.digits
    assert "/digits-10x100+74-20px-seed0" in cfg.data.root
    assert cfg.data.min_crop_scale == 0.5
    assert composed().data.min_crop_scale == 0.08  # ImageNet's, elsewhere


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["data.generate.classes=11"], "data.generate.classes", "10 or fewer"),
        (
            ["data.generate.images_per_class=150", "data.generate.val_images_per_class=25"],
            "data.generate.images_per_class",
            "add up to 174 at most",
        ),
        (["data.min_crop_scale=0"], "data.min_crop_scale", "a share in (0, 1]"),
    ],
)
def test_digits_the_data_set_cannot_give_are_refused_with_the_fix(
    overrides: list[str], key: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as err:
        validate_launch(composed("data=digits", *overrides))
    assert f"{key}=" in str(err.value) and fix in str(err.value)


def test_174_of_a_digit_pass_and_without_validation_only_the_training_split_counts() -> None:
    validate_launch(composed("data=digits", "data.generate.images_per_class=74"))
    no_val = 'data.val_dir=""'
    validate_launch(composed("data=digits", "data.generate.images_per_class=174", no_val))


def test_the_digits_without_scikit_learn_name_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("sklearn", "sklearn.datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails: not installed
    with pytest.raises(ConfigError) as err:
        validate_launch(composed("data=digits"))
    assert "data.generate.source='digits'" in str(err.value)
    assert "pip install '.[digits]'" in str(err.value)
    with pytest.raises(ImportError, match=r"pip install '\.\[digits\]'"):
        ensure_synthetic(synthetic(tmp_path / "data", generate=DIGITS))
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
